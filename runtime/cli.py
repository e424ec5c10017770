"""Command line: `python -m qwen35_fast demo` (tiny random checkpoint) or `... run --model PATH`."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .errors import Qwen35Error

DEFAULT_PROMPT = "Write a one-sentence prompt for an image of a lighthouse at dusk."


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m qwen35_fast",
                                 description="Prefill a prompt through Qwen3.5 and generate an answer.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, text in (("demo", "run on a tiny checkpoint with random weights and the real tokenizer (made on "
                                "first use and cached), unless --model is given"),
                       ("run", "run a checkpoint given with --model")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--model", help="checkpoint folder or .safetensors file", required=name == "run")
        p.add_argument("--prompt", default=DEFAULT_PROMPT)
        p.add_argument("--system-prompt", default="")
        p.add_argument("--thinking", action="store_true", help="let the model think before answering")
        p.add_argument("--allow-special-tokens", action="store_true",
                       help="parse special tokens (<|im_start|>...) written in the prompt instead of keeping them text")
        p.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image for the prompt (repeat for several; <image>, <image 2> place them); needs Pillow")
        p.add_argument("--follow-up", action="append", default=[], metavar="TEXT",
                       help="a further user turn after the answer (repeat for more): the answer goes in as the "
                            "assistant's turn and only the new turn is read")
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
        p.add_argument("--temperature", type=float, default=0.7)
        p.add_argument("--top-p", type=float, default=0.8)
        p.add_argument("--top-k", type=int, default=20)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
        p.add_argument("--device", default="auto")
        p.add_argument("--backend", default="auto", choices=["auto", "cuda", "torch"])
        p.add_argument("--weights", default="auto", choices=["auto", "full", "int8"],
                       help="int8: the text model's matrices in 8 bits (half the memory of bf16); auto: int8 only "
                            "where the full weights do not fit the device")
    return ap.parse_args(argv)


def _read_image(path: str):
    """An image file as a ComfyUI IMAGE tensor [1, H, W, C] in 0..1, read as ComfyUI's LoadImage reads it: turned
    the way its EXIF orientation says (a phone's portrait photo), 16-bit grey over its whole range, transparency
    kept (a palette's too) for the tower's white background."""
    try:
        import numpy as np
        import torch
        from PIL import Image, ImageOps
    except ImportError:
        raise Qwen35Error("--image needs Pillow (pip install pillow); ComfyUI environments have it") from None
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            if im.mode.startswith("I"):  # 16- or 32-bit grey: RGB would clip it at 255 (a 16-bit PNG all white)
                grey = np.asarray(im, dtype=np.float32)
                top = 65535.0 if im.mode.startswith("I;16") or grey.max(initial=0) > 255 else 255.0
                grey = torch.from_numpy(grey / top).clamp(0, 1)
                return grey[None, :, :, None].expand(-1, -1, -1, 3).contiguous()
            if im.mode == "P" and "transparency" in im.info:
                im = im.convert("RGBA")
            im = im.convert("RGBA" if "A" in im.getbands() else "RGB")
            return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0)[None]
    except Image.DecompressionBombError as e:
        raise Qwen35Error(f"--image {path}: {str(e).rstrip('.')}; scale it down first (the tower reads at most "
                          "16.7 MP of it anyway)") from None
    except OSError as e:
        raise Qwen35Error(f"--image {path}: cannot read it as an image ({e})") from None


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if hasattr(sys.stdout, "reconfigure"):  # redirected on Windows, stdout takes the code page: no crash on the rest
        sys.stdout.reconfigure(errors="replace")
    a = _args(argv)
    streamed = []  # an error after the answer began starts on a line of its own
    try:
        return _run(a, streamed)
    except Qwen35Error as e:
        print(("\n" if streamed else "") + f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, and let Python's last flush go nowhere
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # (a stdout without a file descriptor)
            pass
        return 1
    except OSError as e:  # the output could not be written (a full disk)
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(a, streamed: list) -> int:
    from . import SamplingParams, continue_prefill, demo_checkpoint, generate, load_model, prefill
    # the settings first: a typo in them should not cost a model load
    sampling = SamplingParams(do_sample=a.sample, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    sampling.check()
    if a.max_new_tokens < 1:
        raise Qwen35Error(f"--max-new-tokens is {a.max_new_tokens}; it must be at least 1")
    for text in a.follow_up:  # (nor a follow-up with nothing to ask, found after the first answer)
        if not text.strip():
            raise Qwen35Error(f"--follow-up {text!r} is empty; write the next question")
    images = [_read_image(f) for f in a.image]  # and the images: a wrong path should not cost one either
    if not a.prompt.strip() and not images:  # (nor an empty prompt: prefill's own check comes after the load)
        raise Qwen35Error("--prompt is empty; write a prompt (or give an --image to describe)")
    path = a.model or demo_checkpoint()
    model = load_model(path, dtype=a.dtype, device=a.device, backend=a.backend, weights=a.weights)
    if images:
        from .multimodal import prefill_multimodal
        pf = prefill_multimodal(model, a.prompt, images=images, system_prompt=a.system_prompt, thinking=a.thinking,
                                allow_special_tokens=a.allow_special_tokens)
    else:
        pf = prefill(model, a.prompt, system_prompt=a.system_prompt, thinking=a.thinking,
                     allow_special_tokens=a.allow_special_tokens)

    def show(delta, n, total):
        streamed[:] = [True]
        sys.stdout.write(delta)
        sys.stdout.flush()

    # the demo's weights are random: its text is noise, and the speed lines after it are what it shows
    noise = "" if a.model else ": random weights, so the text is noise; the speeds below are the point"
    print(f"--- answer ({model.path.name}{noise}) ---")
    out = generate(model, pf, max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed, on_token=show)
    for text in a.follow_up:
        pf = continue_prefill(model, pf, text, previous_answer=out.text, thinking=a.thinking,
                              allow_special_tokens=a.allow_special_tokens)
        print(f"\n--- follow-up ({pf.cached_tokens} tokens reused, {pf.new_tokens} new): {text} ---")
        out = generate(model, pf, max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed, on_token=show)
    print("\n---")
    if out.thinking:
        print(f"thinking: {len(out.thinking)} characters (shown above, before the answer)")
    print(f"kernel backend : {model.backend.name} ({model.backend.reason})")
    print(f"weights        : {'matrices in 8 bits, computed in ' if model.int8 else ''}"
          f"{str(model.dtype).removeprefix('torch.')}, {model.weight_bytes() / 2**30:.2f} GiB")
    reused = f" (and {pf.cached_tokens} reused from the earlier turns)" if pf.cached_tokens else ""
    print(f"prefill        : {pf.new_tokens} tokens in {pf.ms:.1f} ms = {pf.tokens_per_s:,.0f} tokens/s{reused}")
    if pf.vision is not None:
        print(f"vision         : {pf.vision.vision_tokens} image tokens, tower {pf.vision.vision_ms:.1f} ms")
    print(f"first token    : {out.first_token_ms:.1f} ms")
    print(f"decode         : {out.n_tokens} tokens at {out.decode_tokens_per_s:,.1f} tokens/s "
          f"(stopped: {out.finish_reason})")
    return 0
