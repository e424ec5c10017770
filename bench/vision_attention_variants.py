"""The vision tower's attention kernel (kernels/vision/attention.cu, "ours") and the experimental variants against
cuDNN's SDPA (which pads head dim 72 to 128) on the tower's shapes: bench/experiments/vision_attention.cu (warpgroup mma, head dims 64 / 72 unpadded, every thread
copying with cp.async) and vision_attention_ws.cu (the same with a TMA producer warp and stage barriers). Each
variant's time and its output's relative error against cuDNN's; first, each warp-specialised variant against
an fp32 reference on ragged segments (lengths not multiples of the tiles) with its output poisoned with NaN.
Writes bench/results/vision-attention-variants-h200.json (or --out). GPU only (sm_90a).

    python3 bench/vision_attention_variants.py [--only-ws] [--out PATH]
"""
import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import get_function, launch
from qwen35_fast.kernels.vision.launch import attention_map, vision_attention_cuda
from qwen35_fast.kernels.vision.reference import vision_attention_ref

SRC = Path(__file__).parent / "experiments" / "vision_attention.cu"
SRC_WS = Path(__file__).parent / "experiments" / "vision_attention_ws.cu"
VARIANTS = [(2, 64, 0), (2, 64, 1), (1, 64, 1), (3, 64, 1), (2, 128, 1)]  # (WGS, BN, EXP_FAST)
WS_VARIANTS = [(2, 128, 2, 2, 0, 0, 0), (2, 128, 2, 2, 1, 0, 0), (2, 128, 2, 2, 1, 1, 0), (2, 128, 3, 3, 1, 0, 0),
               (2, 128, 3, 3, 1, 1, 0), (3, 128, 2, 2, 1, 0, 0), (3, 128, 2, 2, 1, 1, 0), (3, 64, 3, 3, 0, 0, 0),
               (3, 64, 3, 3, 1, 0, 0), (3, 64, 4, 4, 1, 1, 0), (3, 128, 2, 3, 1, 1, 0), (3, 128, 3, 2, 1, 1, 0),
               (3, 128, 2, 2, 1, 1, 4), (3, 128, 2, 2, 1, 1, 2)]  # (C, BN, KS, VS, ORDER, PINGPONG, POLY)
