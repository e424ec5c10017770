"""Where a GDN prefill call's time goes in CUDA-graph replay: each kernel's duration and the gaps between them
(torch.profiler's CUPTI records of the replays, medians over the replays), for the sizes of bench/gdn.py.

    python3 bench/gdn_kernel_timeline.py [--path portable --arch compute_80] [--sizes 1x1024,1x4096]
        [--replays 20] [--kw '{"fused_out": false}'] [--out timeline.json]

A row per (size, kernel in launch order): ms (median duration), gap_before_ms (median from the end of the
previous kernel of the same replay to its start; the first kernel's from the replay's first record), and
the replay's span (first start to last end), which is what the graph-replay time of bench/gdn.py measures
plus the launch of the graph itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _import  # noqa: E402,F401

from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda  # noqa: E402

from gdn import PREFILL_SIZES, graph_of, prefill_inputs  # noqa: E402


def replay_kernels(graph, replays: int) -> list[list[tuple[str, float, float]]]:
    """Per replay, its kernels as (name, start us, end us), in start order."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")),
                     key=lambda k: k[1])
    per = len(kernels) // replays
    if per == 0 or per * replays != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernel records for {replays} replays: not the same kernels each time")
    return [kernels[i * per:(i + 1) * per] for i in range(replays)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="portable")
    ap.add_argument("--arch", default="compute_80")
    ap.add_argument("--sizes", default=",".join(f"{B}x{T}" for B, T in PREFILL_SIZES))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--kw", default="{}", help="more launcher overrides, JSON")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    kw = {"path": args.path, **({"arch": args.arch} if args.arch else {}), **json.loads(args.kw)}
    rows = []
    for size in args.sizes.split(","):
        B, T = (int(x) for x in size.split("x"))
        x = prefill_inputs(B, T)

        def run(x=x):
            return gdn_chunk_prefill_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                                          x["h0"], None, **kw)
        per_replay = replay_kernels(graph_of(run), args.replays)
        spans = [r[-1][2] - r[0][1] for r in per_replay]
        for i, (name, _, _) in enumerate(per_replay[0]):
            durs = [r[i][2] - r[i][1] for r in per_replay]
            gaps = [r[i][1] - r[i - 1][2] for r in per_replay] if i else [0.0]
            row = {"B": B, "T": T, "kernel": name, "ms": round(statistics.median(durs) / 1e3, 4),
                   "gap_before_ms": round(statistics.median(gaps) / 1e3, 4),
                   "span_ms": round(statistics.median(spans) / 1e3, 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        x = None
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"kw": kw, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
