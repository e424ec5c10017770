"""The PyTorch GDN prefill (kernels/gdn_prefill/reference.gdn_prefill_chunked, the path of cards the kernels do
not run on) at several segment lengths: the time of one 9B-shaped layer's call and the memory it holds beyond its
inputs and output, and the aten operations it runs (each one launch from Python on a GPU: a short segment is paid
for in host time there; the CPU does the same arithmetic in any segment length and runs the short one faster).

    python3 bench/gdn_reference_segment.py [--tokens 4096] [--segments 256 512 1024 2048 4096] [--out PATH]
"""
import argparse
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_chunked, segment_bytes


class OpCount(TorchDispatchMode):
    """Counts the aten operations run inside it: what an eager call launches (or dispatches, on the CPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--segments", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    Hk, Hv, D, T = 16, 32, 128, a.tokens  # the 9B's GDN layer
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(1, T, Hk, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, Hv, D, device=dev, generator=g, dtype=torch.bfloat16)
    ga, gb = (torch.randn(1, T, Hv, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    A_log = torch.rand(Hv, device=dev, generator=g).mul(15).add(1).log()
    dt_bias = torch.ones(Hv, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows, ref = [], None
    for seg in a.segments:
        call = lambda: gdn_prefill_chunked(q, k, v, ga, gb, A_log, dt_bias, segment=seg)  # noqa: E731
        o, _ = call()
        sync()
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            call()
            sync()
            times.append((time.perf_counter() - t0) * 1000)
        with OpCount() as count:
            call()
        row = {"segment": seg, "ms": round(sorted(times)[len(times) // 2], 2), "aten_ops": count.n,
               "segment_bytes": segment_bytes(Hv, D, D, seg)}
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            call()
            sync()
            row["peak_beyond_inputs_bytes"] = torch.cuda.max_memory_allocated() - base
        ref = o.float() if ref is None else ref
        row["max_abs_diff_vs_first"] = float((o.float() - ref).abs().max())
        rows.append(row)
        print(row)
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "host_cpu": host_cpu(),
           "torch": torch.__version__, "shape": {"T": T, "Hk": Hk, "Hv": Hv, "D": D, "dtype": "bf16"}, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
