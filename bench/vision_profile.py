"""Where the vision tower's time goes: the 27x1152 tower (random weights, bf16) on one 1024x1024 image,
timed eager and replayed as a CUDA graph (the gap is launch overhead), a call with a fresh plan split into
the host's time to plan, the host's time to queue the forward and the wall time, the costliest host functions
of the forward (cProfile, by own and by cumulative time), the attention's SDPA backends on its shape, and the
CUDA kernels by total time under torch.profiler. Development only.

    python3 bench/vision_profile.py [--rows 20] [--side 1024] [--images 1] [--video] [--backend auto|cuda|torch]

--images N: N images of the side in one call; --video: the 32 frames of 720 x 1280 of bench/vision.py instead
(grid 16 x 40 x 72; no graph replay, no SDPA or linear timings).

--backend picks the kernel backend as the text model does (default auto: the CUDA kernels for the rotary
and the LayerNorms; torch: the PyTorch references, the tower as it was before them).
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# GPU ms a call back to back between two events (timed one call at a time with a synchronisation after each,
# the tower's fc1 / fc2 GEMMs took ~1.7x their time inside the tower)
from vision_attention_variants import timed as back_to_back_ms

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast import kernels
from qwen35_fast.runtime.media import Preprocessing, preprocess_images
from qwen35_fast.runtime.vision import VisionConfig, VisionTower
from qwen35_fast.runtime.vision import plan as vision_plan

from e2e_profile import kernel_table
from vision import TOWER, timed


def fresh_call_parts(tower, pixels, grids, be, reps: int = 10) -> None:
    """Median over reps calls with a fresh plan (the GPU idle at the start of each): host ms to plan, host ms to
    queue the forward, and the wall time until the GPU is done."""
    parts = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = vision_plan(tower.config, grids, tower.device)
        t1 = time.perf_counter()
        tower(pixels, p, backend=be)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        parts.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t0) * 1e3))
    plan_ms, queue_ms, wall_ms = (sorted(c)[len(c) // 2] for c in zip(*parts[1:]))
    print(f"fresh plan: plan {plan_ms:.2f} ms host, forward queued in {queue_ms:.2f} ms host, wall {wall_ms:.2f} ms")


def host_profile(fn, rows: int, calls: int = 5) -> None:
    """cProfile of `calls` calls of fn: the `rows` functions of most own time, then of most cumulative time."""
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    for sort in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(rows)
        print(f"cProfile, {calls} calls by {sort} (times are totals over them):")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--video", action="store_true")
    ap.add_argument("--host-rows", type=int, default=25)
    ap.add_argument("--backend", default="auto", choices=kernels.BACKENDS)
    a = ap.parse_args()
    dev = torch.device("cuda")
    be = kernels.select_backend(a.backend, dev, torch.bfloat16)
    print(f"backend: {be.reason}")
    vc = VisionConfig(**TOWER, out_hidden_size=4096)
    tower = VisionTower(vc, torch.bfloat16, dev)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    if a.video:
        grids = [(16, 40, 72)]
    else:
        img = torch.rand(1, a.side, a.side, 3, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
        grids = [preprocess_images(img, Preprocessing())[0].grid] * a.images
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, vc.patch_dim, device=dev, dtype=torch.bfloat16)
    plan = tower.plan(grids)
    print(f"grids {grids}: {plan.n_patches} patches, floor at 750 TFLOP/s {tower.flops(grids) / 750e12 * 1e3:.2f} ms")
    with torch.inference_mode():
        print(f"eager: {timed(lambda: tower(pixels, plan, backend=be), 10):.2f} ms")
        fresh_call_parts(tower, pixels, grids, be)
        host_profile(lambda: tower(pixels, vision_plan(vc, grids, dev), backend=be), a.host_rows)
        if a.video or a.images > 1:
            kernel_table(lambda: tower(pixels, plan, backend=be), a.rows)
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            tower(pixels, plan, backend=be)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tower(pixels, plan, backend=be)
        print(f"graph replay: {timed(g.replay, 10):.2f} ms")
        del g
        h, d = vc.num_heads, vc.head_dim
        q, k, v = (torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for sdpa in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(sdpa):
                    ms = back_to_back_ms(lambda: F.scaled_dot_product_attention(q, k, v), 50)
                print(f"sdpa {sdpa.name} [1,{h},{n},{d}]: {ms:.3f} ms x {vc.depth} layers = {ms * vc.depth:.2f} ms")
            except RuntimeError as e:
                print(f"sdpa {sdpa.name}: {str(e).splitlines()[0][:120]}")
        x = torch.randn(n, vc.hidden_size, device=dev, dtype=torch.bfloat16)
        blk = tower.blocks[0]
        for name, fn in (("qkv", lambda: F.linear(x, blk.qkv_w, blk.qkv_b)),
                         ("proj", lambda: F.linear(x, blk.proj_w, blk.proj_b)),
                         ("fc1", lambda: F.linear(x, blk.fc1_w, blk.fc1_b)),
                         ("fc2", lambda: F.linear(torch.empty(n, vc.intermediate_size, device=dev,
                                                              dtype=torch.bfloat16), blk.fc2_w, blk.fc2_b))):
            ms = back_to_back_ms(fn, 50)
            k_in = vc.intermediate_size if name == "fc2" else vc.hidden_size
            w = fn().shape[1]
            print(f"linear {name} [{n}x{k_in}]x[{k_in}x{w}]: {ms:.3f} ms, "
                  f"{2 * n * k_in * w / ms / 1e9:.0f} TFLOP/s")
        kernel_table(lambda: tower(pixels, plan, backend=be), a.rows)


if __name__ == "__main__":
    main()
