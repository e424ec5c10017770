"""Development timing of our fused GDN prefill kernel (Qwen3.5-9B shapes) on one GPU.

    python3 bench/gdn_prefill_dev.py [--check] [--splits 16,32,64,128] [--paths auto,fused,split,noseg,split_o,split_o_auto]
                                     [--graph] [--sizes 1x64,8x1024] [--prep-heads 1,2]
                                     [--define-sets ';NO_WGMMA=1'] [--json PATH]

Times every (B, L) of the anchor table for each Dv split and path (auto choice, one fused kernel, or
prep + sequential kernels (noseg: without the sequence split); split_o: the opt-in variant of gdn_prefill_split.cu at each split,
split_o_auto: that variant with its own split choice), with initial and final state, bf16, l2-norm in kernel; inputs rotate
between sets so no call reads a warm L2. --graph times CUDA-graph replays (no Python launch cost,
as in a captured model); without it, eager calls as do_bench sees them. With --check, first prints
the error of a few configurations against the float64 recurrence. --define-sets times each path once per
set of extra -D flags for the kernels (sets split by ';', flags by ','; an empty set is the default
build), e.g. ';NO_WGMMA=1' compares the wgmma walk with the mma.sync one.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from qwen35_fast.kernels.gdn_prefill.launch import choose_dv_split, gdn_chunk_prefill_cuda  # noqa: E402
from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_recurrent_f64  # noqa: E402

import conftest  # noqa: E402,F401  (makes the repo importable as qwen35_fast)

ANCHORS = {  # ms per call on one H200 (shared/anchors/gdn-prefill-h200.json): FlashQLA, fla
    (1, 1024): (0.425, 0.818), (1, 4096): (0.438, 0.919), (1, 16384): (0.659, 1.165),
    (1, 32768): (0.812, 2.334), (8, 4096): (0.772, 2.286),
}


def inputs(B, L, Hk=16, Hv=32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k, v = r(B, L, Hk, 128).bfloat16(), r(B, L, Hk, 128).bfloat16(), r(B, L, Hv, 128).bfloat16()
    a, b = r(B, L, Hv), r(B, L, Hv)
    A_log = torch.empty(Hv, device="cuda").uniform_(1, 16, generator=g).log()
    dt_bias = torch.ones(Hv, device="cuda")
    h0 = r(B, Hv, 128, 128) * 0.1
    return q, k, v, a, b, A_log, dt_bias, h0


def check():
    print("config                              o err     state err")
    for (B, L, Hk, Hv, split, var) in [(1, 300, 16, 32, None, None), (2, 1000, 2, 4, 32, None),
                                       (2, 1000, 2, 4, 64, None), (2, 1000, 2, 4, 128, None),
                                       (1, 4097, 1, 2, None, None), (1, 300, 16, 32, None, "split_o"),
                                       (2, 1000, 2, 4, 16, "split_o"), (1, 4097, 1, 2, None, "split_o")]:
        x = inputs(B, L, Hk, Hv, seed=L)
        o, ht = gdn_chunk_prefill_cuda(*x, dv_split=split, variant=var)
        o_ref, ht_ref = gdn_prefill_recurrent_f64(*x)
        eo = ((o.double() - o_ref).norm() / o_ref.norm()).item()
        es = ((ht.double() - ht_ref).norm() / ht_ref.norm()).item()
        fin = bool(torch.isfinite(o).all() and torch.isfinite(ht).all())
        print(f"B={B} L={L:5d} Hk={Hk:2d} Hv={Hv:2d} split={split} {var or 'default'}  {eo:.2e}  {es:.2e}  "
              f"finite={fin}")


def _graph_fn(fn):
    """fn captured in a CUDA graph (after a warm-up that compiles); returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def bench(splits, paths, graph, sizes=None):
    import triton.testing
    rows = []
    for (B, L) in sizes or list(ANCHORS):
        fqla, fla = ANCHORS.get((B, L), (float("nan"), float("nan")))
        nsets = max(2, min(8, (1 << 30) // (B * L * 32 * 128 * 2 * 3)))
        sets = [inputs(B, L, seed=i) for i in range(nsets)]
        auto = choose_dv_split(B * 32, torch.device("cuda"))
        for path in paths:
            kw = {"auto": {}, "fused": {"fused": True}, "split": {"fused": False},
                  "noseg": {"fused": False, "segments": False},
                  "split_o": {"variant": "split_o"}, "split_o_auto": {"variant": "split_o"}}[path]
            for split in splits:
                if path == "auto" and split != auto:
                    continue
                if split == 16 and path != "split_o":  # DVS 16 exists in the split_o kernels only
                    continue
                if path == "split_o_auto":  # once, with the variant's own choice
                    if split != splits[0]:
                        continue
                    split = None
                if graph:  # one graph per input set, replayed in turn
                    reps = [_graph_fn(lambda x=x: gdn_chunk_prefill_cuda(*x, dv_split=split, **kw))
                            for x in sets]
                    it = iter(range(10 ** 9))
                    fn = lambda: reps[next(it) % nsets]()  # noqa: E731
                else:
                    it = iter(range(10 ** 9))
                    fn = lambda: gdn_chunk_prefill_cuda(*sets[next(it) % nsets], dv_split=split,  # noqa: E731
                                                        **kw)
                fn()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                rows.append(dict(B=B, L=L, path=path, split=split, graph=graph, ms=round(ms, 4),
                                 flashqla=fqla, fla=fla))
        sets = None
    print(f"{'B':>2} {'L':>6} {'path':>12} {'split':>5} {'ms':>8} {'vs FlashQLA':>11} {'vs fla':>7}")
    for r in rows:
        print(f"{r['B']:>2} {r['L']:>6} {r['path']:>12} {str(r['split']):>5} {r['ms']:8.4f} "
              f"{r['ms'] / r['flashqla']:11.2f} {r['ms'] / r['fla']:7.2f}")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--splits", default="32,64,128")
    ap.add_argument("--paths", default="auto")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--sizes", help="BxL,... (default: the anchor sizes), e.g. 1x64,1x512,8x1024")
    ap.add_argument("--prep-heads", help="value heads per prep block to try, e.g. 1,2 (default: the launcher's choice)")
    ap.add_argument("--define-sets", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0))
    if args.check and not args.define_sets:
        check()
    sizes = [tuple(int(v) for v in bl.split("x")) for bl in args.sizes.split(",")] if args.sizes else None
    import qwen35_fast.kernels.gdn_prefill.launch as launch_mod
    rows = []
    for dset in args.define_sets.split(";"):
        defs = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in dset.split(",") if kv}
        launch_mod.EXTRA_DEFINES.clear()
        launch_mod.EXTRA_DEFINES.update(defs)
        if args.define_sets:
            print(f"extra defines: {defs or 'none'}")
            if args.check:
                check()
        for hpb in (args.prep_heads.split(",") if args.prep_heads else [None]):
            launch_mod.PREP_HPB = None if hpb is None else int(hpb)
            if hpb is not None:
                print(f"prep kernel: {hpb} value head(s) per block")
            for r in bench([int(s) for s in args.splits.split(",")], args.paths.split(","), args.graph, sizes):
                rows.append({**r, "prep_heads": launch_mod.PREP_HPB, "defines": defs})
    launch_mod.EXTRA_DEFINES.clear()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
