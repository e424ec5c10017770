"""The experimental vision-tower attention (bench/experiments/vision_attention.cu: warpgroup mma, head dims 64 / 72
unpadded) against cuDNN's SDPA (which pads head dim 72 to 128) on the tower's shapes: each variant's time and its
output's relative error against cuDNN's. Writes bench/results/vision-attention-variants-h200.json (or --out).
GPU only (sm_90a).

    python3 bench/vision_attention_variants.py [--out PATH]
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

SRC = Path(__file__).parent / "experiments" / "vision_attention.cu"
VARIANTS = [(2, 64, 0), (2, 64, 1), (1, 64, 1), (3, 64, 1), (2, 128, 1)]  # (WGS, BN, EXP_FAST)
SHAPES = [(1, 4096, 16, 72), (16, 3600, 16, 72), (1, 4096, 16, 64)]  # segments, tokens each, heads, head dim


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision-attention-variants-h200.json"))
    a = ap.parse_args()
    rows = []
    for segs, length, h, hd in SHAPES:
        n = segs * length
        g = torch.Generator(device="cuda").manual_seed(n + hd)
        qkv = torch.randn(n, 3, h, hd, device="cuda", generator=g).bfloat16()
        q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
        cu = torch.arange(segs + 1, device="cuda", dtype=torch.int32) * length
        qs, ks, vs = (x.reshape(segs, length, h, hd).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(n, h, hd).float()
            cudnn = timed(lambda: F.scaled_dot_product_attention(qs, ks, vs))
        shape = f"{segs}x{length}x{h}x{hd}"
        rows.append({"impl": "cudnn", "shape": shape, "ms": round(cudnn, 4)})
        print(f"{shape}: cuDNN {cudnn:.4f} ms")
        for wgs, bn, fast in VARIANTS:
            o = run(q, k, v, cu, length, wgs, bn, fast).float()
            err = ((o - ref).norm() / ref.norm()).item()
            ms = timed(lambda: run(q, k, v, cu, length, wgs, bn, fast))
            rows.append({"impl": "experiment", "shape": shape, "WGS": wgs, "BN": bn, "EXP_FAST": fast, "ms": round(ms, 4),
                         "over_cudnn": round(ms / cudnn, 3), "rel_err_vs_cudnn": float(f"{err:.2e}")})
            print(f"  WGS {wgs} BN {bn} EXP_FAST {fast}: {ms:.4f} ms ({ms / cudnn:.2f} x cuDNN), error {err:.1e}")
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
