"""FP8 checkpoints (Hugging Face fine-grained FP8, ComfyUI's scaled_fp8, per-row scales, plain FP8 casts) load
with every weight equal to its dequantized value: the same parameters, bit for bit, as a checkpoint that stores
those values in fp32, for the text model and the vision tower."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from qwen35_fast.runtime import Qwen35Error, load_model, prefill_ids
from qwen35_fast.runtime.checkpoint import dequantize

from _models import make_hf_model, read_tensors

FP8_MAX = 448.0  # largest float8_e4m3fn
# the matrices FP8 releases quantize: every projection of the text layers and of the vision blocks
QUANTIZED = re.compile(r"(layers\.\d+\.(mlp|self_attn|linear_attn)\.\w+_proj\w*|visual\.blocks\.\d+\.(attn\.qkv|attn\.proj"
                       r"|mlp\.linear_fc\d)|^lm_head|embed_tokens)\.weight$")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("bf16")
    make_hf_model(f, seed=11)
    return f


def _block_scales(w, b):
    """One scale per b[0] x b[1] block (partial blocks at the edges), from the block's largest magnitude."""
    rows, cols = -(-w.shape[0] // b[0]), -(-w.shape[1] // b[1])
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            s[i, j] = w[i * b[0]:(i + 1) * b[0], j * b[1]:(j + 1) * b[1]].abs().max().clamp_min(1e-8) / FP8_MAX
    return s


def _expand(s, b, shape):
    return s.repeat_interleave(b[0], 0)[:shape[0]].repeat_interleave(b[1], 1)[:, :shape[1]]


def _quantize(tensors, form):
    """(the FP8 checkpoint's tensors, the reference's: each quantized weight as its dequantized fp32 value)."""
    fp8, ref = {}, {}
    for name, w in tensors.items():
        if not QUANTIZED.search(name):
            fp8[name] = ref[name] = w
            continue
        w = w.float()
        if form == "hf_block":  # config weight_block_size [24, 40]: partial blocks on every edge here
            b = (24, 40)
            s = _block_scales(w, b)
            q = (w / _expand(s, b, w.shape)).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = q.float() * _expand(s, b, w.shape)
        elif form == "comfy_scaled":  # ComfyUI scaled_fp8: one scale a tensor, activation scales beside it
            s = w.abs().max() / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
            stem = name[:-len(".weight")]
            fp8[name], fp8[stem + ".scale_weight"], fp8[stem + ".scale_input"] = q, s.reshape(()), torch.ones(())
            ref[name] = q.float() * s
        elif form == "comfy_quant":  # ComfyUI's per-layer format note; FP8 kept as bytes, as older saves did
            s = w.abs().max() / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
            stem = name[:-len(".weight")]
            fp8[name], fp8[stem + ".weight_scale"] = q.view(torch.uint8), s.reshape(())
            fp8[stem + ".comfy_quant"] = _note({"format": "float8_e4m3fn"})
            ref[name] = q.float() * s
        elif form == "per_row":  # one bf16 scale per output row
            s = (w.abs().amax(1, keepdim=True) / FP8_MAX).to(torch.bfloat16)
            q = (w / s.float()).to(torch.float8_e4m3fn)
            fp8[name], fp8[name[:-len(".weight")] + ".weight_scale"] = q, s
            ref[name] = q.float() * s.float()
        elif form == "per_tensor":  # one fp32 scale a tensor, of shape [1] (compressed-tensors' tensor strategy)
            s = w.abs().max().reshape(1) / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
            fp8[name], fp8[name[:-len(".weight")] + ".weight_scale"] = q, s
            ref[name] = q.float() * s
        else:  # a plain cast to FP8 (e5m2 here), no scale
            q = w.to(torch.float8_e5m2)
            fp8[name], ref[name] = q, q.float()
    if form == "comfy_scaled":
        fp8["model.scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return fp8, ref


def _note(d):
    return torch.frombuffer(bytearray(json.dumps(d).encode()), dtype=torch.uint8)


def _write(folder, out, tensors, quant=None):
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, str(out / "model.safetensors"))
    if quant:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = quant
        (out / "config.json").write_text(json.dumps(cfg))
    return out


# a single file has no config to give a Hugging Face block size (128 x 128 is assumed there; tested below)
@pytest.mark.parametrize("form,layout", [(f, lay) for f in ("hf_block", "comfy_scaled", "comfy_quant", "per_row", "plain")
                                         for lay in ("folder", "single_file") if (f, lay) != ("hf_block", "single_file")])
def test_fp8_checkpoints_load_as_their_dequantized_weights(folder, tmp_path, form, layout):
    fp8, ref = _quantize(read_tensors(folder), form)
    quant = {"quant_method": "fp8", "weight_block_size": [24, 40], "activation_scheme": "dynamic"} \
        if form == "hf_block" else None
    a_path = _write(folder, tmp_path / "fp8", fp8, quant)
    b_path = _write(folder, tmp_path / "ref", ref)
    if layout == "single_file":
        a_path, b_path = a_path / "model.safetensors", b_path / "model.safetensors"
    a = load_model(a_path, dtype="fp32", device="cpu")
    b = load_model(b_path, dtype="fp32", device="cpu")
    pa, pb = a.state_dict(), b.state_dict()
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    if layout == "folder":  # the vision tower: its projections were quantized too
        assert a.vision is not None
        va, vb = a.vision.state_dict(), b.vision.state_dict()
        assert va.keys() == vb.keys() and va
        for k in va:
            assert torch.equal(va[k], vb[k]), k
    ids = [5, 77, 300, 12, 9, 401, 64]
    la, lb = prefill_ids(a, ids).logits, prefill_ids(b, ids).logits
    assert torch.equal(la, lb)
    # the quantization is real: the weights moved off the fp32 originals
    c = load_model(folder, dtype="fp32", device="cpu")
    assert not torch.equal(prefill_ids(c, ids).logits, la)
    if layout == "folder":
        assert not torch.equal(c.vision.blocks[0].qkv_w, a.vision.blocks[0].qkv_w)


@pytest.mark.parametrize("strategy,loads", [("channel", True), ("tensor", True), ("block", False)])
def test_compressed_tensors_fp8_loads_as_its_dequantized_weights(folder, tmp_path, strategy, loads):
    """llm-compressor's FP8 (quant_method compressed-tensors: F8_E4M3 weights, a weight_scale per row or tensor)
    loads as its dequantized weights; another of its schemes is refused by name."""
    fp8, ref = _quantize(read_tensors(folder), "per_tensor" if strategy == "tensor" else "per_row")
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    path = _write(folder, tmp_path / "ct", fp8, quant)
    if not loads:
        with pytest.raises(Qwen35Error, match=r"compressed-tensors, not 8-bit float weights with one scale per "
                                              r"tensor or per row"):
            load_model(path, dtype="fp32", device="cpu")
        return
    a = load_model(path, dtype="fp32", device="cpu")
    b = load_model(_write(folder, tmp_path / "ref", ref), dtype="fp32", device="cpu")
    ids = [5, 77, 300, 12, 9]
    assert torch.equal(prefill_ids(a, ids).logits, prefill_ids(b, ids).logits)
    pa, pb = a.state_dict(), b.state_dict()
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)