WS_KEYS = ("C", "BN", "KS", "VS", "ORDER", "PINGPONG", "POLY")
SHAPES = [(1, 4096, 16, 72), (4, 4096, 16, 72), (16, 3600, 16, 72), (1, 4096, 16, 64)]  # segments, tokens, heads, dim


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def run(q, k, v, cu, length, wgs, bn, fast):
    n, h, hd = q.shape
    fn = get_function(SRC, "vision_attention", q.device, {"HEAD_DIM": hd, "HEADS": h, "WGS": wgs, "BN": bn,
                                                         "EXP_FAST": fast})
    qk_cb, v_cb = math.ceil(2 * math.ceil(hd / 16) / 8), math.ceil(hd // 8 / 8)
    smem = (qk_cb * (64 * wgs + 3 * bn) + 2 * v_cb * bn) * 128 + 1024
    out = torch.empty_like(q)
    launch(fn, (math.ceil(length / (64 * wgs)), (cu.numel() - 1) * h, 1), (128 * wgs, 1, 1),
           (q, np.int64(q.stride(0)), k, np.int64(k.stride(0)), v, np.int64(v.stride(0)), cu, out,
            np.float32(hd ** -0.5 * math.log2(math.e))), shared_mem=smem)
    return out


def ws_smem(hd, c, bn, ks, vs, *_):
    qk_cb, v_cb = math.ceil(2 * math.ceil(hd / 16) / 8), math.ceil(hd // 8 / 8)
    return (qk_cb * 64 * (64 * c) + ks * qk_cb * bn * 64 + vs * v_cb * bn * 64) * 2 + 1024 + 8 * (1 + 2 * ks + 2 * vs)


def run_ws(q, k, v, cu, length, var, out=None):
    n, h, hd = q.shape
    c, bn, ks, vs, order, pp, poly = var
    fn = get_function(SRC_WS, "vision_attention_ws", q.device, {"HEAD_DIM": hd, "HEADS": h, "C": c, "BN": bn,
                                                               "KS": ks, "VS": vs, "ORDER": order, "PINGPONG": pp,
                                                               "POLY": poly})
    maps = [attention_map(x) for x in (q, k, v)]  # the shipped kernel's maps: its boxes, encoded once
    out = torch.empty_like(q) if out is None else out
    launch(fn, (math.ceil(length / (64 * c)), (cu.numel() - 1) * h, 1), (128 * (c + 1), 1, 1),
           (*maps, cu, out, np.float32(hd ** -0.5 * math.log2(math.e))), shared_mem=ws_smem(hd, *var))
    return out


def check_ws(rows):
    """Each warp-specialised variant on ragged segments against the fp32 reference; output poisoned."""
    for hd in (72, 64):
        lens = [1, 63, 200, 1000, 4096 + 37, 129, 64 * 3]
        n, h = sum(lens), 16
        g = torch.Generator(device="cuda").manual_seed(hd)
        qkv = torch.randn(n, 3, h, hd, device="cuda", generator=g).bfloat16()
        q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        ref = vision_attention_ref(q.float(), k.float(), v.float(), cu)
        for var in WS_VARIANTS:
            out = torch.full_like(q, float("nan"))
            run_ws(q, k, v, cu, max(lens), var, out)
            torch.cuda.synchronize()
            o = out.float()
            err = ((o - ref).norm() / ref.norm()).item()
            worst = ((o - ref).abs().amax() / ref.abs().amax()).item()
            ok = bool(torch.isfinite(o).all()) and err < 1e-2
            rows.append({"check": "ragged fp32", "head_dim": hd, **dict(zip(WS_KEYS, var)),
                         "rel_err": float(f"{err:.2e}"), "max_err_rel": float(f"{worst:.2e}"), "ok": ok})
            print(f"check hd {hd} {var}: rel err {err:.1e} max {worst:.1e} {'ok' if ok else 'FAIL'}")


def shape_inputs(segs, length, h, hd):
    """Seeded random q, k (contiguous) and v (strided in qkv) of `segs` segments of `length` tokens, cu_seqlens,
    the same as [segs, h, length, hd] views for SDPA, and cuDNN's output [N, h, hd] in fp32."""
    n = segs * length
    g = torch.Generator(device="cuda").manual_seed(n + hd)
    qkv = torch.randn(n, 3, h, hd, device="cuda", generator=g).bfloat16()
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    cu = torch.arange(segs + 1, device="cuda", dtype=torch.int32) * length
    views = tuple(x.reshape(segs, length, h, hd).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(*views).transpose(1, 2).reshape(n, h, hd).float()
    return q, k, v, cu, views, ref


def measure(rows, shape, ref, cudnn_ms, label, fn, impl, **fields):
    """One row: fn's time and its output's error against cuDNN's (ref), printed and appended to rows."""
    err = ((fn().float() - ref).norm() / ref.norm()).item()
    ms = timed(fn)
    rows.append({"impl": impl, "shape": shape, **fields, "ms": round(ms, 4), "over_cudnn": round(ms / cudnn_ms, 3),
                 "rel_err_vs_cudnn": float(f"{err:.2e}")})
    print(f"  {label}: {ms:.4f} ms ({ms / cudnn_ms:.2f} x cuDNN), error {err:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only-ws", action="store_true", help="only the warp-specialised kernel (and cuDNN)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision-attention-variants-h200.json"))
    a = ap.parse_args()
    rows = []
    check_ws(rows)
    for segs, length, h, hd in SHAPES:
        q, k, v, cu, (qs, ks, vs), ref = shape_inputs(segs, length, h, hd)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = timed(lambda: F.scaled_dot_product_attention(qs, ks, vs))
        shape = f"{segs}x{length}x{h}x{hd}"
        rows.append({"impl": "cudnn", "shape": shape, "ms": round(cudnn, 4)})
        print(f"{shape}: cuDNN {cudnn:.4f} ms")
        base = (rows, shape, ref, cudnn)
        measure(*base, "ours (kernels/vision/attention.cu)", lambda: vision_attention_cuda(q, k, v, cu, length), "ours")
        for var in WS_VARIANTS:
            measure(*base, f"ws {var}", lambda: run_ws(q, k, v, cu, length, var), "ws", **dict(zip(WS_KEYS, var)))
        for wgs, bn, fast in ([] if a.only_ws else VARIANTS):
            measure(*base, f"WGS {wgs} BN {bn} EXP_FAST {fast}", lambda: run(q, k, v, cu, length, wgs, bn, fast),
                    "experiment", WGS=wgs, BN=bn, EXP_FAST=fast)
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
