"""The RMSNorms (kernels/rms_norm) against what they replace: the PyTorch expression of the model code
(reference.py) and torch's own F.rms_norm, at the 9B model's shapes (bf16, 4,096 tokens), CUDA-graph
replays, median ms; with bytes over the measured copy bandwidth as the floor. Writes JSON.

    python3 bench/norm.py [--out bench/results/norm-h200.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.rms_norm.launch import gated_rms_norm_cuda, rms_norm_cuda
from qwen35_fast.kernels.rms_norm.reference import gated_rms_norm_ref, rms_norm_ref

from gdn import bench_ms, ceilings, graph_of

DEV = "cuda"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/norm-h200.json")
    a = ap.parse_args()
    bw, _ = ceilings()
    torch.manual_seed(0)
    T, hidden, Hv, dv, H, hd = 4096, 4096, 32, 128, 16, 256
    x = torch.randn(1, T, hidden, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(hidden, device=DEV) * 0.1
    o = torch.randn(1, T, Hv, dv, device=DEV, dtype=torch.bfloat16)
    z = torch.randn(1, T, Hv, dv, device=DEV, dtype=torch.bfloat16)
    wn = torch.rand(dv, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(1, T, H, hd, device=DEV, dtype=torch.bfloat16)
    wq = torch.randn(hd, device=DEV) * 0.1
    cases = {
        "hidden norm [4096 x 4096]": (x, lambda: rms_norm_cuda(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6),
                                      lambda: F.rms_norm(x, (hidden,), (1 + w).to(x.dtype), 1e-6)),
        "q norm [4096 x 16 x 256]": (q, lambda: rms_norm_cuda(q, wq, 1e-6), lambda: rms_norm_ref(q, wq, 1e-6),
                                     lambda: F.rms_norm(q, (hd,), (1 + wq).to(q.dtype), 1e-6)),
        "GDN gated norm [4096 x 32 x 128]": (o, lambda: gated_rms_norm_cuda(o, z, wn, 1e-6),
                                             lambda: gated_rms_norm_ref(o, z, wn, 1e-6), None),
    }
    rows = []
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    print("| case | ours ms | PyTorch expression ms | F.rms_norm ms | floor ms |")
    print("| --- | --- | --- | --- | --- |")
    for name, (t, ours, expr, torch_fused) in cases.items():
        nbytes = t.numel() * t.element_size() * (3 if "gated" in name else 2)
        ms = {}
        for impl, fn in (("ours", ours), ("expression", expr), ("F.rms_norm", torch_fused)):
            if fn is None:
                ms[impl] = None
                continue
            g = graph_of(fn)
            ms[impl] = round(bench_ms(g.replay), 5)
        row = {"case": name, "ms_graph": ms, "floor_ms": round(nbytes / bw * 1e3, 5)}
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        print(f"| {name} | {fmt(ms['ours'])} | {fmt(ms['expression'])} | {fmt(ms['F.rms_norm'])} | "
              f"{row['floor_ms']:.4f} |")
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_TBps": round(bw / 1e12, 3), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
