"""One sampling pick over Qwen3.5's 248,320 logits: runtime.sampling.pick on the CUDA backend (kernels/sampling/
sample.cu, one launch, for top_k 1 to 64), the same pick in torch ops (the reference, top_k's k candidates, no sort
of the vocabulary; what the CUDA backend runs for other settings), and the form before both over the whole
vocabulary (kept here as `pick_over_vocab`: top_k as a mask, softmax, min_p and top_p over all ids, a sort of the
vocabulary for top_p, torch.multinomial), for the Generate node's default settings and others. Per pick: the host
queueing back to back (what a decode loop pays where the host binds) and, for the first two, the GPU time (n picks
replayed from a CUDA graph). Medians of `reps` rounds of `n` picks each, in turn; writes JSON.

    python3 bench/sampling_pick.py [--n 200] [--reps 5] [--out bench/results/sampling-pick-h200.json]
"""
import argparse
import json
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast import kernels
from qwen35_fast.runtime.sampling import SamplingParams, penalty_marks, pick

_GENERATORS: dict = {}


def pick_over_vocab(logits, p, seed, n, backend=None, marks=None):
    """The pick before the candidates: every step over the whole vocabulary, torch.multinomial drawing with a
    generator per seed (pick's signature, so that bench/generate_speed.py can put it in generate; no penalties)."""
    generator = _GENERATORS.get((logits.device, seed))
    if generator is None:
        generator = _GENERATORS[(logits.device, seed)] = torch.Generator(logits.device).manual_seed(seed)
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
            "node default, presence_penalty 1.5 (the model card's)": SamplingParams(
                do_sample=True, temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),
            "top_p only (0.8)": SamplingParams(do_sample=True, temperature=0.7, top_p=0.8),
            "temperature only": SamplingParams(do_sample=True, temperature=0.7)}


def host_us(fn, n):
    """us a call with n calls queued back to back (events around them; the host binds where the GPU work is small)."""
    fn(0)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / n


def gpu_us(fn, n):
    """GPU us a call: n calls captured in a CUDA graph, the replay timed."""
    fn(0)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        for i in range(n):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampling-pick-h200.json"))
    a = ap.parse_args()
    logits = (torch.randn(248320, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3).bfloat16().float()
    cuda = kernels.select_backend("cuda", "cuda")
    rows = []
    for name, p in SETTINGS.items():
        marks = penalty_marks(list(range(1000)), p, logits.numel(), logits.device)  # a 1,000-token prompt's
        impls = {"kernel": lambda i: pick(logits, p, 1, i, cuda, marks),
                 "torch_ops": lambda i: pick(logits, p, 1, i, None, marks),
                 "over_vocab": lambda i: pick_over_vocab(logits, p, 1, i)}
        host = {k: [] for k in impls}
        for _ in range(a.reps):
            for impl, fn in impls.items():
                host[impl].append(host_us(fn, a.n))
        row = {"settings": name, "kernel_takes": bool(0 < p.top_k <= 64)}
        row.update({f"us_host_{k}": round(sorted(v)[len(v) // 2], 1) for k, v in host.items()})
        row.update({f"us_gpu_{k}": round(gpu_us(impls[k], a.n), 1) for k in ("kernel", "torch_ops")})
        rows.append(row)
        print(row)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
           "vocab": logits.numel(), "note": "us a pick: us_host_* queued back to back (events around n picks), "
           "us_gpu_* n picks replayed from a CUDA graph; kernel: pick on the CUDA backend (sample.cu where "
           "kernel_takes, else the torch ops)", "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
