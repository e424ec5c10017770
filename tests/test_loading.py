"""Both checkpoint forms load; every bad input a user can cause gets a message naming it and the fix."""
import gc
import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from qwen35_fast.runtime import Qwen35Error, Qwen35Model, generate, load_model, prefill, prefill_ids
from qwen35_fast.runtime import loader as loader_mod

from _models import make_hf_model, read_tensors, rel, write_single_file


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("ck")
    make_hf_model(f, seed=3, vocab=248320, max_pos=160)
    return f


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder, dtype="fp32", device="cpu")


def test_folder_loads_with_backend_and_tokenizer(model):
    assert model.backend.name == "torch" and "cpu" in model.backend.reason
    assert model.tokenizer.encode("<|im_end|>") == [248046]
    assert model.config.num_hidden_layers == 4


def test_single_file_round_trips_to_the_same_logits(folder, model, tmp_path):
    single = write_single_file(folder, tmp_path / "qwen35_text.safetensors")
    other = load_model(single, dtype="fp32", device="cpu")
    # inferred from names and shapes alone; only the position limit cannot be read off the tensors
    assert replace(other.config, max_position_embeddings=160) == model.config
    ids = list(range(1000, 1090))
    assert rel(prefill_ids(other, ids).logits, prefill_ids(model, ids).logits) == 0.0


@pytest.mark.parametrize("text,head", [("language_model.", "language_model.lm_head.weight"),
                                       ("model.language_model.", "model.lm_head.weight")])
def test_other_key_layouts_load_with_their_own_output_layer(folder, model, tmp_path, text, head):
    """transformers' base-model layout (language_model.*) and ComfyUI's name for the output layer
    (model.lm_head.weight) load as the same model: the lm_head beside a text prefix is the model's own, not
    dropped for the tied embedding (which gave other logits)."""
    from safetensors import safe_open
    tensors = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.startswith("model.language_model."):
                    tensors[text + k[len("model.language_model."):]] = h.get_tensor(k)
                elif k == "lm_head.weight":
                    tensors[head] = h.get_tensor(k)
    save_file(tensors, str(tmp_path / "renamed.safetensors"))
    other = load_model(tmp_path / "renamed.safetensors", dtype="fp32", device="cpu")
    assert not other.config.tie_word_embeddings
    ids = list(range(1000, 1040))
    assert rel(prefill_ids(other, ids).logits, prefill_ids(model, ids).logits) == 0.0


def test_a_tied_config_beside_weights_with_their_own_output_layer_uses_that_layer(folder, model, tmp_path):
    """config.json says tie_word_embeddings but the files hold an lm_head.weight of their own (an untied model's
    weights under an edited config, or the tie only in text_config, which transformers' top level leaves untied):
    transformers uses the stored layer, and so does the loader (it was left unread: other logits)."""
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    (ck / "config.json").write_text(json.dumps(cfg))
    other = load_model(ck, dtype="fp32", device="cpu")
    assert not other.config.tie_word_embeddings and other.lm_head is not None
    ids = list(range(1000, 1040))
    assert rel(prefill_ids(other, ids).logits, prefill_ids(model, ids).logits) == 0.0


@pytest.mark.parametrize("rope, message", [
    ({"mrope_section": [16, 16]}, r"mrope_section is \[16, 16\]; it must be three whole numbers"),
    ({"mrope_section": [8, 8, 8, 8]}, r"mrope_section is \[8, 8, 8, 8\]"),
    ({"partial_rotary_factor": 2.0}, r"partial_rotary_factor 2.0 gives a rotary width of 512 of head_dim 256"),
    ({"partial_rotary_factor": 0.001}, r"rotary width of 0 of head_dim 256"),
])
def test_rotary_settings_the_layers_cannot_take_are_named(folder, tmp_path, rope, message):
    """mrope_section of other than three sections, or a rotary wider than a head (or none): refused by name at
    load, not a ValueError in the model's construction or a size mismatch at the first prompt."""
    ck = tmp_path / "ck"
    shutil.copytree(folder, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["rope_parameters"].update(rope)
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Qwen35Error, match=message):
        load_model(ck, dtype="fp32", device="cpu")


def test_a_nine_b_wide_file_without_its_output_layer_is_named(tmp_path):
    """A 4096-wide (9B) or 5120-wide (27B) file without lm_head.weight is a text-encoder export: those sizes have
    an output layer of their own, so it is refused by name instead of tying the embedding (gibberish)."""
    from qwen35_fast.runtime.config import infer_from_shapes
    with pytest.raises(Qwen35Error, match=r"4096-wide Qwen3.5 model \(9B\) without lm_head.weight.*text-encoder"):
        infer_from_shapes({"embed_tokens.weight": (248320, 4096)}, "qwen_3.5_9b_te.safetensors")

