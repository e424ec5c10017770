"""Time to first token with and without prefix reuse: a Qwen3.5-9B-shaped model (random weights, bf16, the
27x1152 vision tower) asked two different 50-token questions about one 1024x1024 image after a
200-token system prompt. The first question reads everything; the second reuses the system prompt and
the image from the K/V store (runtime/prefix.py) and runs only its own tokens. Each first run starts
from an empty prefix cache. Also the second question with the image as ComfyUI holds it (on the CPU):
the same tensor each time, and a new tensor of the same pixels each time. Adds {"ttft_first_ms",
"ttft_reuse_ms", ...} as "ttft" to bench/results/paged-h200.json (or --out), keeping the kernel rows there.

    python3 bench/prefix_reuse.py [--layers 32] [--reps 9] [--out PATH] [--smoke]
"""
import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime.multimodal import prefill_multimodal
from qwen35_fast.runtime.tokenizer import load_tokenizer
from qwen35_fast.runtime.vision import VisionConfig, VisionTower

from e2e import nine_b, random_weights_
from vision import OUT_HIDDEN, TOWER

WORDS = ("the painter wants a calm picture of a harbour at dawn with fishing boats mist on the water gulls over "
         "the masts warm light on the houses along the quay and a few people starting their day").split()


def words_for(tokenizer, n: int, seed: int) -> str:
    """Text of about n tokens drawn from WORDS (a fixed shuffle per seed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(tokenizer.encode_text(" ".join(out))) < n:
        out.append(WORDS[int(torch.randint(len(WORDS), (1,), generator=g))])
    return " ".join(out)


def build(layers: int, smoke: bool):
    """(model, system prompt, two questions, image): the benchmark's 9B-shaped model with its tower."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, tower_shape, out_hidden, side = nine_b(layers), TOWER, OUT_HIDDEN, 1024
    if smoke:
        tower_shape, out_hidden, side = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2), 256, 64
        cfg = replace(nine_b(4), hidden_size=out_hidden, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=2)
    from qwen35_fast.runtime.model import Qwen35Model
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = Qwen35Model(cfg, dtype, dev)
    random_weights_(model)
    tower = VisionTower(VisionConfig(**tower_shape, out_hidden_size=out_hidden), dtype, dev)
    with torch.no_grad():
        for name, p in tower.named_parameters():  # LayerNorm scales 1 (0 would make every image's tokens zeros)
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in name and name.endswith("_w") else 0.0)
    model.vision, model.path = tower, None
    model.tokenizer = load_tokenizer(None)
    model.set_backend("auto")
    tok = model.tokenizer
    system = words_for(tok, 200, 1)
    questions = [words_for(tok, 50, 2) + "?", words_for(tok, 50, 3) + "?"]
    image = torch.rand(1, side, side, 3, device=dev, generator=torch.Generator(device=dev).manual_seed(4))
    return model, system, questions, image


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks the script runs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "paged-h200.json"))
    a = ap.parse_args()
    model, system, questions, image = build(a.layers, a.smoke)
    dev, dtype, cfg, tower = model.device, model.dtype, model.config, model.vision
    if a.smoke:
        a.reps = 2

    def first():
        model.kv.pool.clear()  # an empty prefix cache: everything is read
        return int(prefill_multimodal(model, questions[0], images=image, system_prompt=system).logits.argmax())

    def second():
        return prefill_multimodal(model, questions[1], images=image, system_prompt=system)

    # first and reused prompts in turn, each reuse after a fresh first one (else it would hit its own snapshot),
    # so that both medians come from the same minutes of the host (whose speed drifts between runs)
    first()
    ms_capture = _once(lambda: int(second().logits.argmax()), dev)  # captures the short prefill's CUDA graph
    firsts, times = [], []
    for _ in range(a.reps):
        firsts.append(_once(first, dev))
        times.append(_once(lambda: int(second().logits.argmax()), dev))
    ms_first, ms_reuse = (sorted(x)[len(x) // 2] for x in (firsts, times))
    # ComfyUI's case: the IMAGE on the CPU, made in inference mode, the same object for every question (its
    # fingerprint remembered: media.SeenTensors), against a new tensor of the same pixels each time (what every
    # reuse would cost without it: the copy to the GPU and the hash)
    with torch.inference_mode():
        held = image.cpu()
        copies = [held.clone() for _ in range(a.reps)]

    def second_on(img):
        return lambda: int(prefill_multimodal(model, questions[1], images=img, system_prompt=system).logits.argmax())

    same, new = [], []
    for i in range(a.reps):
        first()
        same.append(_once(second_on(held), dev))
        first()
        new.append(_once(second_on(copies[i]), dev))
    ms_same, ms_new = (sorted(x)[len(x) // 2] for x in (same, new))
    pf_first = prefill_multimodal(model, questions[0], images=image, system_prompt=system, use_cache=False)
    first()
    pf = second()
    cold = prefill_multimodal(model, questions[1], images=image, system_prompt=system, use_cache=False)
    err = float((pf.logits - cold.logits).norm() / cold.logits.norm())
    result = {"ttft_first_ms": round(ms_first, 2), "ttft_reuse_ms": round(ms_reuse, 2),
              "ttft_reuse_capturing_ms": round(ms_capture, 2),
              "ttft_reuse_cpu_image_ms": round(ms_same, 2), "ttft_reuse_cpu_image_new_tensor_ms": round(ms_new, 2),
              "reuse_over_first": round(ms_reuse / ms_first, 3), "prompt_tokens": pf_first.n_tokens,
              "reused_tokens": pf.cached_tokens, "new_tokens": pf.new_tokens,
              "image_tokens": pf_first.vision.vision_tokens, "vision_ms_first": round(pf_first.vision.vision_ms, 2),
              "logits_rel_err_reuse_vs_cold": err, "same_argmax": bool(pf.logits.argmax() == cold.logits.argmax()),
              "model": f"Qwen3.5-9B-shaped, {cfg.num_hidden_layers} layers, random weights, {str(dtype)[6:]}, "
                       f"tower {tower.config.shape_name}", "backend": model.backend.name, "host_cpu": host_cpu()}
    print(json.dumps(result, indent=1))
    if a.smoke:
        return
    path = Path(a.out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data["ttft"] = result
    path.write_text(json.dumps(data, indent=1) + "\n")


def _once(fn, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


if __name__ == "__main__":
    main()
