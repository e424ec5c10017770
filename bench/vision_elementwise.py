"""The vision tower's rotary and residual add + LayerNorm kernels at the 27 x 1152 tower's shapes (one 1024 x 1024
image: 4,096 patches; 32 frames of 720 x 1280: 46,080), against the copy floor of the bytes each must move:
the shipped rotary at each HG (q / k heads a thread, one read of cos / sin for them; "shipped": the launcher's
choice) and bench/experiments/vision_rotary_vecs.cu at each VECS (vectors a thread, one head each, cos / sin read
for every head: VECS 1 is the kernel before HG), every one checked bit for bit against the reference.
CUDA-graph replays, median ms. Writes JSON.

    python3 bench/vision_elementwise.py [--vecs 1,2,4,8] [--heads 1,2,4,8] [--out bench/results/vision-rotary-vecs-h200.json]
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.cuda_build import get_function, launch
from qwen35_fast.kernels.vision import launch as vl
from qwen35_fast.kernels.vision.reference import vision_rotary_ref

from gdn import bench_ms, ceilings, graph_of

DEV = "cuda"
H, HD, D = 16, 72, 1152
SRC_VECS = Path(__file__).parent / "experiments" / "vision_rotary_vecs.cu"


def _rotary_run(qkv, cos, sin, src, name, defines, units, per_block):
    """A call of a rotary kernel built from `src` with `defines` besides the tower's shape, launched as the shipped
    one is: (units + per_block - 1) // per_block blocks of ROTARY_THREADS."""
    n = qkv.shape[0]
    out = torch.empty(2, n, H, HD, dtype=qkv.dtype, device=qkv.device)
    fn = get_function(src, name, qkv.device, {"HEAD_DIM": HD, "HEADS": H, "IN_T": 2, **defines})

    def run():
        launch(fn, ((units + per_block - 1) // per_block, 1, 1), (vl.ROTARY_THREADS, 1, 1),
               (qkv, cos, sin, out, np.int64(n)))
        return out
    return run


def rotary_at(qkv, cos, sin, vecs):
    """The experiment's rotary with VECS = vecs vectors a thread."""
    return _rotary_run(qkv, cos, sin, SRC_VECS, "vision_rotary_vecs", {"VECS": vecs},
                       qkv.shape[0] * 2 * H * (HD // 8), vl.ROTARY_THREADS * vecs)


def rotary_heads_at(qkv, cos, sin, hg):
    """The shipped rotary with HG = hg heads a thread."""
    return _rotary_run(qkv, cos, sin, vl.ROTARY_SRC, "vision_rotary", {"HG": hg},
                       qkv.shape[0] * (2 * H // hg) * (HD // 8), vl.ROTARY_THREADS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vecs", default="1,2,4,8")
    ap.add_argument("--heads", default="1,2,4,8")
    ap.add_argument("--out", default="bench/results/vision-rotary-vecs-h200.json")
    a = ap.parse_args()
    bw, _ = ceilings()
    rows = []
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    for name, n in (("1x1024x1024", 4096), ("4x1024x1024", 16384), ("video 32x720x1280", 46080)):
        g = torch.Generator(device=DEV).manual_seed(n)
        qkv = torch.randn(n, 3, H, HD, device=DEV, dtype=torch.bfloat16, generator=g)
        ang = torch.rand(n, HD, device=DEV, generator=g) * 6.28
        cos, sin = ang.cos(), ang.sin()
        want = vision_rotary_ref(qkv, cos, sin)
        floor = (2 * 2 * n * H * HD * 2 + 2 * n * HD * 4) / bw * 1e3  # q, k in and out (bf16), cos / sin
        variants = [("shipped", None, lambda: vl.vision_rotary_cuda(qkv, cos, sin))]
        variants += [("vecs", int(v), rotary_at(qkv, cos, sin, int(v))) for v in a.vecs.split(",") if v]
        variants += [("heads", int(v), rotary_heads_at(qkv, cos, sin, int(v))) for v in a.heads.split(",") if v]
        for kind, k, run in variants:
            out = run()
            exact = bool(torch.equal(out, want))
            ms = bench_ms(graph_of(run).replay)
            rows.append({"kernel": "rotary", "input": name, "tokens": n, "variant": kind, "per_thread": k, "ms": round(ms, 5),
                         "floor_ms": round(floor, 5), "bit_exact": exact})
            print(f"rotary {name} {kind} {k}: {ms * 1e3:.1f} us, floor {floor * 1e3:.1f} us "
                  f"({floor / ms:.0%}), bit exact {exact}")
        x, y = (torch.randn(n, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
        w, b = (torch.randn(D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
        ms = bench_ms(graph_of(lambda: vl.add_layer_norm_cuda(x, y, w, b, 1e-6)).replay)
        floor = 4 * n * D * 2 / bw * 1e3
        rows.append({"kernel": "add_layer_norm", "input": name, "tokens": n, "ms": round(ms, 5),
                     "floor_ms": round(floor, 5)})
        print(f"add_layer_norm {name}: {ms * 1e3:.1f} us, floor {floor * 1e3:.1f} us ({floor / ms:.0%})")
    out = {"device": torch.cuda.get_device_name(), "copy_tb_s": round(bw / 1e12, 3), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
