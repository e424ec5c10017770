"""Where the time to first token goes with and without prefix reuse (bench/prefix_reuse.py's model and
prompts): wall time, host-device synchronisations, the host functions that cost most (cProfile), and the
GPU time in kernels for the first question (read cold) and the second (system prompt and image reused).
Development only.

    python3 bench/ttft_profile.py [--layers 32] [--rows 18]
"""
import argparse
import cProfile
import io
import pstats
import time
import warnings

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.runtime.multimodal import prefill_multimodal

from e2e_profile import kernel_table
from prefix_reuse import build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=18)
    a = ap.parse_args()
    model, system, questions, image = build(a.layers, smoke=not torch.cuda.is_available())

    def first():
        model.kv.pool.clear()
        return prefill_multimodal(model, questions[0], images=image, system_prompt=system)

    def second():
        return prefill_multimodal(model, questions[1], images=image, system_prompt=system)

    for name, fn, before in (("cold", first, None), ("reuse", second, first),
                             ("cold, use_cache off", lambda: prefill_multimodal(
                                 model, questions[0], images=image, system_prompt=system, use_cache=False), None)):
        for _ in range(2):  # warm
            if before:
                before()
            fn()
        if before:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()  # wall time without the sync debug mode, which slows every launch
        pf = fn()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        if before:
            before()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:  # the synchronisations, in a second call
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fn()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught]
        print(f"== {name}: {ms:.1f} ms wall, {pf.cached_tokens} reused + {pf.new_tokens} new tokens, "
              f"vision {pf.vision.vision_ms:.1f} ms, {len(syncs)} synchronisations ({', '.join(syncs)})")
        if before:
            before()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.rows)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])
        if before:
            before()
        kernel_table(fn, 8)


if __name__ == "__main__":
    main()
