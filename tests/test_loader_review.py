"""Loading: what a failed load lets go of, how weights reach their parameters, which tokenizer.json and dtype
are taken, FP8 on a device that cannot convert it, and the vision tower read from the checkpoint's own files."""
import gc
import json
import logging
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen35_fast.runtime import Qwen35Error, load_model
from qwen35_fast.runtime import checkpoint as checkpoint_mod
from qwen35_fast.runtime import loader as loader_mod
from qwen35_fast.runtime import vision as vision_mod
from qwen35_fast.runtime.checkpoint import Fp8Weight, WeightReader
from qwen35_fast.runtime.demo_checkpoint import demo_checkpoint, make_checkpoint
from qwen35_fast.runtime.tokenizer import QWEN35_TOKEN_IDS, byte_level_encode, load_tokenizer

SMALL = dict(vocab_size=1024)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3.5 folder with its vision tower, in two shards (an index) and no tokenizer.json."""
    return make_checkpoint(tmp_path_factory.mktemp("ck"), SMALL, seed=5, max_shard_size="200KB")


def _linked(folder, to):
    """A folder whose files are links to `folder`'s (to add or change one file without copying the weights)."""
    to.mkdir()
    for f in folder.iterdir():
        (to / f.name).symlink_to(f)
    return to


# --- 1. a failed load lets go of the half-built model before it empties the allocator's cache -----------------

def _fail_in_fill(monkeypatch):
    def get(self, file, name, dtype, device=None, out=None):
        raise RuntimeError("disk went away")
    monkeypatch.setattr(checkpoint_mod.WeightReader, "get", get)
    return {}, RuntimeError, "disk went away"


def _fail_in_vision(monkeypatch):
    def load_vision(ck, dtype, device):
        raise RuntimeError("the tower's file went away")
    monkeypatch.setattr(vision_mod, "load_vision", load_vision)
    return {}, RuntimeError, "the tower's file went away"


def _fail_in_backend(monkeypatch):  # kernels.select_backend's RuntimeError, raised again as Qwen35Error from None
    return dict(backend="cuda"), Qwen35Error, r"kernel backend 'cuda' needs a CUDA device, the model is on cpu"


@pytest.mark.parametrize("failure", [_fail_in_fill, _fail_in_vision, _fail_in_backend])
def test_a_failed_load_lets_go_of_the_model_before_emptying_the_cache(folder, monkeypatch, failure):
    made = []
    real_model = loader_mod.Qwen35Model

    def tracked(*args, **kwargs):
        model = real_model(*args, **kwargs)
        made.append(weakref.ref(model))
        return model

    alive_at_release = []
    monkeypatch.setattr(loader_mod, "Qwen35Model", tracked)
    monkeypatch.setattr(loader_mod, "empty_cache", lambda dev: alive_at_release.append(
        sum(r() is not None for r in made)))
    kwargs, kind, message = failure(monkeypatch)
    caught = None
    try:
        load_model(folder, dtype="fp32", device="cpu", **kwargs)
    except Exception as e:  # noqa: BLE001 - checked below: the error the failure raises, unchanged
        caught = (type(e), str(e))
    assert caught is not None and caught[0] is kind
    assert __import__("re").search(message, caught[1])
    assert len(made) == 1 and alive_at_release == [0]  # the cache was emptied with the model gone
    gc.collect()
    assert made[0]() is None


# --- 2. weights go into their parameters by one copy_, never through a device copy first ----------------------

class _NoMove(torch.Tensor):
    """A tensor read from a file that must not be moved before its copy into the parameter: on a GPU that move
    is a second, file-dtype copy of the tensor in device memory."""
    def to(self, *args, **kwargs):
        raise AssertionError("a weight read from the file was moved with .to() before its copy into the parameter")


