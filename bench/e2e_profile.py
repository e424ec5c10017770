"""Where the end-to-end prefill's time goes: the 9B-shaped model of bench/e2e.py (random weights, bf16,
kernels backend) prefilled once under torch.profiler; prints the CUDA kernels by total time and the
share the GDN kernels take. Development only.

    python3 bench/e2e_profile.py [--layers 32] [--tokens 4096] [--rows 25]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.runtime.model import Qwen35Model

from e2e import nine_b, random_weights_, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    model = Qwen35Model(nine_b(a.layers), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    print(model.set_backend("cuda").reason)
    ids = torch.randint(0, 248000, (1, a.tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def run():
        return model.forward_prefill(ids, model.new_cache(1, a.tokens + 8))

    print(f"prefill {a.tokens} tokens: {timed(run, reps=3):.1f} ms (wall, median of 3)")
    kernel_table(run, a.rows)


def kernel_table(fn, rows: int) -> None:
    """Runs fn once under torch.profiler and prints the GPU time in kernels and the `rows` costliest."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"GPU time in kernels: {total / 1e3:.2f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"{e.self_device_time_total / 1e3:8.3f} ms {100 * e.self_device_time_total / total:5.1f}% "
              f"x{e.count:<5d} {e.key[:110]}")


if __name__ == "__main__":
    main()