def test_a_single_fp8_file_takes_128_x_128_blocks(tmp_path):
    """Without a config, block scales are taken as the fine-grained FP8 releases make them (128 x 128)."""
    w = torch.randn(300, 200)
    s = _block_scales(w, (128, 128))
    q = (w / _expand(s, (128, 128), w.shape)).to(torch.float8_e4m3fn)
    from qwen35_fast.runtime.checkpoint import fp8_weights
    entries = {"x.weight": (tmp_path, {"dtype": "F8_E4M3", "shape": [300, 200]}),
               "x.weight_scale_inv": (tmp_path, {"dtype": "F32", "shape": [3, 2]})}
    side, fp8 = fp8_weights(entries, tmp_path, None)
    assert side == {"x.weight_scale_inv"} and fp8["x.weight"].block == (128, 128)
    torch.testing.assert_close(dequantize(q, s, (128, 128), torch.float32), q.float() * _expand(s, (128, 128), w.shape),
                               rtol=0, atol=0)


@pytest.mark.parametrize("block", [None, (1, 50), (16, 16), (24, 40), (128, 128)])
@pytest.mark.parametrize("step", [1, 7, 24, 4096])
def test_dequantize_in_row_steps_equals_one_pass(block, step):
    """The row steps (a few thousand rows at a time) give what one fp32 pass gives, rounded once."""
    g = torch.Generator().manual_seed(17)
    w = torch.randn(100, 50, generator=g)
    q = w.to(torch.float8_e4m3fn)
    if block is None:
        s, full = torch.tensor(0.37), torch.full((100, 50), 0.37)
    elif block == (1, 50):
        s = torch.rand(100, 1, generator=g) + 0.5
        full = s.expand(100, 50)
    else:
        s = torch.rand(-(-100 // block[0]), -(-50 // block[1]), generator=g) + 0.5
        full = _expand(s, block, (100, 50))
    want = (q.float() * full).to(torch.bfloat16)
    got = dequantize(q, s, block, torch.bfloat16, rows_per_step=step)
    assert torch.equal(got, want)
    assert torch.equal(dequantize(q, None, None, torch.bfloat16), q.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["hf_block", "comfy_quant", "plain"])
def test_fp8_weights_dequantized_on_the_gpu_equal_the_cpus(folder, tmp_path, form):
    """Loaded onto a GPU, FP8 weights are dequantized there; the same fp32 products and one rounding as on the
    CPU, so the weights equal those of the fp32 reference moved to the GPU, bit for bit."""
    fp8, ref = _quantize(read_tensors(folder), form)
    quant = {"quant_method": "fp8", "weight_block_size": [24, 40]} if form == "hf_block" else None
    a = load_model(_write(folder, tmp_path / "fp8", fp8, quant), dtype="bf16", device="cuda")
    b = load_model(_write(folder, tmp_path / "ref", ref), dtype="bf16", device="cuda")
    pa, pb = a.state_dict(), b.state_dict()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    for k, v in a.vision.state_dict().items():
        assert torch.equal(v, b.vision.state_dict()[k]), k


def test_a_comfy_quant_file_safetensors_refuses_is_named(folder, tmp_path):
    """A file whose header reads but which safetensors refuses (bytes after its last tensor) fails where its
    comfy_quant notes are read: the file named and the fix, not safetensors' bare error."""
    fp8, _ = _quantize(read_tensors(folder), "comfy_quant")
    out = _write(folder, tmp_path / "fp8", fp8)
    with open(out / "model.safetensors", "ab") as f:
        f.write(bytes(64))
    with pytest.raises(Qwen35Error, match=r"model.safetensors: safetensors cannot read it .*re-download it"):
        load_model(out, dtype="fp32", device="cpu")


@pytest.mark.parametrize("rows_per_step", [4096, 24, 48])
def test_dequantize_is_the_blockwise_product_in_any_steps(rows_per_step):
    """q * scale per 24 x 10 block (the last row block and column block partial), in steps of whole row
    blocks: the product written out in full."""
    g = torch.Generator().manual_seed(rows_per_step)
    q = torch.randn(70, 30, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3, generator=g) + 0.5
    want = q.float() * s.repeat_interleave(24, 0)[:70].repeat_interleave(10, 1)[:, :30]
    got = dequantize(q, s, (24, 10), torch.float32, rows_per_step=rows_per_step)
    assert torch.equal(got, want)
    assert torch.equal(dequantize(q, s[:, :1], (24, 30), torch.float32, rows_per_step=rows_per_step),
                       q.float() * s[:, :1].repeat_interleave(24, 0)[:70])


@pytest.mark.gpu
def test_dequantize_on_a_device_given_equals_in_place():
    q = torch.randn(70, 30).to(torch.float8_e4m3fn)
    s = torch.rand(3, 1) + 0.5
    on_gpu = dequantize(q, s, (24, 30), torch.float32, device="cuda")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), dequantize(q, s, (24, 30), torch.float32))


