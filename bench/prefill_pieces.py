"""A long prompt read in pieces of PREFILL_PIECE tokens against one pass over it: wall ms and peak device memory
of the prefill (9B-shaped model, random weights, bf16, the kernels), and how far the pieces' logits are from one
pass's. Writes bench/results/prefill-pieces-h200.json.

    python bench/prefill_pieces.py [--tokens 16384 32768 65536] [--layers 32]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime.model import Qwen35Model

from e2e import nine_b, random_weights_


def run(model: Qwen35Model, ids: torch.Tensor, piece: int) -> tuple[float, float, torch.Tensor]:
    """(wall ms, peak GiB above what was allocated before, logits) of one prefill of ids in pieces of `piece`."""
    model_mod.PREFILL_PIECE = piece
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    cache = model.new_cache(1, ids.shape[1])
    logits = model.forward_prefill(ids, cache)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del cache
    return ms, peak, logits.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[16384, 32768, 65536])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/prefill-pieces-h200.json")
    a = ap.parse_args()
    default_piece = model_mod.PREFILL_PIECE
    model = Qwen35Model(nine_b(a.layers), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    model.set_backend("cuda")
    model.setup_kv(int(1.2 * max(a.tokens)) * 32 * 1024 + (1 << 30))  # K/V for the longest prompt, made once
    rows = []
    for n in a.tokens:
        ids = torch.randint(0, 248000, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
        runs = {"pieces": default_piece, "one pass": n}
        for piece in runs.values():  # warm-up: kernels built, workspaces made
            run(model, ids[:, :min(n, 2 * default_piece)], piece)
        got = {k: [] for k in runs}
        for r in range(a.reps):
            for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):  # in turn, each first every other round
                got[k].append(run(model, ids, runs[k]))
        med = {k: sorted(v, key=lambda x: x[0])[len(v) // 2] for k, v in got.items()}
        err = float((med["pieces"][2] - med["one pass"][2]).norm() / med["one pass"][2].norm())
        same = int(med["pieces"][2].argmax()) == int(med["one pass"][2].argmax())
        row = {"tokens": n, "piece": default_piece, "ms_pieces": round(med["pieces"][0], 1),
               "ms_one_pass": round(med["one pass"][0], 1), "peak_gib_pieces": round(med["pieces"][1], 2),
               "peak_gib_one_pass": round(med["one pass"][1], 2), "logits_rel_err": err, "same_argmax": same}
        rows.append(row)
        print(row)
    model_mod.PREFILL_PIECE = default_piece
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
           "model": f"Qwen3.5-9B-shaped, {a.layers} layers, random weights, bfloat16, kernels", "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
