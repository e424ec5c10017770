"""The decode kernel (kernels/paged_attention/paged_decode.cu) at the 9B shape (16 q / 4 kv heads, head dim
256, bf16, block 16, shuffled table): for 1 and 4 new tokens over 1K-64K cached keys, CUDA-graph ms per call
for each key split the plan could take, the plan's own choice, and where a call's time
goes (the attention kernel against the combine, from the profiler). Beside each context: a device copy that
moves as many bytes (read + written) as the kernel reads, timed the same way: what one launch moving that
many bytes reaches at that size (bench/paged_attention.py's same_bytes_copy).

    python3 bench/paged_decode_sweep.py [--out bench/results/paged-decode-sweep-h200.json]
        [--nq 1,4] [--nkv 1024,4096,16384,65536] [--kernels dec] [--splits 8,16,32,48,66,99,128]

--kernels: the kernels the sweep forces at each split ("dec", "mma", "wg"), e.g. `--nq 16 --kernels wg,mma`
for 16 new tokens (64 rows) on the two prefill kernels.
"""
import argparse
import json
import math

import torch
from torch.profiler import ProfilerActivity, profile

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.paged_attention.launch import card_of, paged_attention_cuda, plan

from gdn import ceilings, graph_of
from paged_attention import DEV, HKV, D, H, graph_ms, kv_copies, paged_setup, same_bytes_copy

NKVS = (1024, 4096, 16384, 65536)
NQS = (1, 4)
SPLITS = (8, 16, 32, 48, 66, 99, 128)  # the plan's choices on an H200: 32 (1K keys), 66 (longer)


def kernel_split(calls) -> dict:
    """GPU microseconds per call of each kernel the calls launch (profiler over a replayed graph)."""
    g = graph_of(lambda: [fn() for fn in calls])
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    reps = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.self_device_time_total / reps / len(calls), 2)
            for e in prof.key_averages() if e.self_device_time_total > 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/paged-decode-sweep-h200.json")
    ap.add_argument("--nq", default=",".join(map(str, NQS)))
    ap.add_argument("--nkv", default=",".join(map(str, NKVS)))
    ap.add_argument("--kernels", default="dec")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    a = ap.parse_args()
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    bw, _ = ceilings()
    card = card_of(DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, copies_out = [], []
    for Nkv in ints(a.nkv):
        kv_bytes = 2 * Nkv * HKV * D * 2
        copies = kv_copies(kv_bytes)
        copies_out.append(same_bytes_copy(kv_bytes, copies, bw))
        print(json.dumps(copies_out[-1]), flush=True)
        for Nq in ints(a.nq):
            qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
            kn = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            lens = torch.tensor([Nkv], dtype=torch.int32, device=DEV)
            cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)
            k_pool, v_pool, tables = paged_setup(Nq, Nkv, 16, copies, True, gen)
            p = plan(Nq, 1, HKV, H // HKV, math.ceil((Nkv + Nq) / 16) * 16, card.sms, wgmma=card.wgmma,
                     smem_per_sm=card.smem_per_sm)

            def calls(**kw):
                return [lambda t=t: paged_attention_cuda(qg[..., :D], kn, kn, k_pool, v_pool, t, lens, cu_q,
                                                         qg[..., D:], Nq, **kw) for t in tables]
            for kernel in a.kernels.split(","):
                for s in tuple(x for x in ints(a.splits) if x <= math.ceil(Nkv / 32)):
                    ms = graph_ms(calls(splits=s, kernel=kernel))
                    row = {"Nq": Nq, "Nkv": Nkv, "kernel": kernel, "splits": s, "ms": round(ms, 5),
                           "kv_copy_bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            ms = graph_ms(calls())
            row = {"Nq": Nq, "Nkv": Nkv, "plan": {"splits": p.splits, "kernel": p.kernel},
                   "ms": round(ms, 5), "kv_copy_bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3),
                   "us_per_kernel": kernel_split(calls())}
            rows.append(row)
            print(json.dumps(row), flush=True)
            k_pool = v_pool = tables = None
            torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "copy_TBps": round(bw / 1e12, 3), "shape": {"H": H, "Hkv": HKV, "D": D},
              "same_bytes_copy": copies_out, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
