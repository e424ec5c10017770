"""Development: one paged-attention case launched a few times, for Nsight Compute (the decode step's
bandwidth and the 256+-token prefill's speed are issue 15's open goals; kernels/paged_attention/NOTES.md
says what was guessed and measured so far). Run it under ncu on the GPU machine (Firecracker runtime):

    ncu --clock-control none --kernel-name 'regex:paged_attention_(fwd|decode|wg)$' --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section SchedulerStats --section SourceCounters \\
        python3 bench/paged_ncu.py [--nq 1] [--nkv 65536] [--block 64]

Without ncu it prints the plan and the median ms of a few eager launches.
"""
import argparse
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.paged_attention.launch import card_of, paged_attention_cuda, plan

from paged_attention import DEV, HKV, D, H, paged_setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--nkv", type=int, default=65536)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    k_pool, v_pool, tables = paged_setup(a.nq, a.nkv, a.block, 1, True, gen)
    q = torch.randn(a.nq, H, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(a.nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn_like(k_new)
    gate = torch.randn_like(q)
    lens = torch.tensor([a.nkv], dtype=torch.int32, device=DEV)
    cu_q = torch.tensor([0, a.nq], dtype=torch.int32, device=DEV)
    table = tables[0]
    card = card_of(DEV)
    print(plan(a.nq, 1, HKV, H // HKV, table.shape[1] * a.block, card.sms, wgmma=card.wgmma,
               smem_per_sm=card.smem_per_sm))
    times = []
    for _ in range(a.launches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        paged_attention_cuda(q, k_new, v_new, k_pool, v_pool, table, lens, cu_q, gate, max_q=a.nq, write_kv=False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"{a.nq} new over {a.nkv} cached, block {a.block}: median {sorted(times)[len(times) // 2]:.3f} ms "
          f"(eager, launch included)")


if __name__ == "__main__":
    main()