def test_a_file_safetensors_refuses_after_the_header_check_is_named(folder, tmp_path):
    """Bytes after the last tensor pass the header check, and safetensors refuses the file when the weights are
    read: the error names the file (it was safetensors' own, without a name)."""
    single = write_single_file(folder, tmp_path / "tail.safetensors")
    with open(single, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(Qwen35Error, match=r"tail.safetensors: safetensors cannot read it .*re-download"):
        load_model(single, dtype="fp32", device="cpu")

def test_missing_path():
    with pytest.raises(Qwen35Error, match=r"'/no/such/model' does not exist"):
        load_model("/no/such/model")


def test_not_a_qwen35_file_names_what_it_found(tmp_path):
    f = tmp_path / "sdxl.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.weight": torch.zeros(2)}, str(f))
    with pytest.raises(Qwen35Error, match=r"not a Qwen3.5 checkpoint.*model\.diffusion_model\.input_blocks"):
        load_model(f)


def test_other_model_type_in_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(Qwen35Error, match=r"model_type is 'llama'"):
        load_model(tmp_path)


def test_pickle_weights_are_refused(tmp_path):
    f = tmp_path / "model.ckpt"
    f.write_bytes(b"\x80\x04")
    with pytest.raises(Qwen35Error, match="never pickle"):
        load_model(f)


def test_truncated_safetensors(folder, tmp_path):
    single = write_single_file(folder, tmp_path / "full.safetensors")
    data = single.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(Qwen35Error, match=rf"truncated: its header needs {len(data)} bytes, the file has "
                                          rf"{len(data) - 1000}"):
        load_model(cut)


def test_weights_that_do_not_fit_the_config(folder, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Qwen35Error, match=r"mlp\.gate_proj\.weight has shape \[128, 64\] but the config needs "
                                          r"\[96, 64\]"):
        load_model(bad)


def test_failed_load_leaves_no_model_behind(folder, monkeypatch):
    from qwen35_fast.runtime import progress
    gc.collect()
    before = sum(isinstance(o, Qwen35Model) for o in gc.get_objects())
    seen = []

    def cancel_at_third(stage, done, total):  # a caller's cancel, between two weights
        seen.append((stage, done, total))
        if done == 3:
            raise KeyboardInterrupt("cancelled")
    with progress.reporting(cancel_at_third), pytest.raises(KeyboardInterrupt, match="cancelled"):
        load_model(folder, device="cpu")
    assert seen[0] == ("load", 1, seen[0][2]) and seen[-1][1] == 3 and seen[0][2] > 3
    gc.collect()
    assert sum(isinstance(o, Qwen35Model) for o in gc.get_objects()) == before

    def boom(model, ckpt, report=False):
        raise RuntimeError("disk went away")
    monkeypatch.setattr(loader_mod, "_fill", boom)
    with pytest.raises(RuntimeError, match="disk went away"):
        load_model(folder, device="cpu")
    gc.collect()
    assert sum(isinstance(o, Qwen35Model) for o in gc.get_objects()) == before


def test_bad_settings(folder):
    with pytest.raises(Qwen35Error, match="dtype 'fp8'"):
        load_model(folder, dtype="fp8", device="cpu")
    with pytest.raises(Qwen35Error, match="kernel backend 'triton'"):
        load_model(folder, device="cpu", backend="triton")
    with pytest.raises(Qwen35Error, match="needs a CUDA device"):
        load_model(folder, device="cpu", backend="cuda")


def test_prompt_longer_than_positions_names_both_numbers(model):
    with pytest.raises(Qwen35Error, match=r"the prompt has 200 tokens but the model takes at most 160 positions"):
        prefill_ids(model, [1000] * 200)


def test_empty_prompt(model):
    with pytest.raises(Qwen35Error, match="prompt is empty"):
        prefill(model, "   ")


def test_max_new_tokens_below_one(model):
    pf = prefill(model, "hello")
    with pytest.raises(Qwen35Error, match="max_new_tokens is 0; it must be a whole number, at least 1"):
        generate(model, pf, max_new_tokens=0)


