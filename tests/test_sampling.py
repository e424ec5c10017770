"""Sampling: the settings' distribution (kernels/sampling/reference.py against its definition over the whole
vocabulary), the draws (runtime.sampling.draw_uniform, the inverse of the weights' running sum), and sample.cu
against the reference on a GPU: the same candidates in the same order, the same weights, the same token."""
import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.kernels.sampling.reference import (
    candidates_ref,
    draw_ref,
    order_keys,
    penalise_ref,
    sample_ref,
    top_k_ref,
)
from qwen35_fast.runtime.sampling import SamplingParams, draw_seed, draw_uniform, penalty_marks, pick

from _models import poison_allocator

VOCAB = 248320


def _candidates(logits, p):
    return candidates_ref(logits, p.top_k, p.temperature, p.min_p, p.top_p)


def test_sampling_filters():
    logits = torch.tensor([5.0, 4.0, 1.0, -2.0])
    assert int(pick(logits, SamplingParams(), 0, 0)) == 0
    top1 = SamplingParams(do_sample=True, top_k=1)
    assert {int(pick(logits, top1, 7, n)) for n in range(20)} == {0}
    narrow = SamplingParams(do_sample=True, top_p=0.5)
    assert {int(pick(logits, narrow, 7, n)) for n in range(20)} == {0}
    minp = SamplingParams(do_sample=True, min_p=0.2)  # keeps tokens with p >= 0.2 * p_max: ids 0 and 1
    assert {int(pick(logits, minp, 7, n)) for n in range(200)} == {0, 1}
    marks = torch.tensor([1, 2, 0, 1], dtype=torch.uint8)  # ids 0 and 3 seen, id 1 answered
    assert penalise_ref(logits, marks, 2.0, 1.5).tolist() == [2.5, 2.5, 1.0, -4.0]


@pytest.mark.parametrize("top_p", [1e-30, 1e-46, 1e-300, 5e-324])
def test_a_top_p_below_fp32s_range_keeps_the_most_likely_candidate(top_p):
    """A top_p in (0, 1] too small for fp32 (below 7e-46 it rounds to 0 there) keeps the first candidate, as any
    top_p below its probability does: before, every weight was 0 and the draw took the last candidate, the least
    likely token of the vocabulary."""
    logits = torch.tensor([5.0, 1.0, 0.0, -3.0])
    p = SamplingParams(do_sample=True, top_p=top_p)
    p.check()
    weights, ids = _candidates(logits, p)
    assert ids.tolist() == [0, 1, 2, 3] and weights[0] > 0 and not weights[1:].any()
    assert {int(pick(logits, p, 7, n)) for n in range(20)} == {0}
    assert int(sample_ref(logits, 2, 1.0, 0.0, top_p, 0.99)[0]) == 0  # with top_k too


def test_penalties_mark_what_they_see():
    """The marks start with the prompt's ids; each pick marks its id as seen and answered; greedy with penalties
    takes the penalised argmax."""
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)
    assert penalty_marks([0, 1], SamplingParams(), 4, torch.device("cpu")) is None
    marks = penalty_marks([3, 1, 3], p, 6, torch.device("cpu"))
    assert marks.tolist() == [0, 1, 0, 1, 0, 0]
    logits = torch.tensor([1.0, 3.0, 0.5, 2.5, -1.0, 2.2])
    assert int(pick(logits, p, 0, 0, None, marks)) == 1  # 3.0 / 1.3 = 2.31 still above 2.2
    assert marks.tolist() == [0, 3, 0, 1, 0, 0]
    assert int(pick(logits, p, 0, 1, None, marks)) == 5  # 3.0 / 1.3 - 0.5 = 1.81 below 2.2 once answered
    assert marks.tolist() == [0, 3, 0, 1, 0, 3]
    sampled = SamplingParams(do_sample=True, top_k=2, temperature=0.01, presence_penalty=5.0)
    marks = penalty_marks([], sampled, 6, torch.device("cpu"))
    assert [int(pick(logits, sampled, 1, n, None, marks)) for n in range(3)] == [1, 3, 5]  # each answered id drops


