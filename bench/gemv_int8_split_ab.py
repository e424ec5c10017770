"""Graph decode of int8 models under two rules for how many warps share a row group (kernels/gemv/launch.py
split_of): the launcher's own, and a candidate given as its two numbers (the fewest 16-byte pieces of an int8 row
a warp keeps, and how many full grids of warps the split row groups may take). Each product's choice under both
rules is listed, and decode tokens/s of each size's int8 model (bench/e2e.py's shapes, random weights quantized as
the loader does) measured in rounds that alternate the rules (a decode graph is captured per generate, so each
round runs the rule it names). Writes bench/results/gemv-int8-split-ab-<card>.json (or --out).
(results/gemv-int8-split-ab-h100-*.json compared the rule before, runs of 256 pieces for int8 rows, as "own" with
candidates of 64 pieces on 3 grids, 128 and 96 on one; 128 pieces, 2,048 weights as a 16-bit row's run, is the
launcher's rule now.)

    python3 bench/gemv_int8_split_ab.py [--models 9b,4b,2b,0.8b] [--min-run 64] [--grids 3] [--reps 3]
"""
import argparse
import json
from pathlib import Path

import torch
from gemv import SHAPES as PRODUCTS
from int8_weights import int8_twin

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.kernels.cuda_build import card_of
from qwen35_fast.kernels.gemv import launch
from qwen35_fast.runtime import SamplingParams, generate, prefill
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.tokenizer import load_tokenizer

from e2e import random_weights_, shaped
from prefix_reuse import words_for

OWN = launch.split_of


def candidate(min_run: int, grids: int):
    """split_of for int8 rows judged by (min_run pieces a warp, grids full grids of warps)."""
    def split_of(n_rows: int, k: int, sms: int) -> int:
        groups, pieces = -(-n_rows // launch.ROWS), k // 16
        for s in launch.SPLITS:
            if groups * s <= grids * sms * launch.BLOCKS_PER_SM * launch.WARPS and pieces // s >= min_run:
                return s
        return 1
    return split_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="9b,4b,2b,0.8b")
    ap.add_argument("--min-run", type=int, default=64)
    ap.add_argument("--grids", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = card_of(torch.device("cuda")).sms
    rules = {"own": OWN, "candidate": candidate(a.min_run, a.grids)}
    choices = [{"shape": name, "N": n, "K": k, **{r: f(n, k, sms) for r, f in rules.items()}}
               for name, (n, k) in PRODUCTS.items()]
    tok = load_tokenizer(None)
    rows = []
    for size in a.models.split(","):
        full = Qwen35Model(shaped(size), torch.bfloat16, torch.device("cuda"))
        random_weights_(full)
        model = int8_twin(full)
        del full
        torch.cuda.empty_cache()
        model.tokenizer = tok
        model.set_backend("cuda")
        pf = prefill(model, words_for(tok, 200, 5), use_cache=False)
        tps = {r: [] for r in rules}
        outs = {}
        for rep in range(a.reps + 1):  # round 0 warms both
            for r, f in rules.items():
                launch.split_of = f
                g = generate(model, pf, max_new_tokens=a.tokens, sampling=SamplingParams())
                outs[r] = g.token_ids
                if rep:
                    tps[r].append(round(g.decode_tokens_per_s, 1))
        launch.split_of = OWN
        row = {"model": size, **{f"tok_per_s_{r}": sorted(v)[len(v) // 2] for r, v in tps.items()},
               **{f"all_{r}": v for r, v in tps.items()}, "same_tokens": outs["own"] == outs["candidate"]}
        rows.append(row)
        print(row, flush=True)
        del model, pf
        torch.cuda.empty_cache()
    card = torch.cuda.get_device_name()
    out = a.out or str(Path(__file__).parent / "results" /
                       f"gemv-int8-split-ab-{card.split()[1].lower()}.json")
    Path(out).write_text(json.dumps({"gpu": card, "torch": torch.__version__, "host_cpu": host_cpu(),
                                     "candidate": {"min_run_pieces": a.min_run, "grids": a.grids},
                                     "choices": choices, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
