"""Development sweep: the decode step at N sequences with its blocks per SM capped by padding dynamic shared
memory (fewer resident blocks -> later blocks read while earlier ones write), against a plain copy of the
same bytes. CUDA-graph replay of 16 rotated steps, like bench/gdn.py.

    python3 bench/decode_occupancy.py [N ...]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _import  # noqa: E402,F401

from qwen35_fast.kernels.gdn_decode import launch as DL  # noqa: E402

from gdn import bench_ms, graph_of  # noqa: E402

HK, HV, D, COPIES = 16, 32, 128, 16


def graph_ms(fn):
    return bench_ms(graph_of(fn).replay)


def main():
    dev = torch.device("cuda")
    orig = DL.launch
    for N in [int(x) for x in sys.argv[1:]] or [8]:
        gen = torch.Generator(device=dev).manual_seed(N)
        sets = [dict(q=torch.randn(N, HK, D, dtype=torch.bfloat16, device=dev, generator=gen),
                     k=torch.randn(N, HK, D, dtype=torch.bfloat16, device=dev, generator=gen),
                     v=torch.randn(N, HV, D, dtype=torch.bfloat16, device=dev, generator=gen),
                     a=torch.randn(N, HV, dtype=torch.bfloat16, device=dev, generator=gen),
                     b=torch.randn(N, HV, dtype=torch.bfloat16, device=dev, generator=gen),
                     state=torch.randn(N, HV, D, D, device=dev, generator=gen) * 0.1) for _ in range(COPIES)]
        A_log, dt_bias = torch.rand(HV, device=dev) + 0.5, torch.ones(HV, device=dev)
        nbytes = 2 * N * HV * D * D * 4
        dst = [torch.empty_like(s["state"]) for s in sets]
        ms = graph_ms(lambda: [d.copy_(s["state"]) for d, s in zip(dst, sets)]) / COPIES
        print(f"N={N}: torch copy of the state bytes {ms * 1e3:.2f} us ({nbytes / ms / 1e6:.0f} GB/s)")
        for pad_kb in (0, 20, 28, 36, 44, 56, 72, 110):
            def patched(fn, grid, block, args, shared_mem=0, pad=pad_kb * 1024):
                orig(fn, grid, block, args, shared_mem=pad)
            DL.launch = patched
            try:
                ms = graph_ms(lambda: [DL.gdn_decode_step_cuda(s["q"], s["k"], s["v"], s["a"], s["b"], A_log, dt_bias,
                                                                s["state"]) for s in sets]) / COPIES
            finally:
                DL.launch = orig
            print(f"N={N} pad {pad_kb:3d} KB: {ms * 1e3:.2f} us ({nbytes / ms / 1e6:.0f} GB/s)")


if __name__ == "__main__":
    main()
