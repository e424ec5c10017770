"""A prefill's last layer runs for the last token alone (Qwen35Model._attention_last): its logits and the K/V
every token leaves in the cache equal those of the full pass, cold and after cached tokens, for full and int8
weights; quant.linear over a range of rows gives the full product's columns on every path."""
import pytest
import torch

from qwen35_fast.runtime import load_model, quant
from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.quant import Int8Weight


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck"), with_tokenizer=True)


def _full_pass(monkeypatch):
    """_layers with the trim switched off: every token through the last layer, the last one's output kept."""
    layers = Qwen35Model._layers

    def full(self, h, *args, kv_last=None, **kw):
        return layers(self, h, *args, **kw)[:, -1:]
    monkeypatch.setattr(Qwen35Model, "_layers", full)


def _run(model, ids, split):
    """Logits after ids [1, T] read as ids[:split] then the rest (split 0: in one call), and the cache's K/V."""
    cache = model.new_cache(1, ids.shape[1])
    if split:
        model.forward_prefill(ids[:, :split], cache)
    logits = model.forward_prefill(ids[:, split:], cache)
    return logits, cache.gather_kv()


@pytest.mark.parametrize("weights", ["full", "int8"])
@pytest.mark.parametrize("split", [0, 37])
def test_the_trimmed_last_layer_equals_the_full_pass(folder, monkeypatch, weights, split):
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch", weights=weights)
    model.setup_kv(None)
    assert model.config.layer_types[-1] == "full_attention"
    ids = torch.randint(3, model.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(split))
    ours, kv = _run(model, ids, split)
    with monkeypatch.context() as m:
        _full_pass(m)
        want, kv_want = _run(model, ids, split)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    assert len(kv) == len(kv_want)
    for (k, v), (kw, vw) in zip(kv, kv_want):  # the last layer's K/V of every token too
        assert torch.equal(k, kw) and torch.equal(v, vw)


def test_the_last_layer_multiplies_one_row(folder, monkeypatch):
    """Its MLP, o_proj and query rows see one row of a 50-token prompt (the full pass gives them 50)."""
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    model.setup_kv(None)
    last = model.blocks[-1]
    seen = []
    real = quant.linear

    def spy(x, w, backend=None, rows=None):
        if w is last.down or w is last.mixer.o_proj or (w is last.mixer.qkv and rows and rows[0] == 0):
            seen.append(x.numel() // x.shape[-1])
        return real(x, w, backend, rows)
    monkeypatch.setattr("qwen35_fast.runtime.model.linear", spy)
    model.forward_prefill(torch.arange(3, 53)[None], model.new_cache(1, 50))
    assert len(seen) == 3 and set(seen) == {1}, seen


@pytest.mark.parametrize("path", ["tensor", "int8-pieces", "int8-cpu-matmul"])
def test_linear_over_rows_equals_the_columns_of_the_full_product(monkeypatch, path):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 128, generator=g)
    w = torch.randn(96, 128, generator=g)
    if path != "tensor":
        iw = Int8Weight(96, 128, torch.float32, "cpu")
        q, s = quant.quantize_rows(w, torch.float32)
        iw.q.data.copy_(q)
        iw.scale.data.copy_(s)
        w = iw
        monkeypatch.setattr(quant, "_packed", [path == "int8-cpu-matmul"])
        monkeypatch.setattr(Int8Weight, "rows_per_piece", lambda self: 7)  # pieces that straddle the range's ends
    full = quant.linear(x, w)
    for lo, hi in ((0, 96), (0, 64), (64, 96), (10, 33), (95, 96)):  # (another shape: other roundings)
        torch.testing.assert_close(quant.linear(x, w, rows=(lo, hi)), full[:, lo:hi], rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 300])
def test_the_trimmed_last_layer_on_the_kernels(tmp_path, monkeypatch, split):
    """On the CUDA kernels (SDPA cold, the paged kernel after cached tokens, one-row products on gemv where the
    card takes it): the full pass's logits and K/V to bf16 rounding (the K/V rows' product has another shape)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from _models import kernels_model, rel
    model = kernels_model(tmp_path, seed=7)
    ids = torch.randint(3, 248000, (1, 700), generator=torch.Generator().manual_seed(split)).cuda()
    ours, kv = _run(model, ids, split)
    with monkeypatch.context() as m:
        _full_pass(m)
        want, kv_want = _run(model, ids, split)
    assert rel(ours, want) < 1e-2 and ours.argmax() == want.argmax()
    for (k, v), (kw, vw) in zip(kv, kv_want):
        assert rel(k.float(), kw.float()) < 1e-2 and rel(v.float(), vw.float()) < 1e-2
