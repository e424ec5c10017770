"""A / B of two versions of one GDN prefill kernel source on the GPU in hand: each size of bench/gdn.py (or
--sizes), graph-replay median ms of the whole prefill call with the source swapped between rounds (A B A B ...,
so that clock and thermal drift fall on both), and whether the two give the same o and final state bit for bit.

    python3 bench/gdn_source_ab.py kernels/gdn_prefill/portable_b.cu [--a kernels/gdn_prefill/portable.cu]
        [--path portable] [--arch compute_80] [--sizes 1x1024,1x4096] [--rounds 3] [--out ab.json] [--kw '{...}']

B must sit beside A (the kernels include their neighbours by relative path). --kw adds launcher overrides
(JSON, e.g. '{"fused_out": true}').
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

from qwen35_fast.kernels.gdn_prefill import launch as L  # noqa: E402

from gdn import PREFILL_SIZES, bench_ms, graph_of, prefill_inputs  # noqa: E402

ATTR = {"portable.cu": "SRC_PORTABLE", "prep.cu": "SRC_PREP"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("b")
    ap.add_argument("--a", default=None, help="default: the launcher's source of the same kind")
    ap.add_argument("--path", default="portable")
    ap.add_argument("--arch", default="compute_80")
    ap.add_argument("--sizes", default=",".join(f"{B}x{T}" for B, T in PREFILL_SIZES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--kw", default="{}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    b = Path(args.b).resolve()
    attr = next((v for k, v in ATTR.items() if b.name.startswith(k.split(".")[0])), None)
    if attr is None or not hasattr(L, attr):
        sys.exit(f"which launcher source does {b.name} replace? names starting with {list(ATTR)}")
    a = Path(args.a).resolve() if args.a else getattr(L, attr)
    kw = {"path": args.path, "arch": args.arch, **json.loads(args.kw)}
    rows = []
    for size in args.sizes.split(","):
        B, T = (int(x) for x in size.split("x"))
        x = prefill_inputs(B, T)

        def run(x=x):
            return L.gdn_chunk_prefill_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                                            x["h0"], None, **kw)
        graphs, outs = {}, {}
        for name, src in (("a", a), ("b", b)):
            setattr(L, attr, src)
            outs[name] = [t.clone() for t in run()]
            graphs[name] = graph_of(run)
        times = {"a": [], "b": []}
        for _ in range(args.rounds):
            for name in ("a", "b"):
                times[name].append(bench_ms(graphs[name].replay, warmup_ms=20, rep_ms=args.rep_ms))
        same = all(torch.equal(p, q) for p, q in zip(outs["a"], outs["b"]))
        row = {"B": B, "T": T, "ms_a": round(statistics.median(times["a"]), 4),
               "ms_b": round(statistics.median(times["b"]), 4), "rounds_a": [round(t, 4) for t in times["a"]],
               "rounds_b": [round(t, 4) for t in times["b"]], "bitwise_equal": same}
        print(json.dumps(row), flush=True)
        rows.append(row)
        graphs = outs = x = None
        torch.cuda.empty_cache()
    setattr(L, attr, a)
    result = {"a": str(a.name), "b": str(b.name), "kw": kw, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
