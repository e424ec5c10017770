"""A / B of the vision attention's grid: a former attention.cu launched as it was (one block per 192-row block of
each (segment, head), wave after wave: `git show ad70ee0:kernels/vision/attention.cu > old.cu`) against the
shipped persistent grid (kernels/vision/attention.cu: whole rounds, then the last blocks' key tiles shared out
evenly). Alternating rounds (A B A B ..., so that clock drift falls on both), the median ms per shape, and
each output's relative error against cuDNN's and against fp32 attention. GPU only (sm_90a).

    python3 bench/vision_attention_ab.py old.cu [--rounds 5] [--out PATH]
"""
import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from vision_attention_variants import timed

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import get_function, launch
from qwen35_fast.kernels.vision.launch import ATTN_ROWS, ATTN_THREADS, attention_map, vision_attention_cuda

SHAPES = [(1, 4096, 16, 72), (2, 4096, 16, 72), (4, 4096, 16, 72), (16, 3600, 16, 72), (1, 1024, 16, 72),
          (1, 4096, 16, 64), (1, 4096, 12, 64)]  # segments, tokens, heads, dim


def old_smem(hd):
    qk_cb, v_cb = (2 * ((hd + 15) // 16) + 7) // 8, (hd + 63) // 64
    return (qk_cb * ATTN_ROWS + 2 * qk_cb * 128 + 2 * v_cb * 128) * 64 * 2 + 1024 + 9 * 8


def run_old(src, q, k, v, cu, length):
    n, h, hd = q.shape
    fn = get_function(src, "vision_attention", q.device, {"HEAD_DIM": hd, "HEADS": h})
    out = torch.empty_like(q)
    launch(fn, (math.ceil(length / ATTN_ROWS), (cu.numel() - 1) * h, 1), (ATTN_THREADS, 1, 1),
           (attention_map(q), attention_map(k), attention_map(v), cu, out, np.float32(hd ** -0.5 * math.log2(math.e))),
           shared_mem=old_smem(hd))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision-attention-grid-ab-h200.json"))
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
        fa = lambda: run_old(a.old, q, k, v, cu, length)  # noqa: E731
        fb = lambda: vision_attention_cuda(q, k, v, cu, length)  # noqa: E731
        ref32 = torch.stack([F.scaled_dot_product_attention(*(x[:, i].float() for x in (qs, ks, vs))) for i in range(h)], 1)
        ref32 = ref32.transpose(1, 2).reshape(n, h, hd)  # heads one at a time: [segments, tokens, hd] each
        err = [((f().float() - ref).norm() / ref.norm()).item() for f in (fa, fb)]
        err32 = [((x - ref32).norm() / ref32.norm()).item() for x in (fa().float(), fb().float(), ref)]
        ta, tb = [], []
        for _ in range(a.rounds):
            ta.append(timed(fa))
            tb.append(timed(fb))
        ma, mb = statistics.median(ta), statistics.median(tb)
        blocks = math.ceil(length / ATTN_ROWS) * segs * h
        shape = f"{segs}x{length}x{h}x{hd}"
        rows.append({"shape": shape, "blocks": blocks, "ms_old": round(ma, 4), "ms_new": round(mb, 4),
                     "new_over_old": round(mb / ma, 3), "rounds_old": [round(x, 4) for x in ta],
                     "rounds_new": [round(x, 4) for x in tb], "rel_err_vs_cudnn_old": float(f"{err[0]:.2e}"),
                     "rel_err_vs_cudnn_new": float(f"{err[1]:.2e}"), "rel_err_vs_fp32_old": float(f"{err32[0]:.2e}"),
                     "rel_err_vs_fp32_new": float(f"{err32[1]:.2e}"), "rel_err_vs_fp32_cudnn": float(f"{err32[2]:.2e}")})
        print(f"{shape} ({blocks} blocks): old {ma:.4f} ms, new {mb:.4f} ms ({mb / ma:.3f}x); "
              f"error vs cuDNN {err[0]:.1e} / {err[1]:.1e}, vs fp32 {err32[0]:.1e} / {err32[1]:.1e} (cuDNN {err32[2]:.1e})")
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