@pytest.mark.parametrize("where", ["text", "vision"])
def test_a_quantized_folder_with_an_fp8_weight_missing_its_scale_is_refused_by_name(folder, tmp_path, where,
                                                                                    caplog):
    """A config that declares FP8 quantization gives every FP8 weight a scale: one without (shards of two
    downloads, a converter that dropped it) would load as a plain cast, hundreds of times too large. The text
    model's is an error; the vision tower's leaves the tower out, said (text prompts still run)."""
    fp8, _ = _quantize(read_tensors(folder), "hf_block")
    victim = next(k for k in fp8 if k.endswith("_scale_inv") and ("visual" in k) == (where == "vision"))
    del fp8[victim]
    quant = {"quant_method": "fp8", "weight_block_size": [24, 40], "activation_scheme": "dynamic"}
    said = re.escape(victim[:-len("_scale_inv")]) + ".*FP8 without a scale.*quantization_config \\(fp8\\)"
    path = _write(folder, tmp_path / "fp8", fp8, quant)
    if where == "text":
        with pytest.raises(Qwen35Error, match=said):
            load_model(path, dtype="fp32", device="cpu")
        return
    model = load_model(path, dtype="fp32", device="cpu")
    assert model.vision is None and any(re.search(said, r.getMessage()) for r in caplog.records)


