"""Where an int8 model's prompt spends its time: a 9B-shaped model's int8 twin (bench/int8_weights.py) reads a
1,000-token prompt with the matrices dequantized by kernels/dequant and by the PyTorch expression, in turn
(median ms of --reps rounds each), then once under torch.profiler (the CUDA time of the busiest kernels, and the
host's wall time against the GPU's). Prints; writes nothing.

    python3 bench/int8_prefill_profile.py [--model 9b] [--reps 5]
"""
import argparse
import time

import torch
from int8_weights import int8_twin

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels import cuda_impl
from qwen35_fast.kernels.dequant.reference import dequant_rows_ref
from qwen35_fast.runtime import prefill
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.tokenizer import load_tokenizer

from e2e import random_weights_, shaped
from prefix_reuse import words_for


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="9b")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    full = Qwen35Model(shaped(a.model), torch.bfloat16, torch.device("cuda"))
    random_weights_(full)
    model = int8_twin(full)
    del full
    torch.cuda.empty_cache()
    tok = load_tokenizer(None)
    model.tokenizer = tok
    model.set_backend("cuda")
    text = words_for(tok, 1000, 5)
    kernel = cuda_impl.dequant_rows_cuda
    ways = {"kernel": kernel, "torch": dequant_rows_ref}
    ms = {w: [] for w in ways}
    for r in range(a.reps + 1):
        for w, fn in ways.items():
            cuda_impl.dequant_rows_cuda = fn
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prefill(model, text, use_cache=False)
            torch.cuda.synchronize()
            if r:
                ms[w].append((time.perf_counter() - t0) * 1e3)
    print({w: round(sorted(v)[len(v) // 2], 2) for w, v in ms.items()})
    cuda_impl.dequant_rows_cuda = kernel
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        prefill(model, text, use_cache=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


if __name__ == "__main__":
    main()
