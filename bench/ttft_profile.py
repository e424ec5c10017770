"""Where the time to first token goes with and without prefix reuse (bench/prefix_reuse.py's model and
prompts): wall time, host-device synchronisations, the host functions that cost most (cProfile), and the
GPU time in kernels for the first question (read cold) and the second (system prompt and image reused).
Development only.

    python3 bench/ttft_profile.py [--layers 32] [--rows 18] [--kernels 8] [--form runtime|packed|kept|parts]
"""
import argparse
import cProfile
import io
import pstats
import time
import warnings

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.runtime import kv_pool, media, multimodal, prefill_graph, prefix
from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime import vision as vision_mod
from qwen35_fast.runtime.multimodal import prefill_multimodal

from e2e_profile import kernel_table
from prefix_reuse import build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--kernels", type=int, default=8, help="rows of the kernel tables")
    ap.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumulative")
    ap.add_argument("--order", type=int, default=0,
                    help="also print the reused prompt's first ORDER kernels in launch order (one layer of each kind)")
    ap.add_argument("--form", choices=("runtime", "packed", "kept", "parts"), default="runtime",
                    help="how the cold prompt gets its GDN states at the cuts (runtime/model.py cut_form)")
    a = ap.parse_args()
    if a.form != "runtime":
        forced = {"packed": lambda cuts, T, be, device: model_mod.PackedCuts.build(cuts, T, device),
                  "kept": lambda cuts, T, be, device: model_mod.KeptCuts.plan(cuts, be, device),
                  "parts": lambda cuts, T, be, device: None}[a.form]
        model_mod.cut_form = forced
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
        pstats.Stats(prof, stream=out).sort_stats(a.sort).print_stats(a.rows)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])
        if before:
            before()
        host_stages(fn)
        if before:
            before()
        kernel_table(fn, a.kernels)
        if a.order and name == "reuse":
            before()
            kernel_order(fn, a.order)


STAGES = ((multimodal, "_as_inputs"), (multimodal, "build_prompt"), (multimodal, "media_spans"),
          (multimodal, "layout_positions"), (multimodal, "prefill_reusing"), (multimodal, "synchronize"),
          (multimodal, "preprocess_images"), (media, "to_rgb"), (media, "_normalise"), (media, "_patchify"),
          (multimodal, "content_hash"), (vision_mod.VisionTower, "plan"), (vision_mod.VisionTower, "forward"),
          (model_mod.Qwen35Model, "forward_prefill"), (model_mod.Qwen35Model, "forward_prefill_kept"),
          (kv_pool.KVPool, "match"), (kv_pool.KVPool, "save_snapshot"), (prefix, "padded_prefill"),
          (model_mod.Cache, "resume"), (prefill_graph.PaddedPrefill, "__call__"),
          (prefill_graph.PaddedPrefill, "_stage"), (torch.cuda.CUDAGraph, "replay"))


def kernel_order(fn, n: int) -> None:
    """The first n GPU kernels and copies of one call of fn in the order they ran: start (us from the first),
    duration (us) and the gap before each, so that the glue between the model's operators shows."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not ev:
        return
    t0, end = ev[0].time_range.start, ev[0].time_range.start
    print(f"kernels in order ({len(ev)} in all; us: start, duration, gap before):")
    for e in ev[:n]:
        s, d = e.time_range.start, e.time_range.end - e.time_range.start
        print(f"  {s - t0:9.1f} {d:7.1f} {s - end:6.1f}  {e.name[:100]}")
        end = e.time_range.end
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    print(f"  span {ev[-1].time_range.end - t0:.1f} us, busy {busy:.1f} us")


def host_stages(fn) -> None:
    """When each stage of one call starts and ends on the host clock (ms from the call's start), nested by
    depth, and when the GPU finished the work queued up to the stage's end (an event recorded there): a GPU
    time near the host's end means the GPU waited for the host. The GPU is done when the call returns (it
    reads the logits back)."""
    marks, depth = [], [0]
    start = torch.cuda.Event(enable_timing=True)

    def wrap(f, name):
        def run(*args, **kwargs):
            t = time.perf_counter()
            depth[0] += 1
            try:
                return f(*args, **kwargs)
            finally:
                depth[0] -= 1
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                marks.append((t, time.perf_counter(), depth[0], name, done))
        return run

    saved = []
    for owner, name in STAGES:
        f = owner.__dict__.get(name)
        if f is None:
            continue
        saved.append((owner, name, f))
        g = f.__func__ if isinstance(f, classmethod) else f
        w = wrap(g, f"{getattr(owner, '__name__', owner)}.{name}")
        setattr(owner, name, classmethod(w) if isinstance(f, classmethod) else w)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    print(f"host stages (ms from the call's start, host start -> end, GPU done; returned at {(t1 - t0) * 1000:.2f}):")
    for a, b, d, name, done in sorted(marks, key=lambda m: m[:3]):
        print(f"  {'  ' * d}{(a - t0) * 1000:7.2f} -> {(b - t0) * 1000:7.2f}  gpu {start.elapsed_time(done):7.2f}  {name}")


if __name__ == "__main__":
    main()
