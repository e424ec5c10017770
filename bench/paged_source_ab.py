"""A / B of two versions of a paged-attention kernel source on the GPU in hand, at the 9B shape (16 q / 4 kv
heads, head dim 256, bf16, block 16, shuffled table): CUDA-graph ms per call of the plan's launch for each
Nq x Nkv case, the source swapped between rounds (A B A B ..., so that clock drift falls on both), and
whether the two give the same output bit for bit (and B's relative difference from A).

    python3 bench/paged_source_ab.py kernels/paged_attention/paged_attention_b.cu [--cases 1x16384,256x1024]
        [--rounds 4] [--kernel mma] [--out ab.json]
    python3 bench/paged_source_ab.py --b-plain [--cases ...]   # B: every launch without programmatic serialization

B must sit beside A (the kernels include their neighbours by relative path) and replaces the source of its
kind: paged_attention.cu (the mma.sync kernel), paged_decode.cu, paged_attention_wg.cu, paged_combine.cu (the
merge of the shares). --kernel forces one kernel ("mma", "dec", "wg") instead of the plan's, e.g. the
mma.sync kernel that cards without wgmma run. --b-plain: B is the same sources with every launch plain (the
merge of a split call then starts only after the split kernel's grid has completed, not waiting in grid_wait).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels import cuda_build
from qwen35_fast.kernels.paged_attention import launch as pa_launch

from paged_attention import DEV, HKV, D, H, graph_ms, kv_copies, paged_setup

ATTR = {"paged_attention.cu": "SRC", "paged_decode.cu": "SRC_DEC", "paged_attention_wg.cu": "SRC_WG",
        "paged_combine.cu": "SRC_COMBINE"}
CASES = "1x1024,1x16384,1x65536,16x1024,16x16384,16x65536,256x1024,256x16384"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("b", nargs="?", help="B's source (omit with --b-plain)")
    ap.add_argument("--b-plain", action="store_true", help="B: A's sources, every launch without programmatic "
                    "serialization")
    ap.add_argument("--kind", default="paged_attention.cu", choices=sorted(ATTR))
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kernel", default=None, choices=["mma", "dec", "wg"])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if bool(a.b) == a.b_plain:
        ap.error("give B's source or --b-plain, not both")
    attr = ATTR[a.kind]
    src_a = getattr(pa_launch, attr)
    src_b = src_a if a.b_plain else Path(a.b)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for case in a.cases.split(","):
        Nq, Nkv = (int(x) for x in case.split("x"))
        kv_bytes = 2 * Nkv * HKV * D * 2
        copies = kv_copies(kv_bytes)
        k_pool, v_pool, tables = paged_setup(Nq, Nkv, 16, copies, True, gen)
        qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
        kn = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        lens = torch.tensor([Nkv], dtype=torch.int32, device=DEV)
        cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)

        def calls():
            return [lambda t=t: pa_launch.paged_attention_cuda(qg[..., :D], kn, kn, k_pool, v_pool, t, lens, cu_q,
                                                               qg[..., D:], Nq, write_kv=False, kernel=a.kernel)
                    for t in tables]
        times = {"a": [], "b": []}
        outs = {}
        for _ in range(a.rounds):
            for name, src in (("a", src_a), ("b", src_b)):
                setattr(pa_launch, attr, src)
                cuda_build.PROGRAMMATIC = not (a.b_plain and name == "b")
                try:
                    times[name].append(graph_ms(calls()))
                    outs[name] = calls()[0]()
                finally:
                    setattr(pa_launch, attr, src_a)
                    cuda_build.PROGRAMMATIC = True
        row = {"Nq": Nq, "Nkv": Nkv, "ms_a": round(statistics.median(times["a"]), 5),
               "ms_b": round(statistics.median(times["b"]), 5), "rounds_a": [round(x, 5) for x in times["a"]],
               "rounds_b": [round(x, 5) for x in times["b"]], "same_output": bool(torch.equal(outs["a"], outs["b"])),
               "rel_diff": float(f'{((outs["b"].float() - outs["a"].float()).norm() / outs["a"].float().norm()):.2e}')}
        row["b_over_a"] = round(row["ms_b"] / row["ms_a"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        k_pool = v_pool = tables = None
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "a": str(src_a),
                                           "b": "the same, plain launches" if a.b_plain else str(src_b),
                                           "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
