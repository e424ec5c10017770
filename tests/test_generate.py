"""generate(): greedy equals transformers, sampling is reproducible, a prefill is never changed."""
import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.runtime import SamplingParams, generate, load_model, prefill, prefill_ids
from qwen35_fast.runtime.sampling import apply_penalties, pick

from _models import make_hf_model, rel

SAMPLED = SamplingParams(do_sample=True, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01,
                         repetition_penalty=1.1, presence_penalty=0.3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen")
    hf = make_hf_model(folder, seed=11, vocab=248320)
    return hf, load_model(folder, dtype="fp32", device="cpu")


def test_greedy_equals_transformers_greedy(pair):
    hf, model = pair
    ids = list(range(5000, 5040))
    out = generate(model, prefill_ids(model, ids), max_new_tokens=16)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=list(model.config.eos_token_ids), pad_token_id=0)[0, len(ids):]
    assert list(out.token_ids) == ref.tolist()[: len(out.token_ids)]
    assert out.n_tokens == 16 and out.finish_reason == "length"


def test_same_seed_same_text_and_the_prefill_is_unchanged(pair):
    _, model = pair
    pf = prefill(model, "Describe a red fox in the snow.")
    kv = lambda: [t for pair in pf.cache.gather_kv() for t in pair]  # noqa: E731
    snapshot = [None if t is None else t.clone() for t in pf.cache.ssm + pf.cache.conv + kv()]
    copied = model.kv.bytes_copied
    logits = pf.logits.clone()
    a = generate(model, pf, max_new_tokens=12, sampling=SAMPLED, seed=7)
    b = generate(model, pf, max_new_tokens=12, sampling=SAMPLED, seed=7)
    c = generate(model, pf, max_new_tokens=12, sampling=SAMPLED, seed=8)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids
    assert torch.equal(pf.logits, logits) and pf.cache.length == pf.n_tokens
    for before, now in zip(snapshot, pf.cache.ssm + pf.cache.conv + kv()):
        assert (before is None and now is None) or torch.equal(before, now)
    # each generation shares the prefill's blocks: at most its partly filled last block was copied
    block = model.kv.k[:, 0].numel() * 2 * model.kv.k.element_size()
    assert model.kv.bytes_copied - copied <= 3 * block


def test_on_token_streams_the_text_and_can_cancel(pair):
    _, model = pair
    pf = prefill(model, "Count to ten.")
    deltas = []
    out = generate(model, pf, max_new_tokens=8, on_token=lambda d, n, total: deltas.append((d, n, total)))
    assert [n for _, n, _ in deltas] == list(range(1, 9)) and all(t == 8 for *_, t in deltas)
    assert "".join(d for d, _, _ in deltas).strip() == out.text

    class Cancelled(Exception):
        pass

    def cancel(d, n, total):
        if n == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        generate(model, pf, max_new_tokens=8, on_token=cancel)


def test_sampling_filters():
    logits = torch.tensor([5.0, 4.0, 1.0, -2.0])
    greedy = SamplingParams()
    assert int(pick(logits, greedy, None)) == 0
    g = torch.Generator().manual_seed(0)
    top1 = SamplingParams(do_sample=True, top_k=1)
    assert {int(pick(logits, top1, g)) for _ in range(20)} == {0}
    narrow = SamplingParams(do_sample=True, top_p=0.5)
    assert {int(pick(logits, narrow, g)) for _ in range(20)} == {0}
    minp = SamplingParams(do_sample=True, min_p=0.2)  # keeps tokens with p >= 0.2 * p_max: ids 0 and 1
    assert {int(pick(logits, minp, g)) for _ in range(200)} == {0, 1}
    pen = apply_penalties(logits, torch.tensor([0, 3]), torch.tensor([1]),
                          SamplingParams(repetition_penalty=2.0, presence_penalty=1.5))
    assert pen.tolist() == [2.5, 2.5, 1.0, -4.0]


def _distribution_over_the_vocabulary(logits, p):
    """The sampling distribution as its definition reads, over every id (the top-k as a threshold on the
    logits, the softmax over all of them, top_p over the vocabulary sorted): the reference of candidates."""
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


@pytest.mark.parametrize("top_k,top_p,min_p,temperature", [(20, 0.8, 0.0, 0.7), (40, 0.9, 0.0, 1.0), (0, 0.8, 0.0, 0.7),
                                                           (20, 1.0, 0.0, 0.7), (5, 0.95, 0.1, 1.3), (0, 1.0, 0.05, 1.0),
                                                           (1, 0.5, 0.0, 0.7), (3000, 0.99, 0.0, 0.5)])
