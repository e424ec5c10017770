"""Where the time of one chunk step of the sequential kernel (gdn_prefill.cu) goes: per-phase cycles
(clock64 between barriers, -DPROFILE),
and timings of compile-time variants. Development only.

    python3 bench/gdn_prefill_prof.py [--ncu] [--size 1x4096] [--splits 32,64,128] [--defines NO_WGMMA=1,...]
    (--ncu: one plain launch of the default dispatch at --size, for ncu to profile)

Split 128 walks with the wgmma walk on sm_90a; --defines NO_WGMMA=1 profiles the mma.sync walk instead.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen35_fast.kernels.gdn_prefill import launch as L  # noqa: E402

import gdn_prefill_dev as dev  # noqa: E402

PHASES = ["wait", "S->smem", "[K;Q]S+rhs", "T rhs", "o+state"]
PREP_PHASES = ["load+gates", "KK/QK/QQ mma+norms", "heads (L, inverse, T | P)"]
VARIANTS = {}  # name -> extra defines, timed at B=1 and B=8, L=4096


def main():
    B, Lq = 1, 4096
    if "--size" in sys.argv:
        B, Lq = (int(v) for v in sys.argv[sys.argv.index("--size") + 1].split("x"))
    x = dev.inputs(B, Lq)
    if "--ncu" in sys.argv:
        L.gdn_chunk_prefill_cuda(*x)
        torch.cuda.synchronize()
        return
    import triton.testing
    nch = Lq // 64
    splits = (32, 64, 128)
    if "--splits" in sys.argv:
        splits = tuple(int(v) for v in sys.argv[sys.argv.index("--splits") + 1].split(","))
    extra = {}
    if "--defines" in sys.argv:
        extra = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in sys.argv[sys.argv.index("--defines") + 1].split(",")}
    for split in splits:
        L.EXTRA_DEFINES.clear()
        L.EXTRA_DEFINES.update(extra)
        L.EXTRA_DEFINES["PROFILE"] = 1
        _, ht = L.gdn_chunk_prefill_cuda(*x, dv_split=split, fused=False, segments=False)  # PROFILE marks of gdn_prefill.cu
        cyc = ht.flatten()[:len(PHASES)].cpu() / nch
        L.EXTRA_DEFINES.clear()
        print(f"split {split}: cycles/chunk " + " ".join(f"{n}={c:.0f}" for n, c in zip(PHASES, cyc.tolist()))
              + f" total={cyc.sum():.0f}")
    # the prep kernel's phases, as block (0, 0) saw them (it leaves them in its own Fg row)
    seen = []
    orig = L.launch

    def spy(fn, grid, block, args, shared_mem=0):
        orig(fn, grid, block, args, shared_mem=shared_mem)
        seen.append(args)
    L.EXTRA_DEFINES["PROFILE"] = 1
    L.launch = spy
    try:
        L.gdn_chunk_prefill_cuda(*x, dv_split=32, fused=False)
    finally:
        L.launch = orig
        L.EXTRA_DEFINES.clear()
    torch.cuda.synchronize()
    cyc = seen[0][9].flatten()[:len(PREP_PHASES)].cpu()
    print("prep block cycles " + " ".join(f"{n}={c:.0f}" for n, c in zip(PREP_PHASES, cyc.tolist()))
          + f" total={cyc.sum():.0f}")
    for name, defs in VARIANTS.items():
        L.EXTRA_DEFINES.clear()
        L.EXTRA_DEFINES.update(defs)
        for split in (32, 128):
            for (Bb, Ll) in ((1, 4096), (8, 4096)):
                xs = [dev.inputs(Bb, Ll, seed=i) for i in range(2)]
                it = iter(range(10 ** 9))
                fn = lambda: L.gdn_chunk_prefill_cuda(*xs[next(it) % 2], dv_split=split)  # noqa: E731
                fn()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                print(f"variant {name:8s} split {split:3d} B={Bb} L={Ll}: {ms:.4f} ms")


if __name__ == "__main__":
    main()
