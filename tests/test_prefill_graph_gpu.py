"""Short prefills after a cached prefix replayed from CUDA graphs (runtime/prefill_graph.py) on the
kernels: the replay equals the same padded pass run eagerly (bit for bit) and the unpadded prefill (bf16:
2e-2 relative, the same greedy token), for any prompt length of a bucket; prefix reuse takes the graph,
and a grown store or a moved model captures again."""

import pytest
import torch

from qwen35_fast.runtime import generate, prefill
from qwen35_fast.runtime.prefill_graph import BUCKETS, PaddedPrefill, padded_prefill
from qwen35_fast.runtime.sampling import SamplingParams

from _models import kernels_model, poison_allocator, rel

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(do_sample=False)
BF16 = 2e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return kernels_model(tmp_path_factory.mktemp("prefill_graph_gpu"), seed=8)


def _prefix(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(1, n)
    model.forward_prefill(torch.randint(0, model.config.vocab_size, (1, n), generator=g).cuda(), cache)
    return cache


@pytest.mark.parametrize("bucket", BUCKETS)
def test_replay_equals_the_eager_pass_and_the_unpadded_prefill(model, bucket):
    base = _prefix(model, 300, seed=bucket)
    graphed = PaddedPrefill(model, bucket, capture=True)
    eager = PaddedPrefill(model, bucket, capture=False)
    g = torch.Generator().manual_seed(bucket + 1)
    for n in (bucket, 1, 37, bucket - 1):  # captured on the first, replayed for the others
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        cut = [max(1, n // 2)] if n > 1 else []
        a, b, c = base.clone(), base.clone(), base.clone()
        poison_allocator(((bucket, model.config.hidden_size * 8), torch.bfloat16))
        got, got_kept = graphed(a, ids, None, None, cut)
        same, same_kept = eager(b, ids, None, None, cut)
        assert graphed.graph is not None
        assert torch.equal(got, same) and len(got_kept) == len(same_kept) == len(cut)
        for x, y in zip(a.conv + a.ssm + [t for s in got_kept for t in s.conv + s.ssm],
                        b.conv + b.ssm + [t for s in same_kept for t in s.conv + s.ssm]):
            assert (x is None and y is None) or torch.equal(x, y)
        x = torch.tensor([ids], device="cuda")
        want, want_kept = model.forward_prefill_kept(x, c, cut) if cut else (model.forward_prefill(x, c), [])
        assert torch.isfinite(got).all() and rel(got, want) <= BF16 and got.argmax() == want.argmax()
        assert len(want_kept) == len(cut)
        for s, w in zip(got_kept, want_kept):
            assert s.length == w.length
            assert all(rel(p, q) <= BF16 for p, q in zip(s.ssm, w.ssm) if p is not None)
        for tok in (11, 12):  # decoding overwrites the filler's K/V
            assert rel(model.forward_decode(torch.tensor([tok], device="cuda"), a),
                       model.forward_decode(torch.tensor([tok], device="cuda"), c)) <= BF16


def test_reuse_takes_the_graph(model):
    model.setup_kv()
    system = "You write prompts for an image model. Keep them short and concrete. " * 8
    prefill(model, "A harbour at dawn.", system_prompt=system)
    assert not model.graphs
    second = prefill(model, "A forest in the rain, seen from above.", system_prompt=system)
    g = model.graphs[("prefill", BUCKETS[0])]
    assert second.cached_tokens > 0 and g.graph is not None
    third = prefill(model, "Mountains under snow.", system_prompt=system)  # a replay
    assert model.graphs[("prefill", BUCKETS[0])] is g
    for pf, q in ((second, "A forest in the rain, seen from above."), (third, "Mountains under snow.")):
        cold = prefill(model, q, system_prompt=system, use_cache=False)
        assert rel(pf.logits, cold.logits) <= BF16 and pf.logits.argmax() == cold.logits.argmax()
        assert (generate(model, pf, max_new_tokens=12, sampling=GREEDY).token_ids
                == generate(model, cold, max_new_tokens=12, sampling=GREEDY).token_ids)


def test_a_grown_store_or_a_moved_model_captures_again(model):
    model.setup_kv()
    base = _prefix(model, 100, seed=2)
    first = padded_prefill(model, base.length, 10)
    first(base.clone(), list(range(10)), None, None, [])
    assert padded_prefill(model, base.length, 10) is first
    model.kv.grow(model.kv.num_blocks * 2)
    again = padded_prefill(model, base.length, 10)
    assert again is not first
    a, b = base.clone(), base.clone()
    got, _ = again(a, list(range(10)), None, None, [])
    want = model.forward_prefill(torch.arange(10, device="cuda")[None], b)
    assert rel(got, want) <= BF16
    model.to("cpu")
    assert not model.graphs
    model.to("cuda")


def test_the_pytorch_path_replays_short_prefills_from_a_graph_too(tmp_path):
    """On a GPU without our kernels (AMD, NVIDIA before Ampere: the PyTorch path) a short prompt after a cached
    prefix takes the graph as well: the padded pass reads nothing back to the host, so it captures, and its
    replay equals the same pass run eagerly for any length of the bucket; prefix reuse takes it and gives the
    cold prefill's greedy tokens."""
    model = kernels_model(tmp_path, seed=9)
    model.set_backend("torch")
    base = _prefix(model, 200, seed=4)
    graphed = PaddedPrefill(model, BUCKETS[0], capture=True)
    eager = PaddedPrefill(model, BUCKETS[0], capture=False)
    g = torch.Generator().manual_seed(5)
    for n in (BUCKETS[0], 3, 29):
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        got, _ = graphed(base.clone(), ids, None, None, [])
        same, _ = eager(base.clone(), ids, None, None, [])
        assert graphed.graph is not None and torch.equal(got, same)
    model.setup_kv()
    system = "You write prompts for an image model. Keep them short and concrete. " * 8
    prefill(model, "A harbour at dawn.", system_prompt=system)
    second = prefill(model, "A forest in the rain, seen from above.", system_prompt=system)
    assert second.cached_tokens > 0 and model.graphs[("prefill", BUCKETS[0])].graph is not None
    cold = prefill(model, "A forest in the rain, seen from above.", system_prompt=system, use_cache=False)
    assert rel(second.logits, cold.logits) <= BF16
    assert (generate(model, second, max_new_tokens=12, sampling=GREEDY).token_ids
            == generate(model, cold, max_new_tokens=12, sampling=GREEDY).token_ids)


def test_a_prompt_read_again_from_where_its_first_read_started_gives_its_logits(model):
    """reuse_at_most on the kernels (what ModelPrefill does for an output ComfyUI hands on after the node ran
    with other inputs): the same prompt read again from its first read's cached_tokens gives that read's logits
    bit for bit, for a first read that was cold and for one that reused the system prompt through the graph;
    the read from the longest prefix (the turn end the first read left) is within rounding only."""
    model.setup_kv()
    system = "You caption photographs for a catalogue. One sentence, no adjectives of taste. " * 6
    for prompt in ("A red bicycle against a wall.", "Two cups on a wooden table.", "A dog asleep on a rug."):
        first = prefill(model, prompt, system_prompt=system)
        again = prefill(model, prompt, system_prompt=system, reuse_at_most=first.cached_tokens)
        assert again.cached_tokens == first.cached_tokens and torch.equal(again.logits, first.logits)
        longest = prefill(model, prompt, system_prompt=system)
        assert longest.cached_tokens > first.cached_tokens
        assert rel(longest.logits, first.logits) <= BF16 and longest.logits.argmax() == first.logits.argmax()
    assert model.graphs[("prefill", BUCKETS[0])].graph is not None  # the reusing reads replayed it
