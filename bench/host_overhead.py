"""Host time per call of each operation of a vision-tower block (27 x 1152, one 1024 x 1024 image) and of
a 9B text layer's prefill (1,300 tokens), against the GPU time of the same call. A call is launched `reps`
times back to back without waiting (the GPU falls behind, so the host's time is its own) and then timed on
the GPU alone. Where host > GPU over a whole block, a cold prompt waits for Python, not for the GPU.
Development only.

    python3 bench/host_overhead.py [--reps 200] [--profile "add_rms_norm,gdn_chunk_prefill"] [--launch-parts | --vision-parts]

Where an operation's host time is at least its GPU time, the two columns agree (the GPU waits for each
launch): the host time is the first column, the GPU's is less. --profile runs cProfile over `reps` calls of
each named operation and prints its costliest functions.
"""
import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch
import torch.nn.functional as F

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast import kernels


def host_and_gpu_us(fn, reps: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return host, a.elapsed_time(b) / reps * 1e3


def launch_parts(reps: int) -> None:
    """Host us of each step of one launch through our path (add_rms_norm at a 1,300-token text layer)."""
    from qwen35_fast.kernels import cuda_build as cb
    from qwen35_fast.kernels.rms_norm import launch as L
    dev, bf = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16  # (indexed, as a tensor's device)
    x, w = torch.randn(1, 1300, 4096, device=dev, dtype=bf), torch.ones(4096, device=dev, dtype=bf)
    y, s = torch.empty_like(x), torch.empty_like(x)
    defines = {"DIM": 4096, "IN_T": 2, "W_T": 2, "GATED": 0, "ROPE": 0, "RES": 1, "TPR": L._tpr(4096)}
    fn = cb.get_function(L.SRC, "rms_norm_fwd", dev, defines)
    xv = L._rows(x)
    i64 = np.int64
    args = (xv, xv, w, y, i64(1300), np.int32(1), i64(4096), i64(4096), i64(4096), i64(4096), np.float32(1e-6),
            None, None, i64(0), x, s)
    grid, block = (1300 // 8 + 1, 1, 1), (256, 1, 1)
    p = cb.pack_params(args)
    kern = fn.kernel
    cu = cb._driver_launch()
    _, stream = cb._current_stream()
    parts = [
        ("cuLaunchKernel through ctypes (packed before)", lambda: cu(kern.ptr, *grid, *block, 0, stream.ptr, p.ptrs, None)),
        ("pack_params (16 arguments)", lambda: cb.pack_params(args)),
        ("_current_stream", cb._current_stream),
        ("get_function (cached)", lambda: cb.get_function(L.SRC, "rms_norm_fwd", dev, defines)),
        ("torch.empty [1, 1300, 4096]", lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device)),
        ("numpy int64 x 6", lambda: (i64(1), i64(2), i64(3), i64(4), i64(5), i64(6))),
        ("_rows", lambda: L._rows(x)),
        ("launch (all of it)", lambda: cb.launch(fn, grid, block, args)),
        ("add_rms_norm_cuda", lambda: L.add_rms_norm_cuda(x, x, w, 1e-6)),
        ("kernels.add_rms_norm", lambda: kernels.add_rms_norm(x, x, w, 1e-6, backend=kernels.select_backend("auto", dev, bf))),
        ("x + x (torch)", lambda: x + x),
    ]
    print("== one launch, host us per step")
    for name, f in parts:
        h, _ = host_and_gpu_us(f, reps)
        print(f"  {h:8.2f}  {name}")


def vision_parts(reps: int) -> None:
    """Host and GPU us of each level of the vision tower's launches (one 1024 x 1024 image, a block of the
    27 x 1152 tower's shape): the kernels' entry points, the launchers under them, their steps; and one whole
    block. Where the two columns agree, the GPU waited for the host (the host's time is the first)."""
    from qwen35_fast.kernels import cuda_build as cb
    from qwen35_fast.kernels.vision import launch as V
    from qwen35_fast.runtime.vision import VisionConfig, VisionTower
    from qwen35_fast.runtime.vision import plan as vision_plan

    from vision import random_weights_
    dev, bf = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16  # (indexed, as a tensor's device)
    be = kernels.select_backend("auto", dev, bf)
    vc = VisionConfig(depth=1, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096)
    tower = random_weights_(VisionTower(vc, bf, dev))
    n, d, H, hd = 4096, 1152, 16, 72
    pl = vision_plan(vc, [(1, 64, 64)], dev)
    x, y, w, b = (torch.randn(*s, device=dev, dtype=bf) for s in ((n, d), (n, d), (d,), (d,)))
    qkv = torch.randn(n, 3, H, hd, device=dev, dtype=bf)
    cos, sin = torch.randn(n, hd, device=dev), torch.randn(n, hd, device=dev)
    q, k = V.vision_rotary_cuda(qkv, cos, sin).unbind(0)
    v = qkv[:, 2]
    cu, sms = pl.cu_seqlens, cb.card_of(dev).sms
    blk = tower.blocks[0]
    ours: list = []  # the tower's answer of whether our attention takes its q, k, v (asked at its first layer)
    parts = [
        ("kernels.add_layer_norm", lambda: kernels.add_layer_norm(x, y, w, b, 1e-6, backend=be)),
        ("add_layer_norm_cuda", lambda: V.add_layer_norm_cuda(x, y, w, b, 1e-6)),
        ("_layer_norm", lambda: V._layer_norm(x, y, w, b, 1e-6)),
        ("norm_takes", lambda: V.norm_takes(x, y, w, b)),
        ("kernels.vision_rotary", lambda: kernels.vision_rotary(qkv, cos, sin, backend=be)),
        ("vision_rotary_cuda", lambda: V.vision_rotary_cuda(qkv, cos, sin)),
        ("kernels.vision_attention_takes", lambda: kernels.vision_attention_takes(q, k, v, cu, backend=be)),
        ("kernels.vision_attention", lambda: kernels.vision_attention(q, k, v, cu, n, backend=be)),
        ("vision_attention_cuda", lambda: V.vision_attention_cuda(q, k, v, cu, n)),
        ("attention_takes", lambda: V.attention_takes(q, k, v, cu)),
        ("attention_map x 3", lambda: [V.attention_map(t) for t in (q, k, v)]),
        ("stream_flags", lambda: cb.stream_flags(dev, sms)),
        ("torch.empty partials", lambda: torch.empty(sms * (hd // 2 + 4) * V.ATTN_CONSUMER_THREADS,
                                                     dtype=torch.float32, device=dev)),
        ("card_of", lambda: cb.card_of(dev)),
        ("get_function (attention)", lambda: cb.get_function(V.ATTN_SRC, "vision_attention", dev,
                                                              {"HEAD_DIM": hd, "HEADS": H})),
        ("tower._attention", lambda: tower._attention(blk, x, cos, sin, pl, be, ours)),
        ("tower._mlp", lambda: tower._mlp(blk, x)),
    ]

    def block():
        kernels.add_layer_norm(x, tower._attention(blk, x, cos, sin, pl, be, ours), w, b, 1e-6, backend=be)
        kernels.add_layer_norm(x, tower._mlp(blk, x), w, b, 1e-6, backend=be)
    print("== vision tower launches, us per call, host / GPU")
    with torch.inference_mode():
        for name, f in parts:
            h, g = host_and_gpu_us(f, reps)
            print(f"  {h:8.2f} {g:8.2f}  {name}")
        # a block is 8 launches: reps of them would fill the driver's launch queue, which then holds the host back
        h, g = host_and_gpu_us(block, max(5, reps // 10))
        print(f"  {h:8.2f} {g:8.2f}  a block (attention, MLP, two add_layer_norm)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", default="", help="comma-separated operation names to profile")
    ap.add_argument("--launch-parts", action="store_true", help="only the steps of one launch")
    ap.add_argument("--vision-parts", action="store_true", help="only the levels of the vision tower's launches")
    args = ap.parse_args()
    if args.launch_parts:
        return launch_parts(args.reps)
    if args.vision_parts:
        return vision_parts(args.reps)
    dev, bf = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16  # (indexed, as a tensor's device)
    be = kernels.select_backend("auto", dev, bf)
    r = lambda *s: torch.randn(*s, device=dev, dtype=bf) * 0.05  # noqa: E731

    n, d, i, H, hd = 4096, 1152, 4304, 16, 72
    x, y = r(n, d), r(n, d)
    qkv_w, qkv_b, proj_w, proj_b = r(3 * d, d), r(3 * d), r(d, d), r(d)
    fc1_w, fc1_b, fc2_w, fc2_b, lw, lb = r(i, d), r(i), r(d, i), r(d), r(d), r(d)
    qkv = F.linear(x, qkv_w, qkv_b).view(n, 3, H, hd)
    cos, sin = torch.randn(n, hd, device=dev), torch.randn(n, hd, device=dev)
    q, k = kernels.vision_rotary(qkv, cos, sin, backend=be).unbind(0)
    v = qkv[:, 2]
    h1 = r(n, i)
    tower = [
        ("F.linear qkv", lambda: F.linear(x, qkv_w, qkv_b)),
        ("vision_rotary", lambda: kernels.vision_rotary(qkv, cos, sin, backend=be)),
        ("SDPA (views as the tower passes them)", lambda: F.scaled_dot_product_attention(
            *(t.view(1, n, H, hd).transpose(1, 2) for t in (q, k, v)))),
        ("F.linear proj", lambda: F.linear(x, proj_w, proj_b)),
        ("add_layer_norm", lambda: kernels.add_layer_norm(x, y, lw, lb, 1e-6, backend=be)),
        ("_addmm_activation fc1 + gelu", lambda: torch._addmm_activation(fc1_b, x, fc1_w.t(), use_gelu=True)),
        ("F.linear fc2", lambda: F.linear(h1, fc2_w, fc2_b)),
    ]

    T, D, C, hv = 1300, 4096, 8192, 32
    xt = r(1, T, D)
    in_w = r(C + 4096 + 2 * hv, D)
    mixed = r(1, T, C)
    conv_w = r(C, 4)
    qh, kh = r(1, T, 16, 128), r(1, T, 16, 128)
    vh, a_, b_ = r(1, T, hv, 128), r(1, T, hv), r(1, T, hv)
    A_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
    h0 = torch.zeros(1, hv, 128, 128, device=dev)
    o, z = r(1, T, hv, 128), r(1, T, hv, 128)
    nw, dw, out_w, gu_w, dn_w = r(128), r(D), r(D, 4096), r(2 * 12288, D), r(D, 12288)
    gu = r(1, T, 2 * 12288)
    text = [
        ("F.linear in_proj", lambda: F.linear(xt, in_w)),
        ("causal_conv1d_prefill", lambda: kernels.causal_conv1d_prefill(mixed, conv_w, initial_state=None, backend=be)),
        ("gdn_chunk_prefill", lambda: kernels.gdn_chunk_prefill(qh, kh, vh, a_, b_, A_log, dt_bias,
                                                                initial_state=h0, backend=be)),
        ("gated_rms_norm", lambda: kernels.gated_rms_norm(o, z, nw, 1e-6, backend=be)),
        ("F.linear out_proj", lambda: F.linear(xt, out_w)),
        ("add_rms_norm", lambda: kernels.add_rms_norm(xt, xt, dw, 1e-6, backend=be)),
        ("F.linear gate_up", lambda: F.linear(xt, gu_w)),
        ("silu_mul", lambda: kernels.silu_mul(gu, backend=be)),
        ("F.linear down", lambda: F.linear(gu[..., :12288], dn_w)),
        ("torch.cat of two [1, T, 8192]", lambda: torch.cat([mixed, mixed[:, :600]], dim=1)),
        ("torch.empty [1, T, 4096]", lambda: torch.empty(1, T, D, device=dev, dtype=bf)),
    ]
    for title, rows in (("vision block (4,096 patches)", tower), ("text layer (1,300 tokens)", text)):
        print(f"== {title}: us per call, host / GPU")
        th = tg = 0.0
        for name, fn in rows:
            h, g = host_and_gpu_us(fn, args.reps)
            th, tg = th + h, tg + g
            print(f"  {h:8.1f} {g:8.1f}  {name}")
        print(f"  {th:8.1f} {tg:8.1f}  sum")
    for name, fn in tower + text:
        if name in args.profile.split(","):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.reps):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
            print(f"== cProfile, {args.reps} calls of {name}")
            print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))


if __name__ == "__main__":
    main()