def _distribution_over_the_vocabulary(logits, p):
    """The sampling distribution as its definition reads, over every id (the top-k as a threshold on the
    logits, the softmax over all of them, top_p over the vocabulary sorted): the reference of the candidates."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        s, order = torch.sort(probs, descending=True)
        probs = torch.zeros_like(probs).scatter_(0, order, s * (s.cumsum(0) - s < p.top_p))
    return probs / probs.sum()


SETTINGS = [(20, 0.8, 0.0, 0.7), (40, 0.9, 0.0, 1.0), (0, 0.8, 0.0, 0.7), (20, 1.0, 0.0, 0.7), (5, 0.95, 0.1, 1.3),
            (0, 1.0, 0.05, 1.0), (1, 0.5, 0.0, 0.7), (3000, 0.99, 0.0, 0.5), (64, 0.6, 0.02, 2.0)]


@pytest.mark.parametrize("top_k,top_p,min_p,temperature", SETTINGS)
def test_candidates_are_the_distribution_the_settings_define(top_k, top_p, min_p, temperature):
    """The candidates (top_k's k values, not the vocabulary) give each id the probability the settings define
    over the whole vocabulary (distinct logits: no tie at the k-th), in order of logit."""
    p = SamplingParams(do_sample=True, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    for seed in range(3):
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * 4
        want = _distribution_over_the_vocabulary(logits, p)
        weights, ids = _candidates(logits, p)
        got = torch.zeros_like(want)
        got[torch.arange(len(weights)) if ids is None else ids] = weights / weights.sum()
        if top_k and top_k < logits.numel():
            assert len(weights) == top_k
        if ids is not None:
            assert (logits[ids].diff() <= 0).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert (got > 0).sum() == (want > 0).sum() >= 1


def test_top_k_keeps_k_candidates_where_the_logits_tie():
    """bf16 logits tie often: top_k keeps exactly k ids, none with a logit below one it dropped, and of the
    ids tied at the k-th logit the lowest; ties are ordered by id."""
    logits = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 3).bfloat16().float()
    for k in (20, 64, 500):
        ids = top_k_ref(logits, k)
        assert len(ids) == k and len(set(ids.tolist())) == k
        dropped = torch.ones_like(logits, dtype=torch.bool)
        dropped[ids] = False
        kth = logits[ids[-1]]
        assert logits[ids].min() == kth and logits[dropped].max() <= kth
        tied = (logits == kth).nonzero().squeeze(1)
        assert ids[logits[ids] == kth].tolist() == tied[:int((logits[ids] == kth).sum())].tolist()
        order = sorted(ids.tolist(), key=lambda i: (-float(logits[i]), i))
        assert ids.tolist() == order
    assert top_k_ref(torch.zeros(100), 7).tolist() == list(range(7))
    ids = candidates_ref(logits, 0, 1.0, 0.0, 0.5)[1]  # top_p alone: the whole vocabulary in the same order
    assert torch.equal(ids[:500], top_k_ref(logits, 500)) and len(ids) == len(logits)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "flat", "masked", "nan", "signed_zeros"])
def test_the_cpu_forms_give_what_the_gpu_forms_give(kind):
    """The reference's CPU forms (a topk over the logits with the ties fixed; the penalties on the marked ids)
    give what its GPU forms (a topk over the keys; selects over the vocabulary) give, bit for bit."""
    from qwen35_fast.kernels.sampling import reference as ref
    g = torch.Generator().manual_seed(len(kind))
    x = torch.randn(VOCAB, generator=g) * 4
    if kind == "bf16":
        x = x.bfloat16().float()
    elif kind == "flat":
        x = torch.zeros(VOCAB)
    elif kind == "masked":
        x = x.masked_fill(torch.rand(VOCAB, generator=g) < 0.99, -float("inf"))
    elif kind == "nan":
        x[[5, 77, 1000]] = float("nan")
    elif kind == "signed_zeros":  # -0.0 before +0.0 by id; the keys (and the kernel) rank +0.0 first
        x = torch.full((VOCAB,), -5.0)
        x[[2, 9, 40]], x[[5, 30]] = -0.0, 0.0
    for k in (1, 2, 20, 64, 3000):
        assert torch.equal(ref._top_k_values(x, k), ref._top_k_keys(x, k)), k
    marks = torch.randint(0, 4, (VOCAB,), generator=g, dtype=torch.uint8)
    for rep, presence in ((1.3, 0.0), (0.7, 1.5), (1.0, 2.0)):
        torch.testing.assert_close(ref._penalise_marked(x, marks, rep, presence),
                                   ref._penalise_selects(x, marks, rep, presence), rtol=0, atol=0, equal_nan=True)


def test_order_keys_follow_the_logits_then_the_ids():
    x = torch.tensor([0.0, -0.0, 1.5, -1.5, float("inf"), -float("inf"), 1e-38, -1e-38, 3.0, 3.0, float("nan")])
    keys = order_keys(x)
    assert len(set(keys.tolist())) == len(x)
    ranked = torch.argsort(keys, descending=True).tolist()
    assert ranked == [10, 4, 8, 9, 2, 6, 0, 1, 7, 3, 5]  # NaN first (as torch.topk), ties by id, +0 above -0


def test_draw_uniform_is_uniform_and_a_function_of_seed_and_step():
    us = [draw_uniform(draw_seed(3), n) for n in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == len(us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    counts = torch.histc(torch.tensor(us), bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 200
    assert us[:5] == [draw_uniform(draw_seed(3), n) for n in range(5)]
    assert draw_uniform(draw_seed(3), 0) != draw_uniform(draw_seed(4), 0)


def test_draw_uniform_is_splitmix64():
    """Token n of seed s draws splitmix64's (n + 1)th output from state s (its top 53 bits): the generator's
    published outputs, so a draw moved to another step or stream shows (the same seed would still repeat)."""
    vectors = {0: [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4],
               1234567: [6457827717110365317, 3203168211198807973, 9817491932198370423]}
    for seed, outputs in vectors.items():
        assert [draw_uniform(seed, n) for n in range(len(outputs))] == [(w >> 11) * 2.0 ** -53 for w in outputs]


def test_draw_takes_the_first_candidate_past_u():
    w = torch.tensor([0.5, 0.0, 0.25, 0.25, 0.0])
    assert [int(draw_ref(w, u)) for u in (0.0, 0.49, 0.5, 0.74, 0.75, 1 - 2 ** -53)] == [0, 0, 2, 2, 3, 3]


def test_a_draw_summed_in_fp32_never_takes_a_candidate_without_weight(monkeypatch):
    """Apple's GPUs sum the weights in fp32, where u * total rounds to the total for u above 1 - 2**-25: the draw
    stays on the last candidate with weight (the fp32 sum run here on the CPU)."""
    import importlib
    ref = importlib.import_module("qwen35_fast.kernels.sampling.reference")
    w = torch.tensor([0.6, 0.4, 0.0, 0.0])
    u = 1 - 2 ** -26
    assert int(draw_ref(w, u)) == 1
    monkeypatch.setattr(ref, "sum_dtype", lambda device: torch.float32)
    assert [int(draw_ref(w, x)) for x in (0.0, 0.59, 0.6, u)] == [0, 0, 1, 1]


def test_draws_follow_the_weights():
    """20,000 draws at the node's default settings: each candidate as often as its weight says (4 sigma)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    args = (20, 0.7, 0.0, 0.8)
    weights, ids = candidates_ref(logits, *args)
    p = weights / weights.sum()
    n = 20000
    seed = draw_seed(1)
    got = torch.tensor([int(ids[draw_ref(weights, draw_uniform(seed, i))]) for i in range(n)])
    assert int(sample_ref(logits, *args, draw_uniform(seed, 0))[0]) == int(got[0])
    freq = torch.stack([(got == i).float().mean() for i in ids])
    assert set(got.tolist()) <= set(ids[p > 0].tolist())
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-4).all()


