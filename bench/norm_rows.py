"""The residual add + RMSNorm kernel (kernels/rms_norm, RES 1) at a hidden size (default the 9B's) over few and
many rows, with each of several threads per row (default 128, the 9B's, and 256, the whole block, what the
launcher takes for at most FEW_ROWS rows): CUDA-graph us per launch, and how many outputs equal the first
variant's bit for bit (the sum must equal all). Development only; how kernels/rms_norm/launch.py FEW_ROWS was
set (results/norm-rows-h200.json) and the 4B's 64 threads a row (--dim 2560 --tprs 32 64,
results/norm-rows-2560-h200.jsonl).

    python3 bench/norm_rows.py [--dim 4096] [--tprs 128 256] [--rows 64 128 256 1294]
"""
import argparse
import json

import numpy as np
import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import get_function, launch
from qwen35_fast.kernels.rms_norm import launch as norm

from gdn import bench_ms, graph_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tprs", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 1294])
    args = ap.parse_args()
    D, dev = args.dim, "cuda"
    for rows in args.rows:
        res = torch.randn(rows, D, device=dev, dtype=torch.bfloat16)
        x = torch.randn_like(res)
        w = torch.randn(D, device=dev)
        row = {"rows": rows, "D": D}
        want_s = want_y = None
        for tpr in args.tprs:
            fn = get_function(norm.SRC, "rms_norm_fwd", x.device, {"DIM": D, "IN_T": 2, "W_T": 0, "GATED": 0,
                                                                   "ROPE": 0, "RES": 1, "TPR": tpr})
            per_block = norm.WARPS * 32 // tpr
            y, s = torch.empty_like(x), torch.empty_like(x)

            def call():
                launch(fn, ((rows + per_block - 1) // per_block, 1, 1), (norm.WARPS * 32, 1, 1),
                       (x, x, w, y, np.int64(rows), np.int32(1), np.int64(D), np.int64(D), np.int64(D), np.int64(D),
                        np.float32(1e-6), None, None, np.int64(0), res, s))
            call()
            torch.cuda.synchronize()
            if want_s is None:
                want_s, want_y = s.clone(), y.clone()
            row[f"us_tpr{tpr}"] = round(bench_ms(graph_of(call).replay) * 1e3, 2)
            row[f"same_sum_tpr{tpr}"] = bool(torch.equal(s, want_s))
            row[f"same_norm_fraction_tpr{tpr}"] = (y == want_y).float().mean().item()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
