"""Where the end-to-end prefill's time goes: the 9B-shaped model of bench/e2e.py (--model: another dense size;
random weights, bf16,
kernels backend) prefilled once under torch.profiler; prints the CUDA kernels by total time and the
share the GDN kernels take; with --decode, one CUDA-graph decode step after that many tokens of context
instead (the kernels of a step, per step). Development only.

    python3 bench/e2e_profile.py [--model 9b] [--layers 32] [--tokens 4096] [--rows 25] [--decode 4096]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.runtime.model import Qwen35Model

from e2e import SHAPES, graphed_decode_at, random_weights_, shaped, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="9b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="default: the model's depth")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--decode", type=int, default=0, help="profile a graph decode step at this context instead")
    a = ap.parse_args()
    model = Qwen35Model(shaped(a.model, a.layers), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    print(model.set_backend("cuda").reason)
    if a.decode:
        decode_table(model, a.decode, a.rows)
        return
    ids = torch.randint(0, 248000, (1, a.tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def run():
        return model.forward_prefill(ids, model.new_cache(1, a.tokens + 8))

    print(f"prefill {a.tokens} tokens: {timed(run, reps=3):.1f} ms (wall, median of 3)")
    kernel_table(run, a.rows)


def decode_table(model, context: int, rows: int, steps: int = 20) -> None:
    """A CUDA-graph decode step at `context` tokens (e2e.graphed_decode_at): wall ms per step and the kernels
    of one step by GPU time."""
    import time

    step, tok = graphed_decode_at(model, context, 3 * steps + 8)  # warm-up, timed and profiled steps
    for _ in range(steps):
        step(tok)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(tok)
    torch.cuda.synchronize()
    print(f"graph decode at {context}: {(time.perf_counter() - t0) * 1e3 / steps:.3f} ms a step (no host sync)")
    kernel_table(lambda: [step(tok) for _ in range(steps)], rows, per=steps)


def kernel_table(fn, rows: int, per: int = 1) -> None:
    """Runs fn once under torch.profiler and prints the GPU time in kernels and the `rows` costliest (divided
    by `per`: fn runs that many steps)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / per
    print(f"GPU time in kernels: {total / 1e3:.3f} ms, {sum(e.count for e in events) // per} kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        t = e.self_device_time_total / per
        print(f"{t / 1e3:8.3f} ms {100 * t / total:5.1f}% x{e.count // per:<5d} {e.key[:110]}")
    by_launch(prof, rows, per)


def by_launch(prof, rows: int, per: int) -> None:
    """The kernels again, told apart by launch shape (grid, block) from the profiler's trace: which products of
    one name (gemv) take the time."""
    import collections
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels = sorted((ev for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel"), key=lambda ev: ev["ts"])
    spans = collections.defaultdict(list)
    for ev in kernels:
        a = ev.get("args", {})
        spans[(ev["name"][:40], tuple(a.get("grid", ())), tuple(a.get("block", ())))].append(ev["dur"])
    print("by launch shape: us a call (median), calls a step, us a step")
    for (name, grid, block), d in sorted(spans.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"{sorted(d)[len(d) // 2]:8.2f} us x{len(d) // per:<4d} {sum(d) / per:8.1f} us  {name} "
              f"grid {grid} block {block}")
    n = len(kernels) // per
    if per > 1 and n * per == len(kernels):  # one step's kernels in launch order, the median of each over the steps
        print(f"a step's first kernels in order (of {n}): us (median), gap before it (us)")
        for i in range(min(n, 2 * rows)):
            d = sorted(kernels[i + k * n]["dur"] for k in range(per))
            gap = sorted(kernels[i + k * n]["ts"] - kernels[i + k * n - 1]["ts"] - kernels[i + k * n - 1]["dur"]
                         for k in range(1, per))
            print(f"{d[per // 2]:8.2f} {gap[len(gap) // 2]:6.2f}  {kernels[i]['name'][:40]} "
                  f"grid {tuple(kernels[i].get('args', {}).get('grid', ()))}")


if __name__ == "__main__":
    main()
