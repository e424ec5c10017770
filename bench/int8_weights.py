"""Full against 8-bit weights (runtime/quant.py): a dense Qwen3.5-shaped model (bench/e2e.py's shapes, random
weights of a trained model's scale, the real tokenizer; on a GPU bf16 on the kernels backend, on the CPU fp32 on
the PyTorch path), the same weights quantized for the int8 model. Per model: the weights' GiB, a prompt's prefill
(ms, median), greedy generate() after it (decode tokens/s as Generation reports them, median), and how far the
int8 model's prompt logits are from the full model's (relative; in fp32, beside how far rounding the same
matrices to bf16 moves them, since random weights amplify any change). Rounds taken in turn. Writes
bench/results/int8-weights-h200.json (or --out).

    python3 bench/int8_weights.py [--model 9b] [--layers N] [--reps 5] [--out PATH]
    python3 bench/int8_weights.py --device cpu --model 0.8b --layers 8 --prompt-tokens 256 --tokens 16 --reps 3 \
        --out bench/results/int8-weights-cpu.json
"""
import argparse
import json
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime import SamplingParams, generate, prefill
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.quant import Int8Weight, fill_rows
from qwen35_fast.runtime.tokenizer import load_tokenizer

from e2e import SHAPES, random_weights_, shaped
from prefix_reuse import words_for


def int8_twin(full: Qwen35Model) -> Qwen35Model:
    """An int8 model whose matrices are full's quantized (fill_rows, as the loader does) and the rest full's."""
    model = Qwen35Model(full.config, full.dtype, full.device, int8=True)
    own = dict(full.named_parameters())
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, Int8Weight):
                fill_rows(m, 0, own[name])
        for name, p in model.named_parameters():
            if not name.endswith((".q", ".scale")):
                p.copy_(own[name])
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="9b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="default: the size's own")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8-weights-h200.json"))
    a = ap.parse_args()
    gpu = a.device == "cuda"
    full = Qwen35Model(shaped(a.model, a.layers), torch.bfloat16 if gpu else torch.float32, torch.device(a.device))
    random_weights_(full)
    models = {"full": full, "int8": int8_twin(full)}
    tok = load_tokenizer(None)
    text = words_for(tok, a.prompt_tokens, 5)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for m in models.values():
        m.tokenizer = tok
        m.set_backend("cuda" if gpu else "torch")
        generate(m, prefill(m, text, use_cache=False), max_new_tokens=8)  # warm: modules, the decode graph
    runs = {name: {"prefill_ms": [], "tok_s": []} for name in models}
    logits = {}
    for r in range(a.reps):
        for name, m in models.items():
            sync()
            t0 = time.perf_counter()
            pf = prefill(m, text, use_cache=False)
            sync()
            runs[name]["prefill_ms"].append((time.perf_counter() - t0) * 1e3)
            logits[name] = pf.logits
            g = generate(m, pf, max_new_tokens=a.tokens, sampling=SamplingParams(), seed=r)
            runs[name]["tok_s"].append(g.decode_tokens_per_s)
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    err = rel(logits["int8"], logits["full"])
    if not gpu:  # the yardstick: the same matrices rounded to bf16 (fp32 compute)
        with torch.no_grad():
            for m in full.modules():
                for name, p in m.named_parameters(recurse=False):
                    if p.dim() == 2 and name != "conv_w":
                        p.copy_(p.bfloat16())
        bf16_err = rel(prefill(full, text, use_cache=False).logits, logits["full"])
    rows = []
    for name, m in models.items():
        ms, tps = sorted(runs[name]["prefill_ms"]), sorted(runs[name]["tok_s"])
        rows.append({"weights": name, "weight_gib": round(m.weight_bytes() / 2**30, 2),
                     "prompt_tokens": pf.n_tokens, "prefill_ms": round(ms[len(ms) // 2], 2),
                     "decode_tok_per_s": round(tps[len(tps) // 2], 1), "all_tok_per_s": [round(t, 1) for t in tps]})
        print(rows[-1])
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
              "host_cpu": host_cpu(), "threads": torch.get_num_threads(),
              "model": f"Qwen3.5-{a.model.upper()}-shaped, {full.config.num_hidden_layers} layers, random weights, "
                       f"{str(full.dtype).removeprefix('torch.')} compute", "rows": rows,
              "int8_logits_rel_err": round(err, 5)}
    if not gpu:
        result["bf16_matrices_logits_rel_err"] = round(bf16_err, 5)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
