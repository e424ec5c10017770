"""8-bit weights (runtime/quant.py): rows quantized within half a step, an int8 model computing exactly what a
model with its dequantized weights computes (text, image, decode, generation), close to the full model, half
the memory, auto taking int8 only where the full weights do not fit, and the weights read again after being
let go."""
import pytest
import torch
import torch.nn.functional as F

from qwen35_fast.runtime import Qwen35Error, generate, load_model, prefill_ids, quant
from qwen35_fast.runtime import loader as loader_mod
from qwen35_fast.runtime.generate import SamplingParams
from qwen35_fast.runtime.memory import generate_bytes, loading_out_of_memory, prefill_bytes, text_weight_bytes
from qwen35_fast.runtime.multimodal import prefill_multimodal
from qwen35_fast.runtime.quant import Int8Weight, fill_rows, linear, quantize_rows

from _models import forced_logits, make_hf_model, rel

GREEDY = SamplingParams(do_sample=False)
IDS = [5, 77, 300, 12, 9, 401, 64, 1000, 20000, 248000]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("int8")
    make_hf_model(f, seed=21, vocab=248320)
    return f


def _rows(seed, rows=40, cols=96):
    """Rows of very different magnitudes (1e-6 .. 1e2), one of zeros, one with a single large entry."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 2, rows)[torch.randperm(rows, generator=g)][:, None]
    w[3] = 0
    w[7] = 0.01 * torch.randn(cols, generator=g)
    w[7, 5] = 50.0
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_is_within_half_a_step_of_its_weights(dtype, seed):
    w = _rows(seed)
    q, s = quantize_rows(w.to(dtype), dtype)
    assert q.dtype == torch.int8 and s.dtype == dtype and q.shape == w.shape and s.shape == (w.shape[0],)
    w = w.to(dtype).float()  # what was given
    sf = s.float()
    assert int(q.abs().max()) <= quant.QMAX and torch.equal(q[3], torch.zeros_like(q[3])) and sf[3] == 0
    exact = w.abs().amax(1) / quant.QMAX  # the step before it was rounded to the dtype
    live = sf > 0
    normal = sf >= torch.finfo(dtype).tiny  # (fp16 holds the steps of rows under ~8e-3 with fewer bits)
    assert normal.sum() > 20 and (q[normal].abs().amax(1) >= quant.QMAX - 1).all()  # each row spans the range
    # half a step, plus what rounding the step to the dtype moved the largest entries
    bound = 0.5 * sf + quant.QMAX * (exact - sf).abs() + 1e-12
    err = (q.float() * sf[:, None] - w).abs()
    assert (err[live] <= bound[live][:, None] * (1 + 1e-6)).all()
    # the matrix is q * scale as one elementwise op in the dtype
    assert torch.equal(Int8Weight.rows(_weight(q, s)), (q.to(dtype) * s[:, None]).to(dtype))


def _weight(q, s):
    w = Int8Weight(*q.shape, s.dtype, "cpu")
    w.q.data.copy_(q)
    w.scale.data.copy_(s)
    return w


@pytest.mark.parametrize("fill_bytes,row", [(4 * 96 * 3, 0), (4 * 96 * 7, 5), (1, 11)])
def test_a_fill_in_slices_at_an_offset_equals_one_pass(monkeypatch, fill_bytes, row):
    w = _rows(4)
    monkeypatch.setattr(quant, "FILL_BYTES", fill_bytes)
    target = Int8Weight(w.shape[0] + 20, w.shape[1], torch.bfloat16, "cpu")
    target.q.data.fill_(99)
    target.scale.data.fill_(-1)
    fill_rows(target, row, w.to(torch.bfloat16))
    q, s = quantize_rows(w.to(torch.bfloat16), torch.bfloat16)
    assert torch.equal(target.q[row:row + w.shape[0]], q) and torch.equal(target.scale[row:row + w.shape[0]], s)
    untouched = torch.ones(target.shape[0], dtype=torch.bool)
    untouched[row:row + w.shape[0]] = False
    assert (target.q[untouched] == 99).all() and (target.scale[untouched] == -1).all()


@pytest.mark.parametrize("piece_rows", [1, 7, 40, 1000])
def test_linear_over_pieces_of_rows_is_the_product_with_the_whole_matrix(monkeypatch, piece_rows):
    w = _weight(*quantize_rows(_rows(5), torch.float32))
    monkeypatch.setattr(quant, "DEQUANT_BYTES", piece_rows * 96 * 4)
    assert w.rows_per_piece() == min(piece_rows, 40)  # (96 columns: not the CPU's int8 matmul)
    x = torch.randn(3, 2, 96, generator=torch.Generator().manual_seed(6))
    y = linear(x, w)
    assert y.shape == (3, 2, 40)
    assert rel(y, F.linear(x, w.rows())) < 1e-6
    ids = torch.tensor([[0, 3, 7, 39]])
    assert torch.equal(quant.embedding(ids, w), F.embedding(ids, w.rows()))


@pytest.fixture
def packed_calls(monkeypatch):
    """The calls of torch's int8 matmul (each a fresh copy of its bf16 input) as linear makes them."""
    assert quant.cpu_int8_matmul()  # (its one trial made before the calls are counted)
    calls, real = [], torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda a, q, s: calls.append(a.shape) or real(a, q, s))
    return calls


