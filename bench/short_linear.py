"""The projections of a short prefill (a question after a reused prefix: 64 rows, the graphed bucket) on
cuBLAS, against the weight bytes they must read: are they at the copy bandwidth, and does another form of
the same product get nearer? Forms: F.linear (what the model calls), the transposed product W x^T (the
64 rows as the narrow side), and F.linear with torch's cuBLASLt backend preferred. One CUDA graph of
`calls` products over weights rotated through more bytes than L2 holds, per shape of bench/gemv.py.
Development only.

    python3 bench/short_linear.py [--rows 64] [--calls 24] [--reps 20]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from gemv import L2_ROTATION_BYTES, SHAPES, copy_rate, per_call_ms

import _import  # noqa: F401  (the repo as `qwen35_fast`)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    bw = copy_rate()
    g = torch.Generator(device="cuda").manual_seed(0)
    forms = {"F.linear": F.linear, "W x^T": lambda x, w: torch.mm(w, x.t())}
    for name, (N, K) in SHAPES.items():
        if not name.startswith("9B"):
            continue
        nbytes = N * K * 2
        copies = max(2, -(-L2_ROTATION_BYTES // nbytes))
        weights = [(torch.randn(N, K, generator=g, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        x = torch.randn(a.rows, K, generator=g, device="cuda").bfloat16()
        row = {"shape": name, "N": N, "K": K, "rows": a.rows, "floor_ms": round(nbytes / bw * 1e3, 4)}
        for form, fn in forms.items():
            row[form] = round(per_call_ms(fn, weights, x, a.calls, a.reps), 4)
        prev = torch.backends.cuda.preferred_blas_library()
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["F.linear cublaslt"] = round(per_call_ms(F.linear, weights, x, a.calls, a.reps), 4)
        finally:
            torch.backends.cuda.preferred_blas_library(prev)
        print(json.dumps(row), flush=True)
        del weights


if __name__ == "__main__":
    main()
