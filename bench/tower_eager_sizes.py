"""The tower eager with a fresh plan, sizes alternating (1024 x 960 / 1024 x 992: 3,840 / 3,968 patches) against one
size repeated (3,840), wall ms (medians), the tensor maps encoded a call, and where the host's time goes
(cProfile of the alternating calls). What bench/vision.py's ours-bucket row calls ms_eager. GPU only.

    python3 bench/tower_eager_sizes.py [--reps 9]
"""
import argparse
import cProfile
import pstats
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast import kernels
from qwen35_fast.kernels import cuda_build
from qwen35_fast.runtime.vision import VisionConfig, VisionTower
from qwen35_fast.runtime.vision import plan as vision_plan

from vision import OUT_HIDDEN, TOWER, random_weights_


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    dev = torch.device("cuda")
    vc = VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN)
    tower = random_weights_(VisionTower(vc, torch.bfloat16, dev))
    be = kernels.select_backend("auto", dev, torch.bfloat16)
    sizes = [[(1, 64, 60)], [(1, 64, 62)]]
    px = [torch.randn(t * h * w, vc.patch_dim, device=dev).bfloat16() for [(t, h, w)] in sizes]
    encodes = []
    real = cuda_build.TensorMap.__init__

    def counted(self, *args, **kw):
        encodes.append(1)
        real(self, *args, **kw)
    cuda_build.TensorMap.__init__ = counted

    def call(i):
        return tower(px[i], vision_plan(vc, sizes[i], dev), backend=be)

    def wall(order):
        out = []
        for i in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(i)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) * 1000)
        return sorted(out)[len(out) // 2]
    with torch.inference_mode():
        for i in (0, 1, 0, 1):
            call(i)
        n = len(encodes)
        same, n0 = wall([0] * a.reps), len(encodes) - n
        alt, n1 = wall([0, 1] * a.reps), len(encodes) - n
        print(f"one size repeated: {same:.2f} ms ({n0 / a.reps:.1f} maps encoded a call)")
        print(f"sizes alternating: {alt:.2f} ms ({(n1 - n0) / (2 * a.reps):.1f} maps encoded a call)")
        prof = cProfile.Profile()
        prof.enable()
        wall([0, 1] * 3)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
