"""What generate() itself decodes at: the 9B-shaped model of bench/e2e.py (--model: another dense size; random
weights, bf16, the kernels backend, the real tokenizer) after a ~1,000-token prompt, 128 new tokens: greedy,
sampled with top-k 40, top-p and a repetition penalty, and the Generate node's default settings (top_k 20,
top_p 0.8, temperature 0.7) with the current pick (sample.cu), with the same pick in torch ops, with the former
pick over the whole vocabulary (bench/sampling_pick.py), and with the presence penalty of 1.5 that Qwen3.5's model
card recommends; with its streaming callback; tokens/s as Generation reports them (from the first token
on), median of `reps` rounds taken in turn. bench/e2e.py times the bare graph step; this adds what the loop does
around it (picking, the host reading each token, the text stream). Writes bench/results/generate-h200.json (or
--out).

    python3 bench/generate_speed.py [--model 9b] [--layers N] [--reps 3] [--out PATH]
"""
import argparse
import importlib
import json
from pathlib import Path

import torch
from sampling_pick import pick_over_vocab

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime import SamplingParams, generate, prefill
from qwen35_fast.runtime import sampling as sampling_mod
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.tokenizer import load_tokenizer

from e2e import SHAPES, random_weights_, shaped
from prefix_reuse import words_for

gen_mod = importlib.import_module("qwen35_fast.runtime.generate")  # the module (the package exports its function)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="9b", choices=sorted(SHAPES), help="the dense Qwen3.5 size whose shapes to run")
    ap.add_argument("--layers", type=int, default=None, help="default: the size's own")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate-h200.json"))
    a = ap.parse_args()
    model = Qwen35Model(shaped(a.model, a.layers), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    model.tokenizer = load_tokenizer(None)
    model.set_backend("cuda")
    pf = prefill(model, words_for(model.tokenizer, 1000, 5))
    texts = []
    node_default = SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    settings = {"greedy": SamplingParams(),
                "sampled": SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1),
                "node default": node_default, "node default, pick in torch ops": node_default,
                "node default, presence_penalty 1.5 (the model card's)": SamplingParams(
                    do_sample=True, temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),
                "node default, pick over the vocabulary (before)": node_default}
    picks = {"node default, pick in torch ops": lambda logits, p, seed, n, backend, marks: sampling_mod.pick(
        logits, p, seed, n, None, marks), "node default, pick over the vocabulary (before)": pick_over_vocab}
    runs = {name: [] for name in settings}
    for name, sampling in settings.items():  # warm: the decode graph's modules
        generate(model, pf, max_new_tokens=8, sampling=sampling)
    for r in range(a.reps):  # in turn, so that drift falls on every setting alike
        for name, sampling in settings.items():
            gen_mod.pick = picks.get(name, sampling_mod.pick)
            runs[name].append(generate(model, pf, max_new_tokens=a.tokens, sampling=sampling, seed=r,
                                       on_token=lambda delta, n, most: texts.append(delta)))
    gen_mod.pick = sampling_mod.pick
    rows = []
    for name, gens in runs.items():
        tps = sorted(g.decode_tokens_per_s for g in gens)
        rows.append({"sampling": name, "prompt_tokens": pf.n_tokens, "new_tokens": [g.n_tokens for g in gens],
                     "decode_tok_per_s": round(tps[len(tps) // 2], 1), "all_tok_per_s": [round(t, 1) for t in tps]})
        print(f"generate, {name}: {rows[-1]['decode_tok_per_s']} tok/s ({rows[-1]['all_tok_per_s']})")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
              "model": f"Qwen3.5-{a.model.upper()}-shaped, {model.config.num_hidden_layers} layers, random weights, bf16",
              "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
