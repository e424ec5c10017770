"""GPU time of one sampling pick over Qwen3.5's 248,320 logits: runtime.sampling.pick (top_k's k candidates,
no sort of the vocabulary) against the former form over the whole vocabulary (kept here as `pick_over_vocab`:
top_k as a mask, softmax, min_p and top_p over all ids, a sort of the vocabulary for top_p), for the Generate
node's default settings and others. Medians of `reps` rounds of `n` picks each, in turn; writes JSON.

    python3 bench/sampling_pick.py [--n 200] [--reps 5] [--out bench/results/sampling-pick-h200.json]
"""
import argparse
import json
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime.sampling import SamplingParams, pick


def pick_over_vocab(logits, p, generator):
    """The pick before candidates(): every step over the whole vocabulary."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
    return torch.multinomial(probs / probs.sum(), 1, generator=generator)


SETTINGS = {"node default (top_k 20, top_p 0.8, T 0.7)": SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
            "generate_speed's (top_k 40, top_p 0.9, T 0.8)": SamplingParams(do_sample=True, temperature=0.8, top_k=40,
                                                                            top_p=0.9),
            "top_p only (0.8)": SamplingParams(do_sample=True, temperature=0.7, top_p=0.8),
            "temperature only": SamplingParams(do_sample=True, temperature=0.7)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampling-pick-h200.json"))
    a = ap.parse_args()
    logits = (torch.randn(248320, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3).bfloat16().float()
    g = torch.Generator("cuda").manual_seed(1)
    rows = []
    for name, p in SETTINGS.items():
        times = {"candidates": [], "over_vocab": []}
        for _ in range(a.reps):
            for impl, fn in (("candidates", pick), ("over_vocab", pick_over_vocab)):
                fn(logits, p, g)  # warm
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(a.n):
                    fn(logits, p, g)
                end.record()
                torch.cuda.synchronize()
                times[impl].append(start.elapsed_time(end) * 1000 / a.n)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rows.append({"settings": name, "us_candidates": round(med["candidates"], 1),
                     "us_over_vocab": round(med["over_vocab"], 1)})
        print(f"{name}: {rows[-1]['us_candidates']} us (over the vocabulary {rows[-1]['us_over_vocab']} us)")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
           "vocab": logits.numel(), "note": "us a pick, the host queueing back to back (events around n picks)",
           "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