# ----------------------------------------------------------------------------- sample.cu on a GPU

KERNEL_VOCABS = [VOCAB, 151936, 4097, 1000, 65]
KERNEL_SETTINGS = [(20, 0.7, 0.0, 0.8), (1, 1.0, 0.0, 1.0), (2, 0.5, 0.0, 1.0), (40, 0.8, 0.05, 0.9),
                   (64, 1.3, 0.0, 1.0), (64, 0.3, 0.1, 0.5), (7, 1e-3, 0.0, 0.99), (16, 1.0, 0.0, 1e-300)]


def _logits(kind: str, v: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(v, generator=g, device="cuda") * 4
    if kind == "bf16":  # ties everywhere
        return x.bfloat16().float()
    if kind == "flat":  # one value: the ids decide
        return torch.zeros(v, device="cuda")
    if kind == "masked":  # most ids at -inf, a few ties at the top
        x = x.masked_fill(torch.rand(v, generator=g, device="cuda") < 0.9, -float("inf"))
        x[v // 3] = x[v // 2] = x.max() + 1
        return x
    return x


def _check_against_reference(logits, args, u, got):
    """The kernel's (token, weights, ids) against the reference's: the same ids in the same order, the same
    weights, the same token. A candidate on an edge (the probability before it within 1e-6 of top_p, or its
    own within 1e-6 of min_p's floor: flat logits put the mass before candidate 36 of 40 at exactly 0.9) may be
    kept by one and dropped by the other's rounding; the token is compared where neither such a candidate
    nor u * the total at a boundary between two candidates leaves it open."""
    tok, weights, ids = got
    rtok, rweights, rids = sample_ref(logits, *args, u)
    assert torch.equal(ids, rids)
    _, temperature, min_p, top_p = args
    probs = torch.softmax(logits[rids].double() / temperature, 0)
    floor = min_p * probs[0]
    kept = probs.masked_fill(probs < floor, 0.0)
    edge = ((probs - floor).abs() < 1e-6) & (min_p > 0)
    if top_p < 1.0:
        edge |= (kept.cumsum(0) - kept - top_p).abs() < 1e-6
    sure = ~edge
    torch.testing.assert_close(weights[sure], rweights[sure], rtol=2e-6, atol=1e-9)
    assert torch.equal((weights > 0)[sure], (rweights > 0)[sure])
    if not torch.equal(weights > 0, rweights > 0):
        return
    run = rweights.double().cumsum(0)
    target = u * float(run[-1])
    if (run - target).abs().min() > 1e-6 * float(run[-1]):  # not at a boundary of two candidates
        assert int(tok) == int(rtok)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "bf16", "flat", "masked"])
