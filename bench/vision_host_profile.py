"""Host time of the vision tower's eager call (27 x 1152, random weights, one 1024 x 1024 image, a fresh plan
each call, the CUDA kernels): the ms the host takes to queue the forward (to its return, before the GPU is
waited for) and the wall ms, medians over --reps calls; then cProfile over --prof calls, the functions by their
own time and by cumulative time. Prints; --out writes the text too.

    python3 bench/vision_host_profile.py [--reps 10] [--prof 5] [--out PATH]
"""
import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast import kernels
from qwen35_fast.runtime.vision import VisionConfig, VisionTower
from qwen35_fast.runtime.vision import plan as vision_plan

from vision import DEV, OUT_HIDDEN, TOWER, random_weights_


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prof", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    vc = VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN)
    torch.manual_seed(0)
    tower = random_weights_(VisionTower(vc, torch.bfloat16, DEV))
    be = kernels.select_backend("auto", DEV, torch.bfloat16)
    grids = [(1, 64, 64)]
    px = torch.randn(4096, vc.patch_dim, device=DEV).bfloat16()

    def call():
        return tower(px, vision_plan(vc, grids, DEV), backend=be)
    lines = [f"{torch.cuda.get_device_name()} / {host_cpu()} / torch {torch.__version__}"]
    with torch.inference_mode():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        queue, wall = [], []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            queue.append((t1 - t0) * 1000)
            wall.append((time.perf_counter() - t0) * 1000)
        lines.append(f"host queue {sorted(queue)[len(queue) // 2]:.2f} ms, wall {sorted(wall)[len(wall) // 2]:.2f} ms "
                     f"(medians of {a.reps})")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.prof):
            call()
        prof.disable()
        torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(40)
        lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