@pytest.mark.parametrize("rows,cols,packed", [(1, 64, True), (5, 128, True), (64, 64, True), (300, 64, True),
                                             (3, 96, False)])
def test_the_cpus_int8_matmul_is_the_product_within_bf16(packed_calls, rows, cols, packed):
    g = torch.Generator().manual_seed(rows + cols)
    w = _weight(*quantize_rows(torch.randn(300, cols, generator=g) * 0.02, torch.float32))
    x = torch.randn(rows, cols, generator=g)[None]
    y = linear(x, w)
    assert y.shape == (1, rows, 300) and y.dtype == torch.float32
    assert len(packed_calls) == int(packed)
    if packed:  # each output row as it is alone: the rows beside it change nothing
        assert torch.equal(y[0, -1:], linear(x[:, -1:], w)[0])
    ref = F.linear(x, w.rows())
    assert rel(y, ref) < (4e-3 if packed else 1e-6)  # the input rounded to bf16 (2^-9), fp32 sums
    wb = _weight(*quantize_rows(torch.randn(300, cols, generator=g) * 0.02, torch.bfloat16))
    yb = linear(x.bfloat16(), wb)
    assert yb.dtype == torch.bfloat16 and rel(yb, F.linear(x.bfloat16(), wb.rows())) < 8e-3


def test_a_torch_without_the_int8_matmul_dequantizes_instead(monkeypatch, caplog):
    calls = []

    def refuse(*_):
        calls.append(1)
        raise RuntimeError("_weight_int8pack_mm: no kernel for this CPU")
    monkeypatch.setattr(torch, "_weight_int8pack_mm", refuse)
    monkeypatch.setattr(quant, "_packed", [])
    w = _weight(*quantize_rows(_rows(8, cols=64), torch.float32))
    x = torch.randn(2, 64)
    assert rel(linear(x, w), F.linear(x, w.rows())) < 1e-6 and quant._packed == [False]
    assert "no int8 matmul on the CPU" in caplog.text and "decodes several times slower" in caplog.text
    assert rel(linear(x, w), F.linear(x, w.rows())) < 1e-6
    assert caplog.text.count("no int8 matmul") == 1 and len(calls) == 1  # tried and said once


def test_on_the_cpu_a_reused_prefix_and_a_follow_up_give_what_one_go_gives(folder):
    """Every product takes the int8 matmul, whose output rows do not depend on the rows beside them: reading a
    prompt after a cached prefix, or a follow-up turn, gives the logits of reading it whole, as with full weights."""
    from qwen35_fast.runtime import continue_prefill, prefill
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch", weights="int8")
    first = prefill(model, "Describe a red fox in the snow.", system_prompt="You write image prompts.")
    again = prefill(model, "Describe a grey wolf at night.", system_prompt="You write image prompts.")
    cold = prefill(model, "Describe a grey wolf at night.", system_prompt="You write image prompts.", use_cache=False)
    assert again.cached_tokens > 0 and cold.cached_tokens == 0
    assert rel(again.logits, cold.logits) < 1e-5
    turn = continue_prefill(model, first, "And in the rain?", previous_answer="A fox.")
    whole = prefill_ids(model, turn.token_ids, use_cache=False)
    assert turn.cached_tokens > 0 and rel(turn.logits, whole.logits) < 1e-5


