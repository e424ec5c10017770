"""A cold image prompt with the vision tower run eagerly against replayed from its CUDA graph (the image size
repeats, as when captioning a batch): bench/prefix_reuse.py's model and first question (9B-shaped, 32 layers,
random weights, 200-token system prompt, one 1024 x 1024 image, 50-token question), the prefix cache cleared
before each call, wall ms of `reps` interleaved pairs. Writes `results/tower-graph-ab-h200.json`.

    python3 bench/tower_graph_ab.py [--reps 9] [--out PATH]
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime.multimodal import prefill_multimodal

from prefix_reuse import build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tower-graph-ab-h200.json"))
    a = ap.parse_args()
    model, system, questions, image = build(32, smoke=False)

    def cold(mode: str) -> tuple[float, float]:
        os.environ["QWEN35_CUDA_GRAPHS"] = "0" if mode == "eager" else "1"  # read at each tower call
        model.kv.pool.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        pf = prefill_multimodal(model, questions[0], images=image, system_prompt=system)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000, pf.vision.vision_ms

    for mode in ("eager", "graph") * 2:  # warm both; the second graph call in a row captures
        cold(mode)
        cold(mode)
    res: dict = {"eager": [], "graph": []}
    for _ in range(a.reps):
        for mode in res:
            res[mode].append(cold(mode))
    out = {"what": "cold image prompt (bench/prefix_reuse.py's first question: 200-token system prompt, one "
                   "1024x1024 image, 50-token question; 9B-shaped, 32 layers, random weights), wall ms, the prefix "
                   f"cache cleared before each; the tower eager vs replayed from its CUDA graph, {a.reps} "
                   "interleaved pairs",
           "gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu()}
    for mode, v in res.items():
        out[mode] = {"wall_ms": [round(w, 2) for w, _ in v], "median_ms": round(statistics.median(w for w, _ in v), 2),
                     "vision_ms_median": round(statistics.median(m for _, m in v), 2)}
    print(json.dumps(out, indent=1))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