@pytest.mark.parametrize("v", KERNEL_VOCABS)
def test_kernel_picks_what_the_reference_picks(impl, v, kind):
    from qwen35_fast.kernels.sampling.launch import K_MAX, sample_cuda, sample_takes
    g = torch.Generator(device="cuda").manual_seed(v + len(kind))
    for args in KERNEL_SETTINGS:
        if args[0] >= v:
            continue
        logits = _logits(kind, v, g)
        for n in range(4):
            u = draw_uniform(draw_seed(v), n)
            poison_allocator(((args[0],), torch.float32), ((args[0],), torch.float64), ((1,), torch.float64),
                             ((64 * K_MAX,), torch.float64))  # NaN's bits in the int64 outputs' blocks too
            assert sample_takes(logits, args[0])
            got = sample_cuda(logits, *args, u)
            _check_against_reference(logits, args, u, got)
    from qwen35_fast.kernels.cuda_build import stream_flags
    assert not stream_flags(torch.device("cuda"), 1).any()  # the ticket set back to zero


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,rep,presence", [(20, 1.3, 0.0), (40, 1.0, 1.5), (1, 1.1, 0.3), (64, 0.8, 2.0)])
def test_kernel_penalties_and_marks_are_the_reference(impl, top_k, rep, presence):
    """Marks on a third of the ids (the prompt) and on some answered ones: the kernel penalises as the
    reference does, draws the same token, and marks it as the reference does."""
    from qwen35_fast.kernels.sampling.launch import K_MAX, sample_cuda
    g = torch.Generator(device="cuda").manual_seed(top_k)
    logits = torch.randn(VOCAB, generator=g, device="cuda") * 3
    marks = (torch.rand(VOCAB, generator=g, device="cuda") < 0.3).to(torch.uint8)
    marks[torch.topk(logits, 30).indices[::3]] = 3  # answered ids among the top candidates
    for n in range(6):
        u = draw_uniform(draw_seed(top_k), n)
        kernel_marks, ref_marks = marks.clone(), marks.clone()
        poison_allocator(((top_k,), torch.float32), ((top_k,), torch.float64), ((1,), torch.float64),
                         ((64 * K_MAX,), torch.float64))  # as above: the outputs start as NaN's bits
        got = sample_cuda(logits, top_k, 0.8, 0.0, 0.9, u, (kernel_marks, rep, presence))
        want = sample_ref(logits, top_k, 0.8, 0.0, 0.9, u, (ref_marks, rep, presence))
        assert torch.equal(got[2], want[2])
        torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-9)
        assert int(got[0]) == int(want[0]) and torch.equal(kernel_marks, ref_marks)
        assert int(kernel_marks[int(got[0])]) == 3
        marks = kernel_marks


