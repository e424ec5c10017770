"""The PyTorch path on the CPU (what runs without a CUDA GPU, and on an accelerator that is not CUDA) against
transformers' Qwen3_5ForConditionalGeneration on the same weights: a 0.8B-shaped model (random weights, fp32,
--layers of its 24, every fourth attention; a tiny vision tower, unused), greedy decode tokens/s after prompts of
several lengths (the best of --reps generations, for both), and each prompt's prefill time. With a long context
each decoded token reads the attention layers' whole K/V cache (ours: kernels/paged_attention/reference.py); the
projections read the weights. transformers: a generate() of 1 + --tokens tokens, each step timed as it ends (a
logits processor), on the contexts of --hf-contexts (its prefill of 16K tokens takes minutes here). The prefills
of a context both run are timed in turn (ours, then transformers' forward; --prefill-reps rounds, medians): this host's
speed drifts by up to ~15% within minutes, which timing each one after the other put on whichever ran
in the slower stretch. Writes bench/results/cpu-decode.json.

    python3 bench/cpu_decode.py [--layers 8] [--contexts 256 4096 16384] [--hf-contexts 256 4096] [--prefill-reps 3] [--threads 2]
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime import SamplingParams, generate, load_model, prefill_ids
from qwen35_fast.runtime.config import TextConfig

from e2e import hf_text_config, shaped


def transformers_model(c: TextConfig):
    """transformers' model of text config `c` (random weights as its init draws them, the norms and gates moved off
    their init values), with a tiny vision tower."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = hf_text_config(c, tie_word_embeddings=True)
    cfg = Qwen3_5Config(text_config=text, tie_word_embeddings=True,
                        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                           out_hidden_size=c.hidden_size))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(-2, 1)
    return model


def prompt(ctx: int) -> list[int]:
    return [(i * 7919) % 200_000 + 100 for i in range(ctx)]  # any ids: the weights are random


def ours_prefill(model, ctx: int):
    """(prefill, ms) of ours on the context's prompt, nothing reused."""
    t0 = time.perf_counter()
    pf = prefill_ids(model, prompt(ctx), use_cache=False)
    return pf, (time.perf_counter() - t0) * 1000


def ours_decode(model, pf, tokens: int, reps: int) -> float:
    greedy = SamplingParams(do_sample=False)
    return max(generate(model, pf, max_new_tokens=tokens, sampling=greedy).decode_tokens_per_s for _ in range(reps))


def hf_prefill_ms(model, ctx: int) -> float:
    """transformers' forward over the context's prompt (its cache made, the last position's logits), ms."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt(ctx)]), logits_to_keep=1, use_cache=True)
    return (time.perf_counter() - t0) * 1000


def transformers_decode(model, ctx: int, tokens: int) -> float:
    """generate() of 1 + tokens greedy tokens, the time of each step taken by a logits processor (called once a
    token, after the forward that made its logits): tokens/s over the steps between the first call and the last."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    clock = Clock()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt(ctx)]), max_new_tokens=1 + tokens, min_new_tokens=1 + tokens,
                             do_sample=False, logits_processor=LogitsProcessorList([clock]))
    assert out.shape[1] == ctx + 1 + tokens and len(clock.times) == 1 + tokens
    return tokens / (clock.times[-1] - clock.times[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 16384])
    ap.add_argument("--hf-contexts", type=int, nargs="*", default=[256, 4096])
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu-decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = transformers_model(shaped(args.model, args.layers))
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        from qwen35_fast.runtime import demo_checkpoint  # the real Qwen3.5 tokenizer files beside the weights
        for f in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(demo_checkpoint()) / f
            if src.exists():
                (Path(folder) / f).write_bytes(src.read_bytes())
        model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    rows = []
    # a first call of each one's paths, outside the timing
    generate(model, prefill_ids(model, prompt(16), use_cache=False), max_new_tokens=2)
    with torch.inference_mode():
        hf.generate(torch.tensor([prompt(16)]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    for ctx in args.contexts:
        both = ctx in args.hf_contexts
        ours_ms, hf_ms = [], []
        for _ in range(args.prefill_reps if both else 1):  # in turn: the host's drift falls on both alike
            pf, ms = ours_prefill(model, ctx)
            ours_ms.append(ms)
            if both:
                hf_ms.append(hf_prefill_ms(hf, ctx))
        rows.append({"impl": "ours", "context": ctx, "prefill_ms": round(statistics.median(ours_ms), 1),
                     "decode_tok_per_s": round(ours_decode(model, pf, args.tokens, args.reps), 2)})
        print(rows[-1], flush=True)
        pf = None
        if both:
            rows.append({"impl": "transformers", "context": ctx, "prefill_ms": round(statistics.median(hf_ms), 1),
                         "decode_tok_per_s": round(max(transformers_decode(hf, ctx, args.tokens)
                                                       for _ in range(args.reps)), 2)})
            print(rows[-1], flush=True)
    import transformers
    out = {"model": f"Qwen3.5-{args.model}-shaped, {args.layers} layers, random weights (the same in both), fp32",
           "threads": args.threads, "decode_tokens": args.tokens, "host_cpu": host_cpu(),
           "prefill_reps": args.prefill_reps, "torch": torch.__version__, "transformers": transformers.__version__,
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