def test_candidates_are_the_distribution_the_settings_define(top_k, top_p, min_p, temperature):
    """candidates (what pick draws from: top_k's k values, not the vocabulary) gives each id the probability
    the settings define over the whole vocabulary (distinct logits: no tie at the k-th)."""
    from qwen35_fast.runtime.sampling import candidates
    p = SamplingParams(do_sample=True, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    for seed in range(3):
        logits = torch.randn(248320, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * 4
        want = _distribution_over_the_vocabulary(logits, p)
        weights, ids = candidates(logits, p)
        got = torch.zeros_like(want)
        got[torch.arange(len(weights)) if ids is None else ids] = weights / weights.sum()
        if top_k and top_k < logits.numel():
            assert len(weights) == top_k
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert (got > 0).sum() == (want > 0).sum() >= 1


def test_top_k_keeps_k_candidates_where_the_logits_tie():
    """bf16 logits tie often: top_k keeps exactly k ids, none with a logit below one it dropped."""
    from qwen35_fast.runtime.sampling import candidates
    logits = (torch.randn(248320, generator=torch.Generator().manual_seed(5)) * 3).bfloat16().float()
    p = SamplingParams(do_sample=True, top_k=20, top_p=1.0)
    weights, ids = candidates(logits, p)
    assert len(ids) == 20 and len(set(ids.tolist())) == 20
    dropped = torch.ones_like(logits, dtype=torch.bool)
    dropped[ids] = False
    assert logits[ids].min() >= logits[dropped].max()
    g = torch.Generator().manual_seed(0)
    assert {int(pick(logits, p, g)) for _ in range(300)} <= set(ids.tolist())


def test_bad_sampling_settings(pair):
    _, model = pair
    pf = prefill(model, "hi")
    for bad, msg in [(SamplingParams(do_sample=True, temperature=0), "temperature 0"),
                     (SamplingParams(top_p=0.0), "top_p 0.0"), (SamplingParams(top_k=-1), "top_k -1"),
                     (SamplingParams(min_p=1.0), "min_p 1.0")]:
        with pytest.raises(ValueError, match=msg):
            generate(model, pf, max_new_tokens=2, sampling=bad)


def test_prefill_inside_torch_compile_gives_the_same_logits(pair):
    _, model = pair
    ids = list(range(3000, 3070))
    eager = prefill_ids(model, ids).logits

    @torch.compile(backend="eager")
    def wrapped(scale):
        return prefill_ids(model, ids).logits * scale

    assert rel(wrapped(torch.tensor(1.0)), eager) == 0.0


def test_kernel_ops_trace_into_a_full_graph():
    """The custom ops have fake implementations: a fullgraph compile traces through them, no break."""
    q, k = torch.randn(1, 70, 2, 32), torch.randn(1, 70, 2, 32)
    v, a, b = torch.randn(1, 70, 4, 32), torch.randn(1, 70, 4), torch.randn(1, 70, 4)
    A_log, dt = torch.zeros(4), torch.zeros(4)
    x, w = torch.randn(1, 70, 8), torch.randn(8, 4)

    def f(q, k, v, a, b, x):
        y, conv_state = kernels.causal_conv1d_prefill(x, w)
        o, state = kernels.gdn_chunk_prefill(q, k, v, a, b, A_log, dt)
        return o * 2, state, y, conv_state

    eager = f(q, k, v, a, b, x)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, a, b, x)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_on_a_cpu_each_token_is_read_before_the_next_step_and_no_step_follows_the_end(pair, monkeypatch):
    """The decode loop runs one step ahead only on CUDA: on a CPU a token reaches on_token before the step it
    feeds, and the end-of-turn token is the last step computed (none is wasted after it)."""
    import importlib
    gen_mod = importlib.import_module("qwen35_fast.runtime.generate")
    _, model = pair
    eos = model.tokenizer.token_id("<|im_end|>")
    script = iter([11, 12, 13, eos, 14, 15])
    monkeypatch.setattr(gen_mod, "pick", lambda logits, p, g: torch.tensor([next(script)], device=logits.device))
    events = []
    real = model.forward_decode
    monkeypatch.setattr(model, "forward_decode", lambda ids, cache: events.append("step") or real(ids, cache))
    out = generate(model, prefill_ids(model, list(range(5000, 5010))), max_new_tokens=8,
                   on_token=lambda text, n, most: events.append(n))
    assert out.token_ids == (11, 12, 13) and out.finish_reason == "stop"
    assert events == [1, "step", 2, "step", 3, "step"]