@pytest.mark.gpu
def test_kernel_draws_follow_the_weights(impl):
    """4,000 launches at the node's default settings over the full vocabulary: frequencies within 4 sigma."""
    from qwen35_fast.kernels.sampling.launch import sample_cuda
    logits = torch.randn(VOCAB, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)) * 2
    args = (20, 0.7, 0.0, 0.8)
    weights, ids = candidates_ref(logits, *args)
    p = (weights / weights.sum()).cpu()
    n = 4000
    seed = draw_seed(11)
    got = torch.cat([sample_cuda(logits, *args, draw_uniform(seed, i))[0] for i in range(n)]).cpu()
    freq = torch.stack([(got == i).float().mean() for i in ids.cpu()])
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3).all()


@pytest.mark.gpu
def test_kernel_on_a_side_stream_and_in_a_cuda_graph(impl):
    """The ticket is per stream, and a captured launch has its own: replays pick what the eager call picks."""
    from qwen35_fast.kernels.sampling.launch import sample_cuda
    logits = torch.randn(VOCAB, device="cuda") * 3
    want = sample_cuda(logits, 40, 0.9, 0.0, 0.95, 0.6)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = sample_cuda(logits, 40, 0.9, 0.0, 0.95, 0.6)
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        captured = sample_cuda(logits, 40, 0.9, 0.0, 0.95, 0.6)
    for _ in range(3):
        captured[0].fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, want))


@pytest.mark.gpu
def test_pick_on_the_cuda_backend_takes_the_kernel_and_else_the_reference(impl, monkeypatch):
    """pick: top_k 1 to 64 on the kernel; top_k above 64 or off on the torch ops, on the GPU; both the
    reference's token for the same draw."""
    from qwen35_fast.kernels.sampling import launch
    backend = kernels.select_backend("cuda", "cuda")
    logits = torch.randn(VOCAB, device="cuda") * 3
    calls = []
    monkeypatch.setattr(launch, "get_function", lambda *a, **k: calls.append(a) or launch_get(*a, **k))
    for top_k, kernel in ((20, True), (64, True), (65, False), (0, False)):
        calls.clear()
        p = SamplingParams(do_sample=True, top_k=top_k, top_p=0.9, temperature=0.8)
        for n in range(3):
            tok = pick(logits, p, 5, n, backend)
            assert tok.is_cuda and int(tok) == int(sample_ref(logits, top_k, 0.8, 0.0, 0.9, draw_uniform(5, n))[0])
        assert bool(calls) == kernel


def launch_get(*a, **k):
    from qwen35_fast.kernels.cuda_build import get_function
    return get_function(*a, **k)


def test_greedy_decoding_takes_any_temperature():
    """The temperature only matters when sampling: greedy with 0 (what other tools write for greedy) is fine, and
    sampling with it is refused with the way out."""
    from qwen35_fast.runtime import Qwen35Error, SamplingParams
    SamplingParams(do_sample=False, temperature=0.0).check()
    with pytest.raises(Qwen35Error, match="temperature 0.0 must be at least .* turn sampling off for greedy"):
        SamplingParams(do_sample=True, temperature=0.0).check()
