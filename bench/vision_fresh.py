"""Why a tower call with a fresh plan (one image, 1024 x 1024, 27 x 1152) takes longer inside bench/vision.py than
alone: the same call timed back to back, after a call of transformers' tower each time (as bench/vision.py's
rounds take them), and so with Python's garbage collector off; per variant the median wall ms, the host ms to
queue the forward, and per call the device allocations (cudaMalloc) and collections seen.

    python3 bench/vision_fresh.py [--reps 10]
"""
import argparse
import gc
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast import kernels
from qwen35_fast.runtime.media import preprocess_images
from qwen35_fast.runtime.vision import VisionConfig, VisionTower, _targets
from qwen35_fast.runtime.vision import plan as vision_plan

from vision import OUT_HIDDEN, TOWER, merged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(dev):
        ref = Qwen3_5VisionModel(Qwen3_5VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN)).to(torch.bfloat16).eval()
    ours = VisionTower(VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN), torch.bfloat16, dev)
    sd = ref.state_dict()
    with torch.no_grad():
        for k, p in _targets(ours).items():
            p.copy_(sd[k].reshape(p.shape))
    be = kernels.select_backend("auto", dev, torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    (item,) = preprocess_images(torch.rand(1, 1024, 1024, 3, device=dev, generator=g))
    pixels, grids = item.pixels.to(torch.bfloat16), [item.grid]
    grid_t = torch.tensor(grids, device=dev)
    collections = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))

    def fresh():
        t0 = time.perf_counter()
        ours(pixels, vision_plan(ours.config, grids, dev), backend=be)
        return (time.perf_counter() - t0) * 1e3

    def variant(name, between=None, gc_off=False, mode=torch.inference_mode):
        walls, queues, mallocs, gcs = [], [], [], []
        with mode():
            for r in range(args.reps + 2):
                if between is not None:
                    between()
                torch.cuda.synchronize()
                if gc_off:
                    gc.disable()
                n0, c0 = torch.cuda.memory_stats().get("num_device_alloc", 0), len(collections)
                t0 = time.perf_counter()
                q = fresh()
                torch.cuda.synchronize()
                w = (time.perf_counter() - t0) * 1e3
                gc.enable()
                if r >= 2:
                    walls.append(w)
                    queues.append(q)
                    mallocs.append(torch.cuda.memory_stats().get("num_device_alloc", 0) - n0)
                    gcs.append(collections[c0:])
        med = sorted(walls)[len(walls) // 2]
        print(f"{name}: wall {med:.2f} ms (min {min(walls):.2f}, max {max(walls):.2f}), host queue "
              f"{sorted(queues)[len(queues) // 2]:.2f} ms; cudaMalloc per call {mallocs}; collections {gcs}")

    variant("back to back")
    variant("back to back, no_grad", mode=torch.no_grad)
    variant("after transformers' tower", between=lambda: merged(ref(pixels, grid_thw=grid_t)))
    variant("after transformers' tower, gc off", between=lambda: merged(ref(pixels, grid_thw=grid_t)), gc_off=True)
    variant("back to back again")


if __name__ == "__main__":
    main()
