"""Short appends over long contexts at the 9B shape (16 q / 4 kv heads, head dim 256, bf16, block 16, shuffled
table): 1 to 16 new tokens (4 to 64 rows) over 1K-64K cached keys, CUDA-graph ms per call of each kernel the
plan could take, each at the split count the plan gives it: the mma.sync kernel (1 / 2 / 4 warps of 16 rows),
the decode kernel with 1, 2 or 4 row tiles a block (paged_decode.cu ROW_TILES: the tiles of a block read one
key stream), and the plan's own choice. Then a split sweep of the four-tile decode block at 16 x 65,536, and,
with --ab-combine FILE (another paged_attention.cu, e.g. main's), the merge of the shares from that file
against this one's, alternating, on the plan's launches.

    python3 bench/paged_decode_tiles.py [--out bench/results/paged-decode-tiles-h200.json] [--ab-combine F]
"""
import argparse
import json
import math
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.paged_attention import launch as pa_launch
from qwen35_fast.kernels.paged_attention.launch import card_of, paged_attention_cuda, plan

from gdn import ceilings
from paged_attention import DEV, HKV, L2_DEFEAT_BYTES, D, H, graph_ms, paged_setup

NKVS = (1024, 4096, 16384, 65536)
NQS = (1, 2, 4, 5, 8, 12, 16)
SWEEP = (16, 22, 33, 44, 66, 99, 132)  # four-tile decode blocks: one per H200 SM is 33 shares of 4 kv heads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/paged-decode-tiles-h200.json")
    ap.add_argument("--ab-combine", default="", help="a paged_attention.cu whose combine kernel is timed against")
    a = ap.parse_args()
    bw, _ = ceilings()
    card = card_of(DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, ab = [], []
    for Nkv in NKVS:
        kv_bytes = 2 * Nkv * HKV * D * 2
        copies = max(1, min(8, math.ceil(L2_DEFEAT_BYTES / kv_bytes)))
        k_pool, v_pool, tables = paged_setup(16, Nkv, 16, copies, True, gen)
        for Nq in NQS:
            qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
            kn = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            lens = torch.tensor([Nkv], dtype=torch.int32, device=DEV)
            cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)
            cap = tables[0].shape[1] * 16

            def calls(**kw):
                return [lambda t=t: paged_attention_cuda(qg[..., :D], kn, kn, k_pool, v_pool, t, lens, cu_q,
                                                         qg[..., D:], Nq, **kw) for t in tables]

            def timed(name, **kw):
                ms = graph_ms(calls(**kw))
                row = {"Nq": Nq, "Nkv": Nkv, "variant": name, "ms": round(ms, 5),
                       "kv_copy_bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                return ms

            rows_q = Nq * (H // HKV)
            variants = [("mma", {"kernel": "mma"})] + [
                (f"dec{rt}", {"kernel": "dec", "row_tiles": rt}) for rt in (1, 2, 4)
                if rt == 1 or 16 * rt // 2 < rows_q]
            for name, kw in variants:
                p = plan(Nq, 1, HKV, H // HKV, cap, card.sms, wgmma=card.wgmma, smem_per_sm=card.smem_per_sm, **kw)
                timed(name, **kw)
                rows[-1]["plan"] = {"kernel": p.kernel, "row_tiles_a_block": p.warps_m, "splits": p.splits}
            p = plan(Nq, 1, HKV, H // HKV, cap, card.sms, wgmma=card.wgmma, smem_per_sm=card.smem_per_sm)
            timed("plan")
            rows[-1]["plan"] = {"kernel": p.kernel, "row_tiles_a_block": p.warps_m, "splits": p.splits}
            if Nq == 16 and Nkv == 65536:
                for s in SWEEP:
                    timed(f"dec4 splits {s}", kernel="dec", row_tiles=4, splits=s)
            if a.ab_combine and Nq in (1, 4, 16):
                here = pa_launch.SRC
                for rnd in range(2):
                    for name, src in (("this", here), ("other", Path(a.ab_combine))):
                        pa_launch.SRC = src  # the combine (and the mma.sync kernel) from that file
                        try:
                            ms = graph_ms(calls())
                        finally:
                            pa_launch.SRC = here
                        ab.append({"Nq": Nq, "Nkv": Nkv, "combine": name, "round": rnd, "ms": round(ms, 5)})
                        print(json.dumps(ab[-1]), flush=True)
        k_pool = v_pool = tables = None
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "copy_TBps": round(bw / 1e12, 3),
              "shape": {"H": H, "Hkv": HKV, "D": D, "block": 16}, "rows": rows, "combine_ab": ab}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
