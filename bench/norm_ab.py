"""A / B of RMSNorm kernel sources at the model's norm shapes (bf16): A the kernel as shipped
(kernels/rms_norm/rms_norm.cu), then each source given. How the weight's 16-byte loads were chosen
(results/norm-weights-ab-h200.json: the kernel before them as A, the loads as `rms_norm_vecw.cu`, in git history,
and bench/experiments/rms_norm_wregs.cu: each thread's weights read once into registers, rows in a loop over a
grid capped at --caps blocks per SM). CUDA-graph us per launch, variants in turn each round (drift falls on all),
medians over the rounds; every output compared with A's bit for bit. Development only: writes JSON.

    python3 bench/norm_ab.py bench/experiments/rms_norm_wregs.cu:loop
        [--caps 2 3 4 8] [--rounds 3] [--out bench/results/norm-weights-ab-h200.json]

A source ending in ':loop' takes a capped grid (its kernel loops over the rows); the others one block per
RPB rows, as the launcher launches.
"""
import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import card_of, get_function, launch
from qwen35_fast.kernels.rms_norm import launch as norm

from gdn import bench_ms, ceilings, graph_of

DEV = "cuda"
BF16 = 2


def cases():
    """(name, inputs, defines without TPR, rows for the threads-per-row rule, bytes moved)."""
    g = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=DEV, generator=g).to(dtype)

    out = []
    for T, D in ((4096, 4096), (1294, 4096), (64, 4096), (4096, 2560), (4096, 5120)):
        x, res, w = rnd(T, D), rnd(T, D), rnd(D, dtype=torch.float32) * 0.1
        out.append((f"add + norm [{T} x {D}]", dict(x=x, res=res, w=w, H=1), dict(DIM=D, W_T=0, RES=1), T, 4 * x.nbytes))
    x, w = rnd(4096, 4096), rnd(4096, dtype=torch.float32) * 0.1
    out.append(("norm [4096 x 4096]", dict(x=x, w=w, H=1), dict(DIM=4096, W_T=0), 4096, 2 * x.nbytes))
    q, wq = rnd(4096, 16, 256), rnd(256, dtype=torch.float32) * 0.1
    cos, sin = rnd(4096, 64), rnd(4096, 64)
    out.append(("q norm + rotary [4096 x 16 x 256]", dict(x=q, w=wq, H=16, cos=cos, sin=sin),
                dict(DIM=256, W_T=0, ROPE=64), None, 2 * q.nbytes))
    o, z, wn = rnd(4096, 32, 128), rnd(4096, 32, 128), torch.rand(128, device=DEV, generator=g).to(torch.bfloat16)
    out.append(("GDN gated [4096 x 32 x 128]", dict(x=o, gate=z, w=wn, H=32), dict(DIM=128, W_T=BF16, GATED=1),
                4096 * 32, 3 * o.nbytes))
    return out


def caller(src, loop_cap, inp, defines, tpr):
    x = inp["x"]
    D = defines["DIM"]
    H = inp["H"]
    rows = x.numel() // D
    gate = inp.get("gate")
    res = inp.get("res")
    y = torch.full_like(x, float("nan"))
    s = torch.full_like(x, float("nan")) if res is not None else None
    full = {"IN_T": BF16, "GATED": 0, "ROPE": 0, "RES": 0, **defines, "TPR": tpr}
    fn = get_function(src, "rms_norm_fwd", x.device, full)
    per_block = norm.WARPS * 32 // tpr
    blocks = (rows + per_block - 1) // per_block
    if loop_cap:
        blocks = min(blocks, loop_cap * card_of(x.device).sms)
    i64 = np.int64
    xs0, xs1 = H * D, D
    cos, sin = inp.get("cos"), inp.get("sin")
    args = (x, gate if gate is not None else x, inp["w"], y, i64(rows), np.int32(H), i64(xs0),
            i64(xs1), i64(xs0), i64(xs1), np.float32(1e-6), cos, sin, i64(0 if cos is None else cos.shape[0]), res, s)

    def call():
        launch(fn, (blocks, 1, 1), (norm.WARPS * 32, 1, 1), args)
    return call, (y, s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--caps", type=int, nargs="+", default=[2, 3, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/norm-weights-ab-h200.json")
    a = ap.parse_args()
    bw, _ = ceilings()
    variants = [("A", norm.SRC, 0)]
    for spec in a.sources:
        path, _, kind = spec.partition(":")
        stem = Path(path).stem
        if kind == "loop":
            variants += [(f"{stem} cap {c}", Path(path).resolve(), c) for c in a.caps]
        else:
            variants.append((stem, Path(path).resolve(), 0))
    rows_out = []
    for name, inp, defines, rule_rows, nbytes in cases():
        tpr = norm._tpr(defines["DIM"], rule_rows)
        calls = {}
        want = None
        row = {"case": name, "TPR": tpr, "floor_us": round(nbytes / bw * 1e6, 2), "same_as_A": {}, "us": {}}
        for vname, src, cap in variants:
            call, outs = caller(src, cap, inp, defines, tpr)
            call()
            torch.cuda.synchronize()
            got = [t.clone() for t in outs if t is not None]
            if want is None:
                want = got
            row["same_as_A"][vname] = all(torch.equal(u, v) for u, v in zip(got, want))
            calls[vname] = graph_of(call)
        times = {v: [] for v in calls}
        for _ in range(a.rounds):
            for v, g in calls.items():
                times[v].append(bench_ms(g.replay, rep_ms=100) * 1e3)
        row["us"] = {v: round(statistics.median(t), 2) for v, t in times.items()}
        best = min(row["us"], key=row["us"].get)
        row["best"] = best
        row["best_over_floor"] = round(row["us"][best] / row["floor_us"], 2)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_TBps": round(bw / 1e12, 3),
                                       "rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
