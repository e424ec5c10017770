"""Graphed against eager decode, step by step, on the GPU test's tiny model (tests/test_runtime_gpu.py's folder):
the same tokens fed to a GraphedDecode and to model.forward_decode, each on its own clone of one prefill's cache,
logits compared bit for bit; then again after the allocator's cached memory was filled with NaN (a kernel that
reads memory nothing wrote shows as a difference or a NaN), and generate() greedy / sampled, graphed and eager.

    python3 bench/graph_eager_probe.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def poison_cached_memory(gib: float = 2.0) -> None:
    """Fill `gib` of fresh device memory with NaN and hand it back to the caching allocator: later
    torch.empty calls get NaN where nothing writes."""
    t = torch.full((int(gib * (1 << 30)) // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    del t


def step_logits(model, pf, feed, graphed: bool) -> list[torch.Tensor]:
    from qwen35_fast.runtime.decode_graph import GraphedDecode
    most = pf.n_tokens + len(feed)
    cache = pf.cache.clone(most, device=model.device)
    step = GraphedDecode(model, cache, most) if graphed else None
    out = []
    for t in feed:
        ids = t.view(1)
        out.append((step(ids) if step is not None else model.forward_decode(ids, cache)).float().clone())
    torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from qwen35_fast.runtime import SamplingParams, generate, load_model, prefill_ids

    from _models import make_hf_model
    folder = Path(tempfile.mkdtemp())
    make_hf_model(folder, seed=4, vocab=248320, head_dim_lin=128)
    seqs: dict[str, set] = {}
    for r in range(args.rounds):
        if r % 2 == 1:
            poison_cached_memory()
        model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
        pf = prefill_ids(model, list(range(7000, 7100)))
        feed = torch.randint(0, 248000, (24,), generator=torch.Generator().manual_seed(r)).to("cuda")
        g, e = step_logits(model, pf, feed, True), step_logits(model, pf, feed, False)
        diffs = [float((a - b).abs().max()) for a, b in zip(g, e)]
        finite = all(bool(torch.isfinite(a).all() and torch.isfinite(b).all()) for a, b in zip(g, e))
        first = next((i for i, d in enumerate(diffs) if d != 0), None)
        print(f"round {r} (poisoned {r % 2 == 1}): graph vs eager logits, first step that differs {first}, "
              f"max |diff| per step {['%.2g' % d for d in diffs]}, all finite {finite}", flush=True)
        e2 = step_logits(model, pf, feed, False)
        print(f"  eager twice: equal {all(torch.equal(a, b) for a, b in zip(e, e2))}", flush=True)
        for name, s in (("greedy", SamplingParams()),
                        ("sampled", SamplingParams(do_sample=True, temperature=0.8, top_p=0.9))):
            for mode in ("1", "0"):
                os.environ["QWEN35_CUDA_GRAPHS"] = mode
                ids = tuple(generate(model, pf, max_new_tokens=24, sampling=s, seed=3).token_ids)
                seqs.setdefault(f"{name} graphs={mode}", set()).add(ids)
            os.environ.pop("QWEN35_CUDA_GRAPHS", None)
        del model, pf
        torch.cuda.empty_cache()
    for k, v in seqs.items():
        print(f"{k}: {len(v)} distinct sequence(s) over {args.rounds} rounds")
    for name in ("greedy", "sampled"):
        a, b = seqs[f"{name} graphs=1"], seqs[f"{name} graphs=0"]
        print(f"{name}: graphed == eager in every round: {a == b and len(a) == 1}")


if __name__ == "__main__":
    main()
