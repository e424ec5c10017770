"""The PyTorch path on the CPU (what runs without a CUDA GPU, and on an accelerator that is not CUDA): greedy
decode tokens/s of a 0.8B-shaped model (random weights, fp32, --layers of its 24, every fourth attention) after
prompts of several lengths, and each prompt's prefill time. With a long context each decoded token reads the
attention layers' whole K/V cache (kernels/paged_attention/reference.py); the projections read the weights.
Writes bench/results/cpu-decode.json (or --out).

    python3 bench/cpu_decode.py [--layers 8] [--contexts 256 4096 16384] [--tokens 12] [--threads 2] [--out PATH]
"""
import argparse
import json
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime import SamplingParams, generate, prefill_ids
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.tokenizer import load_tokenizer

from e2e import random_weights_, shaped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 16384])
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu-decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = Qwen35Model(shaped(args.model, args.layers), torch.float32, torch.device("cpu"))
    random_weights_(model)
    model.tokenizer, model.path = load_tokenizer(None), None
    model.set_backend("torch")
    greedy = SamplingParams(do_sample=False)
    rows = []
    for ctx in args.contexts:
        ids = [(i * 7919) % 200_000 + 100 for i in range(ctx)]  # any ids: the weights are random
        t0 = time.perf_counter()
        pf = prefill_ids(model, ids, use_cache=False)
        prefill_ms = (time.perf_counter() - t0) * 1000
        rates = [generate(model, pf, max_new_tokens=args.tokens, sampling=greedy).decode_tokens_per_s
                 for _ in range(args.reps)]
        rows.append({"context": ctx, "prefill_ms": round(prefill_ms, 1), "decode_tok_per_s": round(max(rates), 2)})
        print(rows[-1], flush=True)
    out = {"model": f"Qwen3.5-{args.model}-shaped, {args.layers} layers, random weights, fp32, PyTorch path",
           "threads": args.threads, "decode_tokens": args.tokens, "host_cpu": host_cpu(),
           "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