@pytest.mark.parametrize("error", [  # made at each raise: a kept exception would keep its traceback's frames
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.90 GiB"),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                         "tried to allocate 400000000000000 bytes"),
])
def test_a_load_out_of_memory_says_what_the_weights_take_and_leaves_nothing(folder, monkeypatch, error):
    from qwen35_fast.runtime.checkpoint import locate
    from qwen35_fast.runtime.config import expected_shapes

    def full(model, ckpt, report=False):
        raise error()

    gc.collect()
    before = sum(isinstance(o, Qwen35Model) for o in gc.get_objects())
    monkeypatch.setattr(loader_mod, "_fill", full)
    gib = 4 * sum(math.prod(s) for s in expected_shapes(locate(folder).config).values()) / 2 ** 30
    with pytest.raises(Qwen35Error, match=rf"out of memory on cpu loading {folder.name}: its text weights alone take "
                                          rf"{gib:.2f} GiB in float32, and .* GiB of .* GiB is free. Pick a smaller "
                                          r"Qwen3.5 model, .*or load it on the cpu"):
        load_model(folder, dtype="fp32", device="cpu")
    gc.collect()
    assert sum(isinstance(o, Qwen35Model) for o in gc.get_objects()) == before


def test_a_cache_budget_that_does_not_fit_says_so(folder):
    """A fixed K/V cache budget larger than the device's memory: an error naming both and the fix, and the model
    keeps working with the auto budget."""
    model = load_model(folder, dtype="fp32", device="cpu")
    with pytest.raises(Qwen35Error, match=r"a K/V cache of 1073741824 MiB does not fit on cpu: \d+ MiB is free "
                                          r"beside the model's weights. Lower the loader's K/V cache budget, or set it "
                                          r"to 0 \(auto"):
        model.setup_kv(1 << 50)
    model.setup_kv()
    assert prefill_ids(model, [1, 2, 3]).logits.isfinite().all()


def test_config_values_other_than_the_defaults_are_read():
    """Every text setting a config can carry, read from transformers' own config dict with values other than the
    defaults (so a default in place of a read would show): norm eps, conv width, rotary theta / fraction /
    sections, the layer pattern, tied embeddings; a config without layer_types takes full_attention_interval
    (default 4, as transformers)."""
    from transformers import Qwen3_5Config

    from qwen35_fast.runtime.config import FULL, LINEAR, from_hf_dict
    rope = dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5, mrope_section=[12, 10, 10],
                mrope_interleaved=True)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=32, linear_value_head_dim=32, rms_norm_eps=1e-5, linear_conv_kernel_dim=3,
                max_position_embeddings=4096, rope_parameters=rope,
                layer_types=["full_attention", "linear_attention"] * 3)
    cfg = Qwen3_5Config(text_config=text, tie_word_embeddings=True).to_dict()
    c = from_hf_dict(cfg)
    assert (c.rms_norm_eps, c.linear_conv_kernel_dim, c.rope_theta, c.partial_rotary_factor, c.mrope_section,
            c.max_position_embeddings, c.tie_word_embeddings) == (1e-5, 3, 5e6, 0.5, (12, 10, 10), 4096, True)
    assert c.layer_types == (FULL, LINEAR) * 3
    assert not from_hf_dict(Qwen3_5Config(text_config=text, tie_word_embeddings=False).to_dict()).tie_word_embeddings
    bare = {k: v for k, v in cfg["text_config"].items() if k != "layer_types"}
    every = lambda n: tuple(FULL if (i + 1) % n == 0 else LINEAR for i in range(6))  # noqa: E731
    assert from_hf_dict({**cfg, "text_config": {**bare, "full_attention_interval": 3}}).layer_types == every(3)
    assert from_hf_dict({**cfg, "text_config": bare}).layer_types == every(4)
    text_only = from_hf_dict({**bare, "model_type": "qwen3_5_text", "tie_word_embeddings": True})
    assert text_only.tie_word_embeddings and text_only.rope_theta == 5e6


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0; Qwen3.5 models have 1 to 1024 layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers is True; Qwen3.5 models have 1 to 1024 layers"),
    ({"num_hidden_layers": 4.0}, "num_hidden_layers is 4.0; Qwen3.5 models have 1 to 1024 layers"),
])
def test_a_layer_count_that_is_no_whole_positive_number_is_refused(change, message):
    from qwen35_fast.runtime.config import from_hf_dict
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=32, linear_value_head_dim=32)
    assert len(from_hf_dict({"model_type": "qwen3_5", "text_config": text}).layer_types) == 4
    with pytest.raises(Qwen35Error, match=message):
        from_hf_dict({"model_type": "qwen3_5", "text_config": {**text, **change}})
    with pytest.raises(Qwen35Error, match="model_type is 'qwen3_5_moe', not a Qwen3.5 dense model"):
        from_hf_dict({"model_type": "qwen3_5_moe", "text_config": text})


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    f = tmp_path_factory.mktemp("untied")
    make_hf_model(f, seed=3, vocab=1024, max_pos=4096, tie=False)
    return f


