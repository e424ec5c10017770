"""Where the vision tower's time goes: the 27x1152 tower (random weights, bf16) on one 1024x1024 image,
timed eager and replayed as a CUDA graph (the gap is launch overhead), the attention's SDPA backends on
its shape, and the CUDA kernels by total time under torch.profiler. Development only.

    python3 bench/vision_profile.py [--rows 20] [--side 1024] [--backend auto|cuda|torch]

--backend picks the kernel backend as the text model does (default auto: the CUDA kernels for the rotary
and the LayerNorms; torch: the PyTorch references, the tower as it was before them).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast import kernels
from qwen35_fast.runtime.media import Preprocessing, preprocess_images
from qwen35_fast.runtime.vision import VisionConfig, VisionTower

from e2e_profile import kernel_table
from vision import TOWER, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--side", type=int, default=1024)
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
    img = torch.rand(1, a.side, a.side, 3, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    item = preprocess_images(img, Preprocessing())[0]
    pixels, plan = item.pixels.to(torch.bfloat16), tower.plan([item.grid])
    print(f"grid {item.grid}: {plan.n_patches} patches, floor at 750 TFLOP/s "
          f"{tower.flops([item.grid]) / 750e12 * 1e3:.2f} ms")
    with torch.inference_mode():
        print(f"eager: {timed(lambda: tower(pixels, plan, backend=be), 10):.2f} ms")
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
        n, h, d = plan.n_patches, vc.num_heads, vc.head_dim
        q, k, v = (torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for sdpa in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(sdpa):
                    ms = timed(lambda: F.scaled_dot_product_attention(q, k, v), 10)
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
            ms = timed(fn, 10)
            k_in = vc.intermediate_size if name == "fc2" else vc.hidden_size
            w = fn().shape[1]
            print(f"linear {name} [{n}x{k_in}]x[{k_in}x{w}]: {ms:.3f} ms, "
                  f"{2 * n * k_in * w / ms / 1e9:.0f} TFLOP/s")
        kernel_table(lambda: tower(pixels, plan, backend=be), a.rows)


if __name__ == "__main__":
    main()
