"""Where a bucket graph's replay spends its time (the 27 x 1152 tower, random weights, bf16, the CUDA kernels):
wall ms in turn of VisionTower.run on 4,096 patches repeating (its exact graph), run on 3,840 / 3,968 patches
in turn (the bucket graph of 4,096), the bucket graph called with a prebuilt padded plan (no host plan), its
bare replay, eager on the two sizes with kept plans (medians of --reps rounds); the host time of one padded
plan; and the profiler's GPU ms a replay of each kernel in the exact graph and in the bucket graph (holding the
plan of the size it replayed last). Writes JSON.

    python3 bench/tower_bucket_probe.py [--reps 15] [--out PATH]
"""
import argparse
import json
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast import kernels
from qwen35_fast.runtime.vision import VisionConfig, VisionTower
from qwen35_fast.runtime.vision import plan as vision_plan

from vision import DEV, OUT_HIDDEN, TOWER, random_weights_, timed_in_turn


def by_kernel(fn, reps=5) -> dict:
    """GPU ms a call of each kernel name over reps calls of fn (the profiler's CUDA time), largest first."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1000 / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return {k[:90]: round(v, 4) for k, v in sorted(rows, key=lambda r: -r[1])[:14]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tower-bucket-probe-h200.json"))
    a = ap.parse_args()
    vc = VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN)
    torch.manual_seed(0)
    tower = random_weights_(VisionTower(vc, torch.bfloat16, DEV))
    exact = random_weights_(VisionTower(vc, torch.bfloat16, DEV))
    be = kernels.select_backend("auto", DEV, torch.bfloat16)
    sizes = [[(1, 64, 60)], [(1, 64, 62)]]
    px = [torch.randn(t * h * w, vc.patch_dim, device=DEV).bfloat16() for [(t, h, w)] in sizes]
    big = [(1, 64, 64)]
    pxb = torch.randn(4096, vc.patch_dim, device=DEV).bfloat16()
    turn = {"k": 0}

    def alt():
        i = turn["k"] = 1 - turn["k"]
        return i
    with torch.inference_mode():
        for _ in range(3):
            tower.run(px[alt()], sizes[turn["k"]], backend=be)
            exact.run(pxb, big, backend=be)
        g = tower._graph
        assert g is not None and g.key[0] == "bucket", g and g.key
        padded = [vision_plan(vc, s, DEV, pad_to=g.key[1]) for s in sizes]
        kept = [tower.plan(s) for s in sizes]
        t0 = time.perf_counter()
        for _ in range(20):
            vision_plan(vc, sizes[0], DEV, pad_to=g.key[1])
        plan_ms = (time.perf_counter() - t0) * 1000 / 20
        fns = {
            "exact_graph_4096": lambda: exact.run(pxb, big, backend=be),
            "bucket_run_in_turn": lambda: tower.run(px[alt()], sizes[turn["k"]], backend=be),
            "bucket_prebuilt_plan": lambda: g(px[alt()], padded[turn["k"]]),
            "bucket_bare_replay": lambda: g.graph.replay(),
            "eager_kept_plan": lambda: tower(px[alt()], kept[turn["k"]], backend=be),
        }
        ms = timed_in_turn(fns, a.reps)
        assert tower._graph is g
        held = next(s for s, pp in zip(sizes, padded) if torch.equal(g.plan.cu_seqlens, pp.cu_seqlens))
        kernels_ms = {name: by_kernel(fn) for name, fn in (("exact", exact._graph.graph.replay),
                                                           ("bucket", g.graph.replay))}
    out = {"device": torch.cuda.get_device_name(), "host_cpu": host_cpu(), "torch": torch.__version__,
           "ms": {k: round(v, 3) for k, v in ms.items()}, "rounds": a.reps, "padded_plan_host_ms": round(plan_ms, 3),
           "profiled_bucket_replays_hold": held,
           "sizes": sizes, "bucket": list(g.key), "kernels_ms_per_replay": kernels_ms}
    print(json.dumps(out, indent=1))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
