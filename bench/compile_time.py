"""Cold NVRTC compile time of the kernel modules of a bf16 Qwen3.5 model's GDN layers and RMSNorms (MODULES, a
fixed list: a model loads more, the paged attention, gemv, sampling and vision modules among them, and the
launchers' defines have grown since; bench/first_run.py times every compile of a real first run). No GPU needed:
NVRTC runs on the CPU; the GPU adds only the module load. Compiles into empty caches, so nothing is reused.

    python bench/compile_time.py [--arch sm_90a] [--out bench/results/compile-time.json]
"""
import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp()  # before cuda_build reads it: a cold cache
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()

import _import  # noqa: E402,F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels import cuda_build  # noqa: E402

KERNELS = Path(cuda_build.__file__).parent
# (source, defines) as the launchers ask for them for a bf16 model: the device probe, conv1d prefill and
# update, the decode step (its tile for up to 8 sequences), the prefill's prep kernel and the Hopper walk
# (its DVS 32 module also holds the 128-column walk of the sequence split; --arch sm_86 etc. load the
# portable path's DVS 64 module instead), and the RMSNorms of the 9B model (hidden 4096 with an fp32 weight,
# attention's q / k norm 256 with an fp32 weight, the GDN gated norm 128 with a bf16 weight).
MODULES = [("probe.cu", {}), ("conv1d/conv1d.cu", {}), ("conv1d/conv1d.cu", {"TX": 0}),
           ("gdn_decode/gdn_decode.cu", {"VT": 16, "THREADS": 32}),
           ("gdn_prefill/prep.cu", {"IN_T": 2, "AB_T": 2}),
           ("gdn_prefill/gdn_prefill.cu", {"DVS": 32, "IN_T": 2}),
           ("rms_norm/rms_norm.cu", {"DIM": 4096, "IN_T": 2, "W_T": 0, "GATED": 0, "TPR": 128}),
           ("rms_norm/rms_norm.cu", {"DIM": 256, "IN_T": 2, "W_T": 0, "GATED": 0, "TPR": 32}),
           ("rms_norm/rms_norm.cu", {"DIM": 128, "IN_T": 2, "W_T": 2, "GATED": 1, "TPR": 16})]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile-time.json"))
    a = ap.parse_args()
    rows, t0 = [], time.perf_counter()
    modules = MODULES if a.arch == "sm_90a" else [
        (s, d) if s != "gdn_prefill/gdn_prefill.cu" else ("gdn_prefill/portable.cu", {"DVS": 64, "IN_T": 2})
        for s, d in MODULES]
    for src, defines in modules:
        t = time.perf_counter()
        cuda_build.compile_cubin(KERNELS / src, a.arch, defines)
        rows.append({"source": src, "defines": defines, "s": round(time.perf_counter() - t, 3)})
        print(f"{src:36s} {str(defines):40s} {rows[-1]['s']:.2f} s")
    total = round(time.perf_counter() - t0, 3)
    print(f"total {total:.2f} s for {len(rows)} modules ({a.arch}, NVRTC {cuda_build.nvrtc_version()})")
    with open(a.out, "w") as f:
        json.dump({"arch": a.arch, "nvrtc": list(cuda_build.nvrtc_version()), "cpu": platform.processor() or
                   platform.machine(), "cores": os.cpu_count(), "total_s": total, "modules": rows}, f, indent=1)


if __name__ == "__main__":
    main()