def test_weights_go_into_their_parameters_by_one_copy(folder, monkeypatch):
    real_get = WeightReader.get
    monkeypatch.setattr(WeightReader, "get", lambda self, *a, **k: real_get(self, *a, **k).as_subclass(_NoMove))
    model = load_model(folder, dtype="fp32", device="cpu")
    assert model.vision is not None
    monkeypatch.undo()
    reference = load_model(folder, dtype="fp32", device="cpu")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert type(a) is not _NoMove and torch.equal(a, b), name


@pytest.mark.gpu
def test_loading_on_the_gpu_takes_no_room_beyond_the_weights(tmp_path):
    """fp32 weights into a bf16 model: each is converted on the host by its copy_, so the load's peak is what
    the loaded model holds plus no tensor's copy (the embedding's alone: 248,320 x 128 fp32, 127 MB)."""
    ck = make_checkpoint(tmp_path, seed=5, dtype=torch.float32)
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    model = load_model(ck, dtype="bf16", device="cuda", backend="torch")
    held = torch.cuda.memory_allocated(dev) - base
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert held >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak - held < model.embed.numel() * 4 // 8, (peak, held)


# --- 3. a tokenizer.json of another model is refused, naming the file --------------------------------------

def _bpe_tokenizer_json(folder, added=()):
    """A byte-level BPE tokenizer.json of 256 byte tokens (no merges) and these added tokens after them."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    hf = Tokenizer(BPE(vocab={byte_level_encode(bytes([b])): b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    spec = json.loads(hf.to_str())
    spec["added_tokens"] = [dict(id=256 + i, content=c, single_word=False, lstrip=False, rstrip=False,
                                 normalized=False, special=True) for i, c in enumerate(added)]
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return folder / "tokenizer.json"


def test_a_tokenizer_without_the_chat_tokens_is_not_qwen35s(tmp_path):
    path = _bpe_tokenizer_json(tmp_path)
    with pytest.raises(Qwen35Error, match=rf"{path}: not Qwen3\.5's tokenizer: it has no '<\|endoftext\|>' token"
                                          r".*delete it to use the built-in Qwen3\.5 tokenizer"):
        load_tokenizer(tmp_path)


def test_an_older_qwen_tokenizer_is_not_qwen35s(tmp_path):
    """Qwen2.5 / Qwen3 have the chat tokens, at other ids: their ids would be read as other tokens."""
    path = _bpe_tokenizer_json(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    with pytest.raises(Qwen35Error, match=rf"{path}: not Qwen3\.5's tokenizer: '<\|endoftext\|>' is id 256 in it, "
                                          r"248044 in Qwen3\.5's.*replace it with the Qwen3\.5 checkpoint's own "
                                          r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_a_vision_token_at_another_id_is_refused(tmp_path):
    spec = json.loads((demo_checkpoint() / "tokenizer.json").read_text(encoding="utf-8"))
    added = spec["added_tokens"]
    names = [t["content"] for t in added]
    i, j = names.index("<|image_pad|>"), names.index("<|vision_pad|>")
    added[i]["content"], added[j]["content"] = added[j]["content"], added[i]["content"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(Qwen35Error, match=r"'<\|image_pad\|>' is id 248055 in it, 248056 in Qwen3\.5's"):
        load_tokenizer(tmp_path)


def test_the_ids_the_runtime_writes_are_those_the_tokenizer_checks():
    from qwen35_fast.runtime import multimodal
    from qwen35_fast.runtime.config import DEFAULT_EOS
    assert (multimodal.VISION_START, multimodal.VISION_END, multimodal.IMAGE_PAD, multimodal.VIDEO_PAD) == tuple(
        QWEN35_TOKEN_IDS[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))
    assert DEFAULT_EOS == (QWEN35_TOKEN_IDS["<|endoftext|>"], QWEN35_TOKEN_IDS["<|im_end|>"])
    package = load_tokenizer(None)
    assert all(package.token_id(t) == i for t, i in QWEN35_TOKEN_IDS.items())


def test_the_qwen35_tokenizer_json_loads():
    tok = load_tokenizer(demo_checkpoint())
    assert all(tok.token_id(t) == i for t, i in QWEN35_TOKEN_IDS.items())


@pytest.mark.parametrize("single", [False, True])
def test_a_checkpoint_with_another_models_tokenizer_json_names_it(folder, tmp_path, single):
    """A folder's tokenizer.json, or the one beside a single .safetensors file, is taken as the model's."""
    ck = make_checkpoint(tmp_path, SMALL, seed=5, single_file=True) if single else _linked(folder, tmp_path / "ck")
    path = _bpe_tokenizer_json(tmp_path if single else ck, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    with pytest.raises(Qwen35Error, match=rf"{path}: not Qwen3\.5's tokenizer"):
        load_model(ck, dtype="fp32", device="cpu")


# --- 4. only the dtypes the model computes in ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.float64])
def test_a_torch_dtype_the_model_does_not_compute_in_is_refused(folder, dtype):
    with pytest.raises(Qwen35Error, match=rf"dtype {dtype} is not one of auto, bf16, fp16, fp32 \(or "
                                          r"torch\.bfloat16, torch\.float16, torch\.float32\)"):
        load_model(folder, dtype=dtype, device="cpu")


def test_the_torch_dtypes_it_computes_in_are_taken(folder):
    assert load_model(folder, dtype=torch.bfloat16, device="cpu").dtype == torch.bfloat16


# --- 5. FP8 dequantized on a device: out of memory is an error, no FP8 support falls back once, logged ------

@pytest.fixture()
def fp8_file(tmp_path):
    w = torch.randn(64, 32)
    file = tmp_path / "fp8.safetensors"
    tensors = {f"w{i}.weight": (w + i).to(torch.float8_e4m3fn) for i in range(3)}
    save_file({**tensors, **{f"w{i}.weight_scale": torch.tensor(0.5) for i in range(3)}}, str(file))
    return file, {f"w{i}.weight": Fp8Weight((file, f"w{i}.weight_scale"), None) for i in range(3)}


def _device_dequantize_raises(monkeypatch, error):
    real = checkpoint_mod.dequantized_rows
    calls = []

    def dequantized_rows(q, scale, block, device, rows_per_step=4096):
        calls.append(str(device))
        if str(device) != "cpu":
            raise error()
        yield from real(q, scale, block, device, rows_per_step)
    monkeypatch.setattr(checkpoint_mod, "dequantized_rows", dequantized_rows)
    return calls


def test_fp8_out_of_memory_on_the_device_is_raised(fp8_file, monkeypatch):
    file, fp8 = fp8_file
    _device_dequantize_raises(monkeypatch, lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    with WeightReader(fp8) as reader, pytest.raises(torch.OutOfMemoryError):
        reader.get(file, "w0.weight", torch.bfloat16, "cuda:0")


def test_fp8_without_device_support_is_dequantized_on_the_cpu_said_once(fp8_file, monkeypatch, caplog):
    file, fp8 = fp8_file
    calls = _device_dequantize_raises(monkeypatch, lambda: NotImplementedError("no float8 on this device"))
    with caplog.at_level(logging.INFO, logger=checkpoint_mod.__name__), WeightReader(fp8) as reader:
        got = [reader.get(file, f"w{i}.weight", torch.float32, "cuda:0") for i in range(3)]
    with safe_open(str(file), "pt") as f:
        for i in range(3):
            assert torch.equal(got[i], f.get_tensor(f"w{i}.weight").float() * 0.5)
    assert calls == ["cuda:0", "cpu", "cpu", "cpu"]  # tried on the device once, then on the CPU
    said = [r for r in caplog.records if "FP8" in r.getMessage()]
    assert len(said) == 1 and "on the CPU" in said[0].getMessage() and "no float8 on this device" in \
        said[0].getMessage()


# --- 6. the vision tower comes from the files the checkpoint found; a broken one leaves the text model ------

def test_each_header_is_read_once(folder, monkeypatch):
    read = []
    real = checkpoint_mod.read_header

    def spy(file):
        read.append(file.name)
        return real(file)
    monkeypatch.setattr(checkpoint_mod, "read_header", spy)
    monkeypatch.setattr(vision_mod, "read_header", spy, raising=False)
    model = load_model(folder, dtype="fp32", device="cpu")
    assert model.vision is not None
    assert sorted(read) == sorted(f.name for f in folder.glob("*.safetensors"))


def test_a_tower_without_blocks_leaves_the_text_model_with_a_note(tmp_path):
    whole = make_checkpoint(tmp_path / "whole", SMALL, seed=5, single_file=True, include_vision=True)
    with safe_open(str(whole), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("model.visual.blocks.")}
    save_file(tensors, str(tmp_path / "partial.safetensors"))
    model = load_model(tmp_path / "partial.safetensors", dtype="fp32", device="cpu")
    assert model.vision is None
    assert "blocks" in model.vision_note and "text prompts still work" in model.vision_note


# --- 5. what a checkpoint's files and config may hold ---------------------------------------------------------------

def _text_tensors(folder) -> dict:
    """The folder's text-model tensors, named as in it (model.language_model.*)."""
    out = {}
    for f in checkpoint_mod.checkpoint_files(folder):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys() if k.startswith("model.language_model.")})
    return out


