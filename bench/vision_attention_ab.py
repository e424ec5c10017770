"""A / B of two versions of the vision attention (kernels/vision/attention.cu, the shipped one, is B): A is a former
source, launched as it was: with --waves the grid of one block per 192-row block of each (segment, head),
wave after wave (`git show ad70ee0:kernels/vision/attention.cu > old.cu`), else the shipped launcher's
persistent grid and parameters. Each call timed inside a CUDA graph (no host time), alternating rounds
(A B A B ..., so that clock drift falls on both), the median ms per shape, and each output's relative error
against cuDNN's and against fp32 attention: images and video slices of one length (SHAPES), then segments of
several lengths (RAGGED; --ragged-only: those alone). GPU only (sm_90a).

    python3 bench/vision_attention_ab.py old.cu [--waves | --a-maps 64,64,64] [--ragged-only] [--rounds 5] [--out PATH]
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
from vision_attention_variants import shape_inputs

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import TensorMap, get_function, launch
from qwen35_fast.kernels.vision import launch as vision_launch
from qwen35_fast.kernels.vision.launch import ATTN_ROWS, ATTN_THREADS, attention_map, vision_attention_cuda

SHAPES = [(1, 4096, 16, 72), (2, 4096, 16, 72), (4, 4096, 16, 72), (16, 3600, 16, 72), (1, 1024, 16, 72),
          (1, 4096, 16, 64), (1, 4096, 12, 64)]  # segments, tokens, heads, dim
# segments of several lengths, heads, dim: a bucket graph's images and their padding segment (runtime/vision.py
# graph_bucket), a large image beside small ones, images of a few sizes
RAGGED = [((3968, 128), 16, 72), ((3840, 256), 16, 72), ((4096, 256, 256), 16, 72), ((1024, 4096, 576), 16, 72),
          ((1920, 960), 16, 72)]


def ragged_inputs(lens, h, hd):
    """As shape_inputs for segments of these lengths: q, k, v, cu_seqlens, cuDNN's output and fp32 attention
    (each segment its own SDPA call)."""
    n = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(n + hd)
    qkv = torch.randn(n, 3, h, hd, device="cuda", generator=g).bfloat16()
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    cu = torch.tensor((0, *lens), device="cuda").cumsum(0).to(torch.int32)
    ref, ref32 = torch.empty(n, h, hd, device="cuda"), torch.empty(n, h, hd, device="cuda")
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        views = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]  # [1, h, length, hd]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref[a:b] = F.scaled_dot_product_attention(*views)[0].transpose(0, 1).float()
        ref32[a:b] = F.scaled_dot_product_attention(*(x.float() for x in views))[0].transpose(0, 1)
    return q, k, v, cu, ref, ref32


def cases(ragged_only=False):
    """(name, blocks, q, k, v, cu_seqlens, longest segment, cuDNN's output, fp32 attention) of each shape."""
    for segs, length, h, hd in [] if ragged_only else SHAPES:
        n = segs * length
        q, k, v, cu, (qs, ks, vs), ref = shape_inputs(segs, length, h, hd)
        ref32 = torch.stack([F.scaled_dot_product_attention(*(x[:, i].float() for x in (qs, ks, vs)))
                             for i in range(h)], 1)
        ref32 = ref32.transpose(1, 2).reshape(n, h, hd)  # heads one at a time: [segments, tokens, hd] each
        yield f"{segs}x{length}x{h}x{hd}", math.ceil(length / ATTN_ROWS) * segs * h, q, k, v, cu, length, ref, ref32
    for lens, h, hd in RAGGED:
        blocks = sum(math.ceil(n / ATTN_ROWS) for n in lens) * h
        q, k, v, cu, ref, ref32 = ragged_inputs(lens, h, hd)
        yield "+".join(map(str, lens)) + f"x{h}x{hd}", blocks, q, k, v, cu, max(lens), ref, ref32


def waves_smem(hd):
    qk_cb, v_cb = (2 * ((hd + 15) // 16) + 7) // 8, (hd + 63) // 64
    return (qk_cb * ATTN_ROWS + 2 * qk_cb * 128 + 2 * v_cb * 128) * 64 * 2 + 1024 + 9 * 8


def graph_ms(fn, calls=10, reps=10):
    """ms per call of fn, replayed from a CUDA graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (reps * calls)


def run_persistent(src, q, k, v, cu, length, smem_less=0, fill_flags=False, a_maps=None):
    """The shipped launcher with another source (smem_less: the bytes of dynamic shared memory it needs less;
    fill_flags: flags zeroed by a fill each call, for sources whose readers leave them set; a_maps: the tensor
    maps the source takes instead of the shipped launcher's, as the tokens of their boxes: q's, k's, then v's)."""
    shipped, smem, flags, go = (vision_launch.ATTN_SRC, vision_launch.attention_smem, vision_launch.stream_flags,
                                vision_launch.launch)
    vision_launch.ATTN_SRC, vision_launch.attention_smem = src, lambda hd: smem(hd) - smem_less
    if fill_flags:
        vision_launch.stream_flags = lambda device, n: torch.zeros(n, dtype=torch.int32, device=device)
    if a_maps:
        maps = tuple(attention_map(x, rows) for x, rows in zip((q, k) + (v,) * (len(a_maps) - 2), a_maps))
        vision_launch.launch = lambda fn, grid, block, args, **kw: go(
            fn, grid, block, maps + tuple(x for x in args if not isinstance(x, TensorMap)), **kw)
    try:
        return vision_attention_cuda(q, k, v, cu, length)
    finally:
        vision_launch.ATTN_SRC, vision_launch.attention_smem, vision_launch.stream_flags, vision_launch.launch = \
            shipped, smem, flags, go


def run_waves(src, q, k, v, cu, length):
    n, h, hd = q.shape
    fn = get_function(src, "vision_attention", q.device, {"HEAD_DIM": hd, "HEADS": h})
    out = torch.empty_like(q)
    launch(fn, (math.ceil(length / ATTN_ROWS), (cu.numel() - 1) * h, 1), (ATTN_THREADS, 1, 1),  # its grid and parameters
           (attention_map(q), attention_map(k), attention_map(v), cu, out, np.float32(hd ** -0.5 * math.log2(math.e))),
           shared_mem=waves_smem(hd))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("--waves", action="store_true", help="A launched as a wave-by-wave grid (before 1138890)")
    ap.add_argument("--smem-less", type=int, default=0, help="A's dynamic shared memory: the shipped one's less this")
    ap.add_argument("--fill-flags", action="store_true",
                    help="A's flags zeroed by a fill each call (sources whose readers leave them set)")
    ap.add_argument("--a-maps", type=lambda t: tuple(int(x) for x in t.split(",")),
                    help="the maps A takes, as their boxes' tokens: q's, k's, v's (64,64,64 before V's tail maps; "
                         "64,64,64,8,1 before the tile-high boxes)")
    ap.add_argument("--ragged-only", action="store_true", help="only the shapes of segments of several lengths")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision-attention-ab-h200.json"))
    a = ap.parse_args()
    rows = []
    for shape, blocks, q, k, v, cu, length, ref, ref32 in cases(a.ragged_only):
        fa = (lambda: run_waves(a.old, q, k, v, cu, length)) if a.waves else \
            (lambda: run_persistent(a.old, q, k, v, cu, length, a.smem_less, a.fill_flags, a.a_maps))
        fb = lambda: vision_attention_cuda(q, k, v, cu, length)  # noqa: E731
        err = [((f().float() - ref).norm() / ref.norm()).item() for f in (fa, fb)]
        err32 = [((x - ref32).norm() / ref32.norm()).item() for x in (fa().float(), fb().float(), ref)]
        ta, tb = [], []
        for _ in range(a.rounds):
            ta.append(graph_ms(fa))
            tb.append(graph_ms(fb))
        ma, mb = statistics.median(ta), statistics.median(tb)
        rows.append({"shape": shape, "blocks": blocks, "ms_old": round(ma, 4), "ms_new": round(mb, 4),
                     "new_over_old": round(mb / ma, 3), "rounds_old": [round(x, 4) for x in ta],
                     "rounds_new": [round(x, 4) for x in tb], "rel_err_vs_cudnn_old": float(f"{err[0]:.2e}"),
                     "rel_err_vs_cudnn_new": float(f"{err[1]:.2e}"), "rel_err_vs_fp32_old": float(f"{err32[0]:.2e}"),
                     "rel_err_vs_fp32_new": float(f"{err32[1]:.2e}"), "rel_err_vs_fp32_cudnn": float(f"{err32[2]:.2e}")})
        print(f"{shape} ({blocks} blocks): old {ma:.4f} ms, new {mb:.4f} ms ({mb / ma:.3f}x); "
              f"error vs cuDNN {err[0]:.1e} / {err[1]:.1e}, vs fp32 {err32[0]:.1e} / {err32[1]:.1e} (cuDNN {err32[2]:.1e})")
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "old": a.old.name,
                                       "old_grid": "waves" if a.waves else "persistent", "timing": "CUDA graph of 10 calls",
                                       "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
