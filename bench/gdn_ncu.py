"""Development: one GDN prefill size launched a few times, for Nsight Compute (where the portable path's
1k prompt spends its time: issue 13). Run it under ncu on the GPU machine (Firecracker runtime):

    ncu --clock-control none --kernel-name regex:gdn_chunk --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section SourceCounters \\
        python3 bench/gdn_ncu.py [--size 1x1024] [--path portable] [--arch compute_80]

Without ncu it prints the plan and the median ms of a few eager launches.
"""
import argparse
import json
import statistics
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import card_of
from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda
from qwen35_fast.kernels.gdn_prefill.plan import plan

from gdn import prefill_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1x1024")
    ap.add_argument("--path", default="portable")
    ap.add_argument("--arch", default="compute_80")
    ap.add_argument("--kw", default="{}", help="more launcher overrides, JSON")
    ap.add_argument("--launches", type=int, default=4)
    a = ap.parse_args()
    B, T = (int(x) for x in a.size.split("x"))
    x = prefill_inputs(B, T)
    kw = {"path": a.path, **({"arch": a.arch} if a.arch else {}), **json.loads(a.kw)}
    Hk, Hv = x["q"].shape[2], x["v"].shape[2]
    print(plan(B, T, B, Hk, Hv, False, card_of(x["q"].device), a.path, kw.get("dv_split"), kw.get("segments"),
               kw.get("arch"), kw.get("fused_out")))
    times = []
    for _ in range(a.launches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gdn_chunk_prefill_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["h0"], None, **kw)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"median {statistics.median(times):.4f} ms over {a.launches} eager launches")


if __name__ == "__main__":
    main()
