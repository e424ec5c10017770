"""Where the end-to-end prefill's time goes: the 9B-shaped model of bench/e2e.py (random weights, bf16,
kernels backend) prefilled once under torch.profiler; prints the CUDA kernels by total time and the
share the GDN kernels take; with --decode, one CUDA-graph decode step after that many tokens of context
instead (the kernels of a step, per step). Development only.

    python3 bench/e2e_profile.py [--layers 32] [--tokens 4096] [--rows 25] [--decode 4096]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.runtime.model import Qwen35Model

from e2e import graphed_decode_at, nine_b, random_weights_, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--decode", type=int, default=0, help="profile a graph decode step at this context instead")
    a = ap.parse_args()
    model = Qwen35Model(nine_b(a.layers), torch.bfloat16, torch.device("cuda"))
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


if __name__ == "__main__":
    main()