@pytest.mark.parametrize("text,head", [("vlm.model.language_model.", "vlm.lm_head.weight"),
                                       ("text_encoders.qwen35.transformer.model.language_model.",
                                        "text_encoders.qwen35.transformer.lm_head.weight")])
def test_an_output_layer_beside_a_nested_prefix_is_the_models_own(untied, tmp_path, text, head):
    """A file whose text weights sit under <x>.model.language_model. (a VLM export) keeps its output layer at
    <x>.lm_head.weight: read as the model's own, not dropped for the embedding (which took the logits 1.4 away)."""
    from qwen35_fast.runtime.checkpoint import locate
    renamed = {}
    for k, v in read_tensors(untied).items():
        if k.startswith("model.language_model."):
            renamed[text + k[len("model.language_model."):]] = v
        elif k == "lm_head.weight":
            renamed[head] = v
    f = tmp_path / "renamed.safetensors"
    save_file(renamed, str(f))
    assert locate(f).tensors["lm_head.weight"][1] == head
    ids = list(range(10, 40))
    got = prefill_ids(load_model(f, dtype="fp32", device="cpu"), ids, use_cache=False).logits
    want = prefill_ids(load_model(untied, dtype="fp32", device="cpu"), ids, use_cache=False).logits
    assert torch.equal(got, want)


def test_a_missing_shard_without_an_index_is_named(untied, tmp_path):
    """A download of the shards without model.safetensors.index.json, one shard short: the missing file is named
    (it was a config 'that does not belong to these weights', for the layers it lacked)."""
    from qwen35_fast.runtime.checkpoint import locate
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(untied / "config.json", d)
    t = read_tensors(untied)
    names = sorted(t)
    save_file({k: t[k] for k in names[:len(names) // 2]}, str(d / "model-00001-of-00002.safetensors"))
    with pytest.raises(Qwen35Error, match=r"split into 2 files but model-00002-of-00002\.safetensors is missing"):
        locate(d)
    save_file({k: t[k] for k in names[len(names) // 2:]}, str(d / "model-00002-of-00002.safetensors"))
    assert locate(d).tensors  # complete: read


def test_a_config_saved_with_a_byte_order_mark_loads(folder, model, tmp_path):
    """config.json and the index edited in Windows' Notepad start with a UTF-8 byte order mark: read past it (the
    model list takes such a folder; loading it said 'not valid JSON')."""
    d = tmp_path / "bom"
    shutil.copytree(folder, d)
    for name in ("config.json", "model.safetensors.index.json"):
        if (d / name).exists():
            (d / name).write_bytes(b"\xef\xbb\xbf" + (d / name).read_bytes())
    ids = list(range(5, 20))
    assert torch.equal(prefill_ids(load_model(d, dtype="fp32", device="cpu"), ids, use_cache=False).logits,
                       prefill_ids(model, ids, use_cache=False).logits)


def test_tensors_the_architecture_has_no_place_for_are_named(untied, tmp_path, caplog):
    """Weights under the text model's names that Qwen3.5 has no use for (attention biases of a variant) load
    without them, and the log names them: they were dropped without a word. Rotary inv_freq buffers (old exports)
    are computed from the config, so they pass silently."""
    t = read_tensors(untied)
    q = next(k for k in t if k.endswith("self_attn.q_proj.weight"))
    t[q[:-len("weight")] + "bias"] = torch.zeros(t[q].shape[0])
    t[q.replace("q_proj.weight", "rotary_emb.inv_freq")] = torch.ones(4)
    d = tmp_path / "ck"
    shutil.copytree(untied, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(t, str(d / "model.safetensors"))
    with caplog.at_level("WARNING", logger="qwen35_fast.runtime.checkpoint"):
        load_model(d, dtype="fp32", device="cpu")
    said = [r.getMessage() for r in caplog.records if "no place in Qwen3.5" in r.getMessage()]
    assert len(said) == 1 and "1 tensor under" in said[0] and "self_attn.q_proj.bias" in said[0]
    assert "inv_freq" not in said[0]