def _dequantized_twin(a, folder, dtype):
    """A full model of the same checkpoint whose matrices are set to a's dequantized ones."""
    b = load_model(folder, dtype=dtype, device="cpu", backend="torch", weights="full")
    n = 0
    with torch.no_grad():
        for name, m in a.named_modules():
            if isinstance(m, Int8Weight):
                b.get_parameter(name).copy_(m.rows())
                n += 1
    # the embedding, the LM head (unless tied to it), and each layer's two projections and two MLP matrices
    assert n == (1 if a.lm_head is None else 2) + 4 * len(a.blocks)
    return b


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_int8_model_computes_what_its_dequantized_weights_do(folder, dtype, monkeypatch):
    """Bit for bit where every matmul dequantizes (on the CPU the products otherwise take torch's int8 matmul:
    tested below)."""
    monkeypatch.setattr(quant, "_packed", [False])
    a = load_model(folder, dtype=dtype, device="cpu", backend="torch", weights="int8")
    assert a.int8 and isinstance(a.blocks[0].gate_up, Int8Weight) and isinstance(a.embed, Int8Weight)
    b = _dequantized_twin(a, folder, dtype)
    pa, pb = prefill_ids(a, IDS), prefill_ids(b, IDS)
    assert torch.equal(pa.logits, pb.logits)
    assert torch.equal(forced_logits(a, pa, IDS[:6]), forced_logits(b, pb, IDS[:6]))
    ga = generate(a, pa, max_new_tokens=8, sampling=GREEDY)
    assert ga.token_ids == generate(b, pb, max_new_tokens=8, sampling=GREEDY).token_ids
    image = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(2))
    ma = prefill_multimodal(a, "What is in <image>?", images=image, use_cache=False)
    mb = prefill_multimodal(b, "What is in <image>?", images=image, use_cache=False)
    assert ma.vision.vision_tokens > 0 and torch.equal(ma.logits, mb.logits)
    # with the CPU's int8 matmul
    monkeypatch.undo()
    pa = prefill_ids(a, IDS)
    tol = 2e-2 if dtype == "fp32" else 4e-2  # the inputs of those products in bf16
    assert rel(pa.logits, pb.logits) < tol
    assert rel(forced_logits(a, pa, IDS[:6]), forced_logits(b, pb, IDS[:6])) < tol


def test_an_int8_load_quantizes_the_checkpoints_weights(folder):
    """From the numbers as stored (fp32 here), not from their rounding to the compute dtype first."""
    a = load_model(folder, dtype="bf16", device="cpu", backend="torch", weights="int8")
    stored = load_model(folder, dtype="fp32", device="cpu", backend="torch", weights="full")
    for name, m in a.named_modules():
        if isinstance(m, Int8Weight):
            q, s = quantize_rows(stored.get_parameter(name), torch.bfloat16)
            assert torch.equal(m.q, q) and torch.equal(m.scale, s), name
    # everything else is the full model's, the vision tower included
    full = dict(load_model(folder, dtype="bf16", device="cpu", backend="torch", weights="full").named_parameters())
    for name, p in a.named_parameters():
        if not name.endswith((".q", ".scale")):
            assert torch.equal(p, full[name]), name


def test_int8_logits_stay_close_to_the_full_models(folder):
    """The one difference from the checkpoint is the rounding to 8 bits: it moves the logits about twice as far
    as rounding the same fp32 weights to bf16 does (here 1.4% against 0.6%, relative), in the prefill and over
    decode steps fed the same tokens."""
    a = load_model(folder, dtype="fp32", device="cpu", backend="torch", weights="int8")
    b = load_model(folder, dtype="fp32", device="cpu", backend="torch", weights="full")
    h = load_model(folder, dtype="bf16", device="cpu", backend="torch", weights="full")
    pa, pb, ph = prefill_ids(a, IDS), prefill_ids(b, IDS), prefill_ids(h, IDS)
    err, bf16 = rel(pa.logits, pb.logits), rel(ph.logits, pb.logits)
    assert 1e-3 < err < 4 * bf16, (err, bf16)  # moved (the rounding is real), but not far
    steps = forced_logits(b, pb, IDS[:6])
    assert rel(forced_logits(a, pa, IDS[:6]), steps) < 4 * rel(forced_logits(h, ph, IDS[:6]).float(), steps)


def test_int8_matrices_take_a_byte_a_number_and_a_scale_a_row(folder):
    a = load_model(folder, dtype="bf16", device="cpu", backend="torch", weights="int8")
    b = load_model(folder, dtype="bf16", device="cpu", backend="torch", weights="full")
    mats = [m for m in a.modules() if isinstance(m, Int8Weight)]
    saved = sum(m.numel() * 2 - (m.numel() + 2 * m.shape[0]) for m in mats)
    assert a.weight_bytes() == b.weight_bytes() - saved
    assert a.weight_bytes() < 0.55 * b.weight_bytes()  # the embedding and LM head dominate this tiny model
    c = a.config  # the estimate load_model's auto choice and its out-of-memory message use
    text = text_weight_bytes(c, torch.bfloat16, True)
    assert text - sum(m.numel() + 2 * m.shape[0] for m in mats) == 2 * sum(
        p.numel() for n, p in a.named_parameters() if not n.startswith("vision.") and not n.endswith((".q", ".scale")))
    assert text_weight_bytes(c, torch.bfloat16) - text == saved
    # a run counts the piece of a matrix it dequantizes at once
    assert quant.dequant_bytes(a) == 2 * c.vocab_size * c.hidden_size and quant.dequant_bytes(b) == 0
    assert prefill_bytes(a, 100) - prefill_bytes(b, 100) == quant.dequant_bytes(a)
    assert generate_bytes(a, 100, 10) - generate_bytes(b, 100, 10) == quant.dequant_bytes(a)


