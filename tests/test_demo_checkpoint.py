"""The tiny demo checkpoint and the test checkpoints: loadable by transformers, cached, in the right layouts.

The checkpoints are written without transformers; these tests load them in transformers and compare the
tensor names, shapes and config with what transformers itself makes for the same settings."""
import importlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from qwen35_fast.runtime import Qwen35Error, load_model
from qwen35_fast.runtime.chat import format_chat
from qwen35_fast.runtime.demo_checkpoint import (
    COMPLETE_MARKER,
    DEMO_NAME,
    SINGLE_FILE_NAME,
    demo_checkpoint,
    make_checkpoint,
    tensor_shapes,
    tiny_configs,
    tiny_qwen35_config,
)
from qwen35_fast.runtime.tokenizer import load_tokenizer

# The module itself (the package exports a function of the same name).
demo_mod = importlib.import_module("qwen35_fast.runtime.demo_checkpoint")

REAL_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "qwen35-tokenizer"
SMALL = dict(vocab_size=1024)  # keeps the variant checkpoints to a few MB


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return demo_checkpoint(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def demo_hf(demo):
    return _load_hf(demo)


@pytest.fixture(scope="module")
def demo_tok(demo):
    return load_tokenizer(demo)


def _load_hf(folder: Path):
    from transformers import Qwen3_5ForConditionalGeneration
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.float().eval()


def _text_keys(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def test_demo_folder_is_a_complete_checkpoint(demo):
    assert demo.name == DEMO_NAME
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", COMPLETE_MARKER]:
        assert (demo / name).is_file(), name
    assert not list(demo.parent.glob(f".{DEMO_NAME}-*")), "temporary folders left behind"

    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(demo)
    assert config.model_type == "qwen3_5"
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (128, 4, 248_320)
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (2, 4)
    assert text.linear_key_head_dim == text.linear_value_head_dim == 128
    rope = text.rope_parameters
    assert sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"] / 2
    assert config.vision_config.out_hidden_size == text.hidden_size
    generation = json.loads((demo / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [248_046, 248_044]
    tensors = _text_keys(demo)
    assert tensors["model.language_model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "lm_head.weight" not in tensors  # tied, like the small Qwen3.5 models


def test_demo_loads_in_transformers_and_gives_varied_finite_logits(demo_hf, demo_tok):
    model = demo_hf
    ids = torch.tensor([demo_tok.encode(format_chat("Describe a lighthouse at dusk, briefly."))])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 248_320)
    assert torch.isfinite(logits).all()
    # The adjusted init: predictions follow the context rather than echoing each input token.
    predicted = logits[0].argmax(-1)
    assert len(set(predicted.tolist())) > ids.shape[1] // 2
    assert (predicted == ids[0]).float().mean() < 0.5


def test_demo_greedy_generation_does_not_repeat_one_token(demo_hf, demo_tok):
    ids = torch.tensor([demo_tok.encode(format_chat("Hello there, how are you?"))])
    with torch.no_grad():
        out = demo_hf.generate(ids, max_new_tokens=10, do_sample=False)
    generated = out[0, ids.shape[1]:].tolist()
    assert len(set(generated)) >= 5, generated


def test_demo_norms_are_not_at_their_init_values(demo):
    tensors = _text_keys(demo)
    for key in ["model.language_model.layers.0.input_layernorm.weight", "model.language_model.norm.weight",
                "model.language_model.layers.3.self_attn.q_norm.weight"]:
        assert tensors[key].float().abs().mean() > 0.01, key  # zero-centred, applied as 1 + w
    gated = tensors["model.language_model.layers.0.linear_attn.norm.weight"].float()
    assert (gated - 1).abs().mean() > 0.01 and (gated.mean() - 1).abs() < 0.2  # one-centred


def test_demo_tokenizer_files(demo_tok):
    tok = demo_tok
    package = load_tokenizer(None)
    assert tok.source.endswith("tokenizer.json")
    assert tok.vocab_size == package.vocab_size and tok.special_token_ids == package.special_token_ids
    for text in ["Hello, world!  \n\n\tx", "北京 😀 👨‍👩‍👧", "हिन्दी भाषा में", "<|im_start|>user\nhi<|im_end|><think>",
                 "def f(x):\n    return x ** 2\n", "12345 3.14", "e\u0301 cafe\u0301"]:
        assert tok.encode(text) == package.encode(text), text


def test_demo_tokenizer_in_transformers(demo, demo_tok):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(demo)
    for text in ["हिन्दी भाषा में", "Hello <|im_start|>user\n世界<|im_end|>"]:
        assert hf.encode(text, add_special_tokens=False) == demo_tok.encode(text), text
    messages = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == format_chat("Hi")


@pytest.mark.skipif(not (REAL_TOKENIZER / "tokenizer.json").is_file(), reason="../shared/qwen35-tokenizer is absent")
def test_demo_tokenizer_json_has_the_real_vocabulary_and_merges(demo):
    ours = json.loads((demo / "tokenizer.json").read_text(encoding="utf-8"))
    real = json.loads((REAL_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    assert ours["model"] == real["model"]
    assert ours["added_tokens"] == real["added_tokens"]
    assert ours["normalizer"] == real["normalizer"] and ours["decoder"] == real["decoder"]


def test_demo_chat_template_renders_like_format_chat(demo):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string((demo / "chat_template.jinja").read_text(encoding="utf-8"))
    for system in ["", "Be brief."]:
        for thinking in [False, True]:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": " Two\nlines "}]
            rendered = template.render(messages=messages, add_generation_prompt=True, enable_thinking=thinking)
            assert rendered == format_chat(" Two\nlines ", system, thinking)


def test_demo_is_cached(demo):
    weights = demo / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert demo_checkpoint(demo.parent) == demo
    assert time.perf_counter() - start < 0.5
    assert weights.stat().st_mtime_ns == mtime


def _fake_make(calls):
    def make(folder, text_overrides=None, seed=0, single_file=False, **kwargs):
        calls.append(folder)
        (Path(folder) / "config.json").write_text("{}")
        return Path(folder)
    return make


def test_cache_replaces_an_incomplete_folder(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(demo_mod, "make_checkpoint", _fake_make(calls))
    stale = tmp_path / DEMO_NAME
    stale.mkdir()
    (stale / "model.safetensors").write_text("half written")
    (stale / COMPLETE_MARKER).write_text(json.dumps({"format": demo_mod.DEMO_FORMAT - 1}))
    path = demo_checkpoint(tmp_path)
    assert path == stale and len(calls) == 1
    assert (path / "config.json").is_file() and not (path / "model.safetensors").exists()
    assert demo_checkpoint(tmp_path) == path and len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(folder, **kwargs):
        (Path(folder) / "partial").write_text("x")
        raise RuntimeError("disk full")
    monkeypatch.setattr(demo_mod, "make_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        demo_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["cut short", "same size, other bytes", "deleted", "marker unreadable",
                                    "marker entry not an object"])
def test_damaged_cache_is_built_again(tmp_path, monkeypatch, caplog, damage):
    calls = []
    monkeypatch.setattr(demo_mod, "make_checkpoint", _fake_make(calls))
    path = demo_checkpoint(tmp_path)
    config = path / "config.json"
    if damage == "cut short":
        config.write_text("{")
    elif damage == "same size, other bytes":
        config.write_text("[]")
    elif damage == "deleted":
        config.unlink()
    elif damage == "marker unreadable":
        (path / COMPLETE_MARKER).write_text("{not json")
    else:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        marker["files"] = {name: 1 for name in marker["files"]}
        (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger=demo_mod.__name__):
        assert demo_checkpoint(tmp_path) == path
    assert len(calls) == 2 and config.read_text() == "{}"
    assert "building it again" in caplog.text and "re-download" not in caplog.text
    assert demo_checkpoint(tmp_path) == path and len(calls) == 2  # and now it is trusted again
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]


def test_cut_short_demo_weights_are_rebuilt_byte_for_byte(demo, tmp_path):
    copy = tmp_path / DEMO_NAME
    shutil.copytree(demo, copy)
    weights = copy / "model.safetensors"
    original = (demo / "model.safetensors").read_bytes()
    weights.write_bytes(original[: len(original) // 2])  # as an interrupted copy or a full disk leaves it
    assert demo_mod.damage(copy) == f"model.safetensors has {len(original) // 2} bytes, {len(original)} were written"
    assert demo_checkpoint(tmp_path) == copy
    assert weights.read_bytes() == original  # the build is deterministic: the same seed, the same file
    assert load_model(copy, dtype="fp32", device="cpu", backend="torch") is not None


def test_a_cache_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(Qwen35Error, match=r"the demo checkpoint is built in .*file.*qwen35_fast, which cannot be made "
                                          r"or written .* set XDG_CACHE_HOME to a folder you can write"):
        demo_checkpoint(tmp_path / "file" / "qwen35_fast")


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """A cache folder that exists but this user cannot write (os.access says so; a test run as root could write any
    folder): the same message, not the PermissionError the temporary build folder would raise in it."""
    parent = tmp_path / "qwen35_fast"
    parent.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == parent and mode & os.W_OK
                        else real(path, mode, **kw))
    with pytest.raises(Qwen35Error, match=r"the demo checkpoint is built in .*qwen35_fast, which cannot be made or "
                                          r"written \(cannot write to .*\); set XDG_CACHE_HOME"):
        demo_checkpoint(parent)
    assert list(parent.iterdir()) == []  # nothing begun in it


def test_default_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo_mod.default_cache_dir() == tmp_path / "qwen35_fast"


@pytest.mark.parametrize("tied", [True, False])
def test_single_file_has_comfyui_text_encoder_keys(tmp_path, tied):
    overrides = {**SMALL, "tie_word_embeddings": tied}
    folder = make_checkpoint(tmp_path / "hf", overrides, seed=3)
    path = make_checkpoint(tmp_path / "single", overrides, seed=3, single_file=True)
    assert path == tmp_path / "single" / SINGLE_FILE_NAME
    assert sorted(p.name for p in path.parent.iterdir()) == [SINGLE_FILE_NAME]  # no config, no tokenizer

    single = _text_keys(path.parent)
    full = _text_keys(folder)
    expected = {k for k in full if k.startswith("model.language_model.")} | ({"lm_head.weight"} if not tied else set())
    assert set(single) == expected
    assert all(torch.equal(single[k], full[k]) for k in expected)
    for key in ["model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
                "model.language_model.layers.0.linear_attn.A_log",
                "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                "model.language_model.layers.3.self_attn.q_proj.weight"]:
        assert key in single, key
    # What ComfyUI's text-encoder detection looks for (comfy/sd.py).
    assert single["model.language_model.layers.0.input_layernorm.weight"].shape == (128,)


def test_single_file_with_vision(tmp_path):
    path = make_checkpoint(tmp_path, SMALL, seed=0, single_file=True, include_vision=True)
    keys = set(_text_keys(path.parent))
    assert "model.visual.patch_embed.proj.weight" in keys and "model.visual.merger.linear_fc2.weight" in keys


def test_same_seed_same_weights(tmp_path):
    a = _text_keys(make_checkpoint(tmp_path / "a", SMALL, seed=5, single_file=True).parent)
    b = _text_keys(make_checkpoint(tmp_path / "b", SMALL, seed=5, single_file=True).parent)
    c = _text_keys(make_checkpoint(tmp_path / "c", SMALL, seed=6, single_file=True).parent)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.language_model.embed_tokens.weight"], c["model.language_model.embed_tokens.weight"])


def _hf_config(config: dict):
    from transformers import Qwen3_5Config
    return Qwen3_5Config(text_config=config["text_config"], vision_config=config["vision_config"],
                         tie_word_embeddings=config["tie_word_embeddings"])


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_tensor_layout_and_config_match_transformers(name):
    from transformers import Qwen3_5ForConditionalGeneration
    config = tiny_qwen35_config({**tiny_configs()[name], **SMALL})
    text = config["text_config"]
    assert len(text["layer_types"]) == text["num_hidden_layers"]
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(_hf_config(config))
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if config["tie_word_embeddings"]:
        theirs.pop("lm_head.weight")  # tied: transformers does not save it either
    assert tensor_shapes(config) == theirs
    # What transformers writes into config.json for the same settings, apart from its version stamp.
    written = hf.config.to_diff_dict() | {"architectures": ["Qwen3_5ForConditionalGeneration"], "dtype": "bfloat16"}
    written.pop("transformers_version", None)
    assert json.loads(json.dumps(config)) == json.loads(json.dumps(written))


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_tiny_variants_load_in_transformers(tmp_path, name):
    overrides = {**tiny_configs()[name], **SMALL}
    folder = make_checkpoint(tmp_path, overrides, seed=1)
    model = _load_hf(folder)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 20).unsqueeze(0)).logits
    assert logits.shape == (1, 19, 1024) and torch.isfinite(logits).all()


def test_sharded_checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path, SMALL, seed=2, max_shard_size="200KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in folder.glob("model-*.safetensors"))
    whole = _text_keys(make_checkpoint(tmp_path / "whole", SMALL, seed=2))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for file in shards:  # no shard over the limit unless it holds one tensor
        tensors = _text_keys_of(folder / file)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 200_000
    sharded = _text_keys(folder)
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[k], whole[k]) for k in whole)
    _load_hf(folder)


def _text_keys_of(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(file))


@pytest.mark.parametrize("size", ["200 parsecs", "-5KB", "KB"])
def test_bad_shard_size_is_refused(tmp_path, size):
    with pytest.raises(ValueError, match="max_shard_size"):
        make_checkpoint(tmp_path, SMALL, max_shard_size=size)
