"""The portable prefill path's state-walk shapes, timed on the GPU in hand as the RTX cards build it.

    python3 bench/gdn_prefill_portable.py [--out portable-sweep.json] [--arch compute_80] [--fused-out 16]

For each size of bench/gdn.py (Qwen3.5-9B GDN shapes, bf16, initial and final state) and each (columns per
state block, segments) the plan could pick: CUDA-graph replay median ms of the whole call, and the plan's own
choice with its per-kernel split (CUDA events, eager). The step times in plan.PORTABLE_STEP_US come from here.
--fused-out N also times each configuration whose segments have at most N chunks both ways, o formed in the
state walk and by the output kernel (rows with "fused_out"), which sets plan.out_in_walk.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _import  # noqa: E402,F401

from qwen35_fast.kernels.cuda_build import card_of  # noqa: E402
from qwen35_fast.kernels.gdn_prefill import plan as P  # noqa: E402
from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda  # noqa: E402

from gdn import PREFILL_SIZES, bench_ms, graph_of, kernel_breakdown, prefill_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="portable-sweep.json")
    ap.add_argument("--arch", default="compute_80")
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--fused-out", type=int, default=0, metavar="N",
                    help="time segments of at most N chunks with o formed in the walk and by the output kernel")
    args = ap.parse_args()
    rows = []
    card = card_of("cuda")
    for B, L in PREFILL_SIZES:
        x = prefill_inputs(B, L)
        chunks = -(-L // 64)

        def run(x=x, **kw):
            return gdn_chunk_prefill_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["h0"],
                                          None, path="portable", arch=args.arch, **kw)
        auto = P.plan(B, L, B, 16, 32, False, card, path="portable", arch=args.arch)
        configs = [(None, None)] + [(d, s) for d in P.PORTABLE_SPLITS for s in P.PORTABLE_SEGMENTS
                                    if s == 1 or chunks >= 2 * s]
        runs = []
        for dvs, nseg in configs:
            kw = {} if dvs is None else {"dv_split": dvs, "segments": nseg}
            runs.append(kw)
            seg_chunks = -(-chunks // P.seg_count(nseg or auto.segments, chunks))
            if seg_chunks <= args.fused_out:
                runs += [dict(kw, fused_out=False), dict(kw, fused_out=True)]
        for kw in runs:
            dvs, nseg = kw.get("dv_split"), kw.get("segments")
            f = lambda _x=None, kw=kw: run(**kw)  # noqa: E731
            f()
            torch.cuda.synchronize()
            ms = bench_ms(graph_of(f).replay, warmup_ms=20, rep_ms=args.rep_ms)
            row = {"B": B, "L": L, "dv_split": dvs or auto.dv_split, "segments": nseg or auto.segments,
                   "auto": dvs is None, "ms_graph": round(ms, 4)}
            if "fused_out" in kw:
                row["fused_out"] = kw["fused_out"]
            elif dvs is None:
                row["ms_eager"] = round(bench_ms(f, warmup_ms=20, rep_ms=args.rep_ms), 4)
                row["kernels_ms"] = kernel_breakdown(f, None)
            print(json.dumps(row), flush=True)
            rows.append(row)
        x = None
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