def test_tied_embeddings_in_8_bits_read_the_vocabulary_in_pieces(tmp_path, monkeypatch):
    make_hf_model(tmp_path, seed=22, vocab=5000, tie=True)
    a = load_model(tmp_path, dtype="fp32", device="cpu", backend="torch", weights="int8")
    assert a.lm_head is None
    b = _dequantized_twin(a, tmp_path, "fp32")
    monkeypatch.setattr(quant, "DEQUANT_BYTES", 700 * a.config.hidden_size * 4)  # 8 pieces of the vocabulary
    monkeypatch.setattr(quant, "_packed", [False])  # (the CPU's int8 matmul takes the whole vocabulary at once)
    assert a.embed.rows_per_piece() == 700
    ids = [5, 77, 300, 12, 4999]
    assert rel(prefill_ids(a, ids).logits, prefill_ids(b, ids).logits) < 1e-6
    assert quant.dequant_bytes(a) == 700 * a.config.hidden_size * 4


def test_auto_takes_int8_only_where_the_full_weights_do_not_fit(folder, monkeypatch):
    from qwen35_fast.runtime.checkpoint import locate
    config = locate(folder).config
    full = text_weight_bytes(config, torch.float32)
    gib = 1 << 30
    for free, total, int8 in [(full + 2 * gib, 8 * gib, False), (full + 4 * gib, 32 * gib, False),
                              (full + 2 * gib, 32 * gib, True), (full + gib // 2, 8 * gib, True)]:
        monkeypatch.setattr(loader_mod, "free_bytes", lambda device, f=free, t=total: (f, t))
        assert loader_mod.pick_int8("auto", config, torch.float32, torch.device("cpu")) is int8, (free, total)
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch", weights="auto")
    assert model.int8 and isinstance(model.blocks[1].down, Int8Weight)  # the last setting: too little room
    assert loader_mod.pick_int8("full", config, torch.float32, torch.device("cpu")) is False
    assert loader_mod.pick_int8("int8", config, torch.float32, torch.device("cpu")) is True
    with pytest.raises(Qwen35Error, match=r"weights 'fp8' is not one of auto, full, int8"):
        load_model(folder, dtype="fp32", device="cpu", weights="fp8")


def test_int8_weights_let_go_are_quantized_again_on_the_way_back(folder):
    model = load_model(folder, dtype="bf16", device="cpu", backend="torch", weights="int8")
    before = {n: p.clone() for n, p in model.named_parameters()}
    pf = prefill_ids(model, IDS)
    first = generate(model, pf, max_new_tokens=5, sampling=GREEDY)
    size = model.weight_bytes()
    model.drop_weights("cpu")
    assert model.weights_dropped and model.weight_bytes() == size
    assert model.embed.is_meta and model.blocks[0].gate_up.q.is_meta
    model.reload_weights("cpu")
    assert not model.weights_dropped
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert generate(model, pf, max_new_tokens=5, sampling=GREEDY).token_ids == first.token_ids


def test_the_out_of_memory_message_on_loading_names_the_8_bit_size(folder):
    from qwen35_fast.runtime.checkpoint import locate
    config = locate(folder).config
    msg = str(loading_out_of_memory("m.safetensors", config, torch.bfloat16, torch.device("cpu")))
    gib = 2 ** 30
    assert f"take {text_weight_bytes(config, torch.bfloat16) / gib:.2f} GiB in bfloat16" in msg
    assert f"load it with 8-bit weights (weights: int8, {text_weight_bytes(config, torch.bfloat16, True) / gib:.2f} GiB)" in msg
    msg = str(loading_out_of_memory("m.safetensors", config, torch.bfloat16, torch.device("cpu"), int8=True))
    assert "with 8-bit weights, and" in msg and "weights: int8" not in msg


def test_the_command_line_takes_int8_weights(folder, capsys):
    from qwen35_fast.runtime.cli import main
    assert main(["run", "--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "2", "--dtype", "fp32",
                 "--device", "cpu", "--weights", "int8"]) == 0
    out = capsys.readouterr().out
    assert "weights        : matrices in 8 bits, computed in float32," in out