def test_a_scaled_fp8_file_with_a_scale_beside_a_high_precision_layer_loads_it_times_the_scale(folder, tmp_path):
    """Older ComfyUI scaled_fp8 files give layers kept in bf16 a scale too (1.0 as a rule; ComfyUI multiplies by
    it): such a layer loads as its weight times its scale. A scale of another size beside a bf16 weight is still
    refused."""
    fp8, ref = _quantize(read_tensors(folder), "comfy_scaled")
    head = next(k for k in fp8 if k.endswith("embed_tokens.weight"))
    fp8[head] = ref[head] = fp8[head] if fp8[head].dtype != torch.float8_e4m3fn else ref[head].bfloat16()
    fp8[head[:-len(".weight")] + ".scale_weight"] = torch.tensor(2.0)
    ref[head] = ref[head].float() * 2
    a = load_model(_write(folder, tmp_path / "fp8", fp8) / "model.safetensors", dtype="fp32", device="cpu")
    b = load_model(_write(folder, tmp_path / "ref", ref) / "model.safetensors", dtype="fp32", device="cpu")
    pa, pb = a.state_dict(), b.state_dict()
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    fp8[head[:-len(".weight")] + ".scale_weight"] = torch.full((fp8[head].shape[0],), 2.0)
    with pytest.raises(Qwen35Error, match=r"scale_weight is an FP8 scale but .*embed_tokens.weight is BF16"):
        load_model(_write(folder, tmp_path / "rows", fp8) / "model.safetensors", dtype="fp32", device="cpu")


def test_fp8_weights_are_dequantized_into_their_parameters_a_few_rows_at_a_time(folder, tmp_path, monkeypatch):
    """An FP8 weight never exists whole in the model's dtype beside its parameter (the 9B's embedding would be
    2 GiB more device memory at load): its rows go straight into the parameter, or, for 8-bit weights, each
    piece is quantized as it comes. The same parameters as in one piece."""
    from qwen35_fast.runtime import checkpoint as checkpoint_mod
    fp8, _ = _quantize(read_tensors(folder), "per_row")
    path = _write(folder, tmp_path / "fp8", fp8)
    whole = {w: load_model(path, dtype="fp32", device="cpu", weights=w).state_dict() for w in ("full", "int8")}
    real_rows, real_get, pieces, whole_fp8 = checkpoint_mod.dequantized_rows, checkpoint_mod.WeightReader.get, [], []

    def few_rows(q, scale, block, device, rows_per_step=4096):
        for r0, part in real_rows(q, scale, block, device, 7):
            pieces.append(part.shape[0])
            yield r0, part

    def get(self, file, name, dtype, device=None, out=None):
        if name in self.fp8 and out is None and not name.startswith("model.visual."):
            whole_fp8.append(name)
        return real_get(self, file, name, dtype, device, out)
    monkeypatch.setattr(checkpoint_mod, "dequantized_rows", few_rows)
    monkeypatch.setattr(checkpoint_mod.WeightReader, "get", get)
    for w in ("full", "int8"):
        pieces.clear()
        got = load_model(path, dtype="fp32", device="cpu", weights=w).state_dict()
        assert pieces and max(pieces) == 7 and not whole_fp8, w
        assert got.keys() == whole[w].keys()
        for k in got:
            assert torch.equal(got[k], whole[w][k]), (w, k)
