"""A follow-up turn read with continue_prefill against the whole conversation read in one go, on a
Qwen3.5-9B-shaped model (random weights, bf16, our kernels): time to the follow-up's first logits, the
logits' agreement, and what keeping the turn-end snapshot costs a fresh prefill (the GDN recurrence is
cut at the turn end, inside the same pass). Writes bench/results/continue-h200.json (or --out).

    python3 bench/continue_prefill.py [--tokens 4096] [--layers 32] [--out PATH]
    python3 bench/continue_prefill.py --tiny --device cpu --tokens 256   # a smoke run without a GPU
"""
import argparse
import json
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.runtime import continue_prefill, demo_checkpoint, prefill_ids
from qwen35_fast.runtime.chat import GENERATION_PROMPT_NO_THINKING, IM_END, IM_START
from qwen35_fast.runtime.config import FULL, LINEAR, TextConfig
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.tokenizer import load_tokenizer

from e2e import nine_b, random_weights_

QUESTION = ("Thanks. Looking at the same material again, which three details would you point out to someone "
            "who has never seen it, and why do they matter? Answer in a short list.")
ANSWER = ("It shows a small harbour at dusk: a red lighthouse on the left, fishing boats along the pier, and "
          "low clouds lit orange by the sun that has just set behind the hills.")


def tiny(layers: int) -> TextConfig:
    return TextConfig(vocab_size=248320, hidden_size=128, intermediate_size=256,
                      layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
                      num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128)


def timed(fn, reps, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2], out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the first user turn")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same layout (smoke runs)")
    ap.add_argument("--out", default="bench/results/continue-h200.json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = Qwen35Model((tiny if a.tiny else nine_b)(a.layers), dtype, dev)
    random_weights_(model)
    model.tokenizer = load_tokenizer(Path(demo_checkpoint()))
    model.set_backend("auto")
    tok = model.tokenizer
    g = torch.Generator().manual_seed(0)
    body = torch.randint(1000, 150000, (a.tokens,), generator=g).tolist()
    first = tok.encode(f"{IM_START}user\n") + body + tok.encode(f"{IM_END}\n") + tok.encode(GENERATION_PROMPT_NO_THINKING)
    # use_cache off throughout: every repetition reads what it measures (no snapshot of an earlier one)
    plain_ms, _ = timed(lambda: prefill_ids(model, first, use_cache=False), a.reps, dev)
    snap_ms, parent = timed(lambda: prefill_ids(model, first, chat_template=True, use_cache=False), a.reps, dev)
    cont_ms, child = timed(lambda: continue_prefill(model, parent, QUESTION, previous_answer=ANSWER, use_cache=False),
                           a.reps, dev)
    whole_ms, whole = timed(lambda: prefill_ids(model, list(child.token_ids), use_cache=False), a.reps, dev)
    err = float((child.logits - whole.logits).norm() / whole.logits.norm())
    result = {"model": f"Qwen3.5-9B-shaped{' (tiny widths)' if a.tiny else ''}, {a.layers} layers, random weights, "
                       f"{str(dtype).replace('torch.', '')}",
              "backend": model.backend.name, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "first_turn_tokens": len(first), "cached_tokens": child.cached_tokens, "new_tokens": child.new_tokens,
              "ms_first_turn_without_snapshot": round(plain_ms, 2), "ms_first_turn_with_snapshot": round(snap_ms, 2),
              "ms_follow_up_continued": round(cont_ms, 2), "ms_follow_up_whole_conversation": round(whole_ms, 2),
              "continued_over_whole": round(cont_ms / whole_ms, 4), "logits_rel_err_vs_whole": err,
              "same_argmax": bool(child.logits.argmax() == whole.logits.argmax())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
