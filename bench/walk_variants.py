"""Variants of the sequential kernel's wgmma walk (gdn_prefill.cu, sm_90a), timed in one run: the whole
default prefill as a CUDA-graph replay (median ms), and the walk's cycles per chunk by phase (-DPROFILE,
B = 1, 4,096 tokens, 128 columns per block, no sequence split). Development only; what it measured goes
into kernels/gdn_prefill/NOTES.md.

    python3 bench/walk_variants.py [--sizes 1x32768,8x4096] [--only name,...]

A variant is a set of extra -D flags and/or an L2 promotion of the walk's tensor maps (launch.L2_PROMOTION).
Variants named "time:..." compile out work (WALK_NO_TP, WALK_NO_OSTORE, WALK_COPIES_ONLY; in the prep
kernel PREP_NO_PSTORE, PREP_NO_TSTORE) and give wrong
results on purpose; the others must reproduce the default's output bit for bit, which is checked.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen35_fast.kernels.gdn_prefill import launch as L  # noqa: E402

import gdn_prefill_dev as dev  # noqa: E402
from gdn import bench_ms, graph_of  # noqa: E402

PHASES = ["wait", "S->smem", "[K;Q]S+rhs", "T rhs", "o+state"]
VARIANTS = {  # name -> (extra defines, L2 promotion)
    "default": ({}, 2),
    "promo-256": ({}, 3),
    "time:no-T-P-copies": ({"WALK_NO_TP": 1}, 2),
    "time:no-o-stores": ({"WALK_NO_OSTORE": 1}, 2),
    "time:copies-only": ({"WALK_COPIES_ONLY": 1}, 2),
    "time:prep-no-P-stores": ({"PREP_NO_PSTORE": 1}, 2),
    "time:prep-no-T-stores": ({"PREP_NO_TSTORE": 1}, 2),
    "time:prep-no-P-T-stores": ({"PREP_NO_PSTORE": 1, "PREP_NO_TSTORE": 1}, 2),
}


def use(defines, promotion):
    L.EXTRA_DEFINES.clear()
    L.EXTRA_DEFINES.update(defines)
    L.L2_PROMOTION = promotion
    L._maps.clear()


def main():
    sizes = [(1, 32768), (8, 4096), (1, 4096)]
    if "--sizes" in sys.argv:
        sizes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[sys.argv.index("--sizes") + 1].split(",")]
    names = list(VARIANTS)
    if "--only" in sys.argv:
        names = sys.argv[sys.argv.index("--only") + 1].split(",")
    data = {sz: [dev.inputs(*sz, seed=i) for i in range(2)] for sz in sizes}
    ref = {}
    for name in names:
        defines, promo = VARIANTS[name]
        use(defines, promo)
        row = []
        for sz, xs in data.items():
            o, ht = L.gdn_chunk_prefill_cuda(*xs[0])
            if name == "default":
                ref[sz] = (o.clone(), ht.clone())
            same = ""
            if not name.startswith("time:") and sz in ref:
                same = " same" if torch.equal(o, ref[sz][0]) and torch.equal(ht, ref[sz][1]) else " DIFFERS"
            graphs = [graph_of(lambda x=x: L.gdn_chunk_prefill_cuda(*x)) for x in xs]
            it = iter(range(10 ** 9))
            ms = bench_ms(lambda: graphs[next(it) % 2].replay())
            row.append(f"{sz[0]}x{sz[1]} {ms:.4f}{same}")
            graphs = None
        use({**defines, "PROFILE": 1}, promo)
        x = data[sizes[-1]][0] if sizes[-1] == (1, 4096) else dev.inputs(1, 4096)
        _, ht = L.gdn_chunk_prefill_cuda(*x, dv_split=128, fused=False, segments=False)
        cyc = ht.flatten()[:len(PHASES)].cpu() / (4096 // 64)
        print(f"{name:22s} " + "  ".join(row) + " | cycles/chunk "
              + " ".join(f"{n}={c:.0f}" for n, c in zip(PHASES, cyc.tolist())) + f" total={cyc.sum():.0f}",
              flush=True)
    use({}, 2)


if __name__ == "__main__":
    main()
