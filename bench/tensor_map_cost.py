"""Host cost of a TMA tensor map (kernels/cuda_build.py): encoded (cuTensorMapEncodeTiled through ctypes), copied
with its address replaced (TensorMap.at), and found in tensor_map's cache; µs per map, median of five rounds.

    python3 bench/tensor_map_cost.py
"""
import statistics
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels import cuda_build as cb


def per_call_us(fn, n: int = 2000) -> float:
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(rounds), 2)


def main():
    x = torch.zeros(1 << 24, dtype=torch.bfloat16, device="cuda")
    base = x.data_ptr()
    shape = ((128, 32, 4096, 1), (256, 8192, 8192 * 4096), (64, 1, 64, 1), 2)
    first = cb.TensorMap(base, *shape)
    print({"encode_us": per_call_us(lambda i: cb.TensorMap(base + 16 * i, *shape)),
           "replace_us": per_call_us(lambda i: first.at(base + 16 * i)),
           "cached_us": per_call_us(lambda i: cb.tensor_map(x, *shape))}, flush=True)


if __name__ == "__main__":
    main()