def test_a_null_quantization_config_is_not_a_quantized_checkpoint(folder, tmp_path):
    linked = _linked(folder, tmp_path / "ck")
    cfg = json.loads((folder / "config.json").read_text())
    (linked / "config.json").unlink()
    (linked / "config.json").write_text(json.dumps({**cfg, "quantization_config": None}))
    assert checkpoint_mod.locate(linked).config == checkpoint_mod.locate(folder).config


def test_only_the_files_the_index_names_are_read_or_counted(folder, tmp_path):
    """A consolidated file left beside the shards (an older download) is neither read nor counted in the memory
    a load asks ComfyUI to free (nodes.models_folder.weights_bytes takes checkpoint_files)."""
    linked = _linked(folder, tmp_path / "ck")
    shards = checkpoint_mod.checkpoint_files(folder)
    save_file(_text_tensors(folder), str(linked / "model.safetensors"))
    assert len(shards) > 1 and checkpoint_mod.checkpoint_files(linked) == [linked / f.name for f in shards]
    assert {f.name for f, _ in checkpoint_mod.locate(linked).tensors.values()} <= {f.name for f in shards}


def test_a_sft_file_and_a_text_model_under_a_prefix_of_its_own_load(folder, tmp_path):
    """ComfyUI lists .sft files as safetensors; its Save CLIP node writes a text encoder under a prefix of its own
    (<encoder>.transformer.model.*, lm_head beside it): both map the folder's text weights."""
    tensors = _text_tensors(folder)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()  # (untied, for the test)
    want = {k: (f.name, n) for k, (f, n) in checkpoint_mod.locate(folder).tensors.items()}
    single = tmp_path / "qwen35.sft"
    save_file(tensors, str(single))
    prefixed = tmp_path / "clip_save.safetensors"
    save_file({k.replace("model.language_model.", "qwen35_2b.transformer.model.").replace(
        "lm_head.", "qwen35_2b.transformer.lm_head."): t for k, t in tensors.items()}, str(prefixed))
    for file in (single, prefixed):
        ck = checkpoint_mod.locate(file)
        assert set(ck.tensors) == set(want) | {"lm_head.weight"}
        assert ck.config.num_hidden_layers == checkpoint_mod.locate(folder).config.num_hidden_layers
    names = checkpoint_mod.locate(prefixed).tensors
    assert names["lm_head.weight"][1] == "qwen35_2b.transformer.lm_head.weight"
    assert names["layers.0.mlp.down_proj.weight"][1] == "qwen35_2b.transformer.model.layers.0.mlp.down_proj.weight"
    from qwen35_fast.runtime import prefill_ids
    logits = [prefill_ids(load_model(f, dtype="fp32", device="cpu"), [1, 5, 9, 200], use_cache=False).logits
              for f in (single, prefixed)]
    assert torch.equal(*logits)
