"""What a user's first run costs in kernel compiles: a 9B-shaped model with its 27 x 1152 tower (random weights,
bf16; --layers of the text model, the kernels' variants do not depend on the count) runs what the nodes run: a
text prompt and an answer, then an image prompt and an answer, each twice; every NVRTC compile on the way is
timed (source, defines, seconds; compiles on cuda_build.compile_ahead's worker threads overlap, so their sum
can exceed the wall time). With --cache DIR the kernel caches are DIR (a second run with the same DIR is the run
after a restart: the cubins on disk, only their loads); without it, empty folders (the first run ever).
--drop-cubins deletes DIR's cubins first and keeps its lists of the modules loaded: the first run after an
update of the pack's kernels, which compile_ahead compiles in parallel from those lists.

    python3 bench/first_run.py [--cache DIR [--drop-cubins]] [--layers 4] [--out PATH]
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="", help="the kernel caches' folder (default: new, empty ones)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per answer")
    ap.add_argument("--drop-cubins", action="store_true", help="delete the cache's cubins, keep its module lists")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cache = a.cache or tempfile.mkdtemp()
    if a.drop_cubins:
        for f in Path(cache, "cupy").glob("*/*"):
            if f.suffix in (".cubin", ".ptx"):
                f.unlink()
    os.environ["CUPY_CACHE_DIR"] = os.path.join(cache, "cupy")  # before cuda_build reads them
    os.environ["XDG_CACHE_HOME"] = os.path.join(cache, "xdg")

    import torch

    import _import  # noqa: F401  (the repo as `qwen35_fast`)
    from _import import host_cpu

    from qwen35_fast.kernels import cuda_build
    from qwen35_fast.runtime.generate import generate, prefill
    from qwen35_fast.runtime.multimodal import prefill_multimodal

    from prefix_reuse import build

    compiles = []
    real = cuda_build._compile

    def timed_compile(source, src_path, arch, opts):
        t = time.perf_counter()
        out = real(source, src_path, arch, opts)
        defines = " ".join(o[2:] for o in opts if o.startswith("-D"))
        compiles.append({"source": f"{src_path.parent.name}/{src_path.name}", "defines": defines,
                         "s": round(time.perf_counter() - t, 3)})
        return out
    cuda_build._compile = timed_compile
    ahead = []
    real_ahead = cuda_build.compile_ahead
    cuda_build.compile_ahead = lambda arch, workers=None: ahead.append(real_ahead(arch, workers)) or ahead[-1]

    t0 = time.perf_counter()
    model, system, questions, image = build(a.layers, False)
    torch.cuda.synchronize()
    phases = [{"phase": "load (random weights)", "s": round(time.perf_counter() - t0, 3), "compiles": len(compiles)}]

    def phase(name, fn):
        n, t = len(compiles), time.perf_counter()
        fn()
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        spent = sum(c["s"] for c in compiles[n:])
        phases.append({"phase": name, "s": round(took, 3), "compiles": len(compiles) - n,
                       "compile_s": round(spent, 3)})
        print(f"{name}: {took:.2f} s, {len(compiles) - n} compiles ({spent:.2f} s)", file=sys.stderr)

    text = " ".join(questions) * 4  # ~400 tokens

    def text_turn():
        generate(model, prefill(model, text, system_prompt=system), a.tokens)

    def image_turn():
        generate(model, prefill_multimodal(model, questions[0], images=image, system_prompt=system), a.tokens)

    for round_ in ("first", "second"):
        phase(f"text prompt + answer, {round_}", text_turn)
        phase(f"image prompt + answer, {round_}", image_turn)
    result = {"device": torch.cuda.get_device_name(), "host_cpu": host_cpu(), "cpus": os.cpu_count(),
              "cache": ("cubins dropped" if a.drop_cubins else "given") if a.cache else "empty",
              "compiled_ahead": sum(ahead), "layers": a.layers, "tokens": a.tokens,
              "compile_s": round(sum(c["s"] for c in compiles), 3), "compiles": len(compiles),
              "phases": phases, "modules": sorted(compiles, key=lambda c: -c["s"])}
    print(json.dumps({k: v for k, v in result.items() if k != "modules"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
