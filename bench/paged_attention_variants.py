"""Development timing of paged attention launch choices (not what users run), 9B shape, CUDA-graph replays:
the shared-memory carveout (driver default vs all shared) on decode and prefill shapes.

    python3 bench/paged_attention_variants.py [--out bench/results/paged-variants-h200.json]
"""
import argparse
import json

import torch
from paged_attention import DEV, HKV, D, H, graph_ms, paged_setup

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.paged_attention import launch as pa


def time_case(Nq, Nkv, bs, gen):
    qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
    kn = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k_pool, v_pool, tables = paged_setup(Nq, Nkv, bs, 1, True, gen)
    cl = torch.tensor([Nkv], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)
    return graph_ms([lambda: pa.paged_attention_cuda(qg[..., :D], kn, kn, k_pool, v_pool, tables[0], cl, cu,
                                                     qg[..., D:], Nq)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/paged-variants-h200.json")
    a = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    occupancy = {}
    try:  # blocks per SM the driver's occupancy calculator allows, per carveout (the kernels are built above)
        from cupy_backends.cuda.api import driver

        from qwen35_fast.kernels.cuda_build import get_function
        for wm in (1, 4):
            for carve in (-1, 100):
                fn = get_function(pa.SRC, "paged_attention_fwd", DEV, {"HEAD_DIM": D, "GROUP": H // HKV, "WARPS_M": wm,
                                                                        "BLOCK_SIZE": 16, "SPLIT": 1, "GATE": 1})
                smem = pa.smem_bytes(wm, D)
                fn.max_dynamic_shared_size_bytes = smem
                fn.preferred_shared_memory_carveout = carve
                occupancy[f"warps_m={wm}, carveout={carve}"] = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    fn.kernel.ptr, 32 * wm, smem)
    except Exception as e:  # noqa: BLE001 - informative only
        occupancy["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(occupancy), flush=True)
    for Nq, Nkv in ((1, 65536), (16, 65536), (1, 16384), (256, 65536), (4096, 16384)):
        row = {"Nq": Nq, "Nkv": Nkv, "block": 16}
        for carve in (-1, 100, -1, 100):  # twice each: the spread between repeats is the noise
            pa.CARVEOUT = carve
            row.setdefault(f"ms_carveout_{carve}", []).append(round(time_case(Nq, Nkv, 16, gen), 5))
        rows.append(row)
        print(json.dumps(row), flush=True)
    pa.CARVEOUT = 100
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "occupancy_blocks_per_sm": occupancy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
