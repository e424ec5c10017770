"""The decode step's projections: kernels/gemv against cuBLAS (F.linear) for one row on the GPU, and what it
does to CUDA-graph decode of the 9B-shaped model (bench/e2e.py's) at 4K tokens of context.

Per shape (the 9B and 4B projections and the 9B lm_head): one CUDA graph of `calls` products over weights
rotated through more bytes than L2 holds (every call streams its weight from HBM, as a decode step does),
replayed; ms per call and the weight bytes read per second; and for the shapes whose row groups are shared by
several warps (launch.split_of), the same with one warp a row group (ms_gemv_split1). Where the decode step
may fuse what comes before the product into it (ms_fused: the fused launch, forced, with the residual add and
RMSNorm staged, PRO 1, for the projections after a norm; silu(g) * u, PRO 2, for down), that launch against
the two it stands for (ms_apart: add_rms_norm or silu_mul, then the product with one warp a row group). Then
decode tok/s with the projections on cuBLAS and on gemv, in turn, twice. Writes bench/results/gemv-h200.json (or --out).

    python3 bench/gemv.py [--calls 24] [--reps 20] [--layers 32] [--no-decode] [--out PATH]
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.kernels.gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda, gemv_silu_mul_cuda, split_of
from qwen35_fast.kernels.rms_norm.launch import add_rms_norm_cuda
from qwen35_fast.kernels.silu_mul.launch import silu_mul_cuda

SHAPES = {  # name: (N, K)
    "9B in_proj (GDN)": (12352, 4096), "9B out_proj / o_proj": (4096, 4096), "9B qkv (attention)": (10240, 4096),
    "9B gate_up": (24576, 4096), "9B down": (4096, 12288), "9B lm_head": (248320, 4096),
    "4B in_proj (GDN)": (8288, 2560), "4B gate_up": (18432, 2560), "4B down": (2560, 9216),
    "4B out_proj": (2560, 4096),
    "2B in_proj (GDN)": (8224, 2048), "2B gate_up": (12288, 2048), "2B down": (2048, 6144),
    "0.8B in_proj (GDN)": (8224, 1024), "0.8B gate_up": (7168, 1024), "0.8B down": (1024, 3584),
}
# the products the decode step forms its input for: PRO 1 after the residual add and norm, PRO 2 for down
PRO = {"in_proj": 1, "qkv": 1, "gate_up": 1, "down": 2}
L2_ROTATION_BYTES = 512 << 20


def copy_rate() -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 10 / (time.perf_counter() - t0)


def per_call_ms(fn, weights, x, calls: int, reps: int) -> float:
    """ms per product in a graph of `calls` products over the rotated weights."""
    for w in weights[:2]:
        fn(x, w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            fn(x, weights[i % len(weights)])
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) / calls)
    return sorted(times)[len(times) // 2]


def kernel_rows(calls: int, reps: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = max(2, -(-L2_ROTATION_BYTES // nbytes))
        weights = [(torch.randn(N, K, generator=g, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        x = torch.randn(1, K, generator=g, device="cuda").bfloat16()
        ours = per_call_ms(gemv_cuda, weights, x, calls, reps)
        split = split_of(N, K, torch.cuda.get_device_properties(0).multi_processor_count)
        split1 = per_call_ms(lambda x, w: gemv_cuda(x, w, split=1), weights, x, calls, reps) if split > 1 else None
        cublas = per_call_ms(F.linear, weights, x, calls, reps)
        fused = apart = None
        pro = next((v for k, v in PRO.items() if f" {k}" in name), 0)
        if pro == 1:
            res, nw = torch.randn_like(x), torch.rand(K, generator=g, device="cuda").bfloat16()
            fused = per_call_ms(lambda x, w: gemv_add_rms_norm_cuda(res, x, nw, 1e-6, w, fuse=True), weights, x,
                                calls, reps)
            apart = per_call_ms(lambda x, w: gemv_cuda(add_rms_norm_cuda(res, x, nw, 1e-6)[1], w, split=1),
                                weights, x, calls, reps)
        elif pro == 2:
            gu = torch.randn(1, 2 * K, generator=g, device="cuda").bfloat16()
            fused = per_call_ms(lambda _, w: gemv_silu_mul_cuda(gu, w, fuse=True), weights, x, calls, reps)
            apart = per_call_ms(lambda _, w: gemv_cuda(silu_mul_cuda(gu), w, split=1), weights, x, calls, reps)
        err = float((gemv_cuda(x, weights[0]).float() - F.linear(x, weights[0]).float()).norm()
                    / F.linear(x, weights[0]).float().norm())
        row = {"shape": name, "N": N, "K": K, "split": split, "ms_gemv": round(ours, 5),
               "ms_gemv_split1": split1 and round(split1, 5), "ms_cublas": round(cublas, 5),
               "ms_fused": fused and round(fused, 5), "ms_apart": apart and round(apart, 5),
               "TBps_gemv": round(nbytes / ours / 1e9, 3), "TBps_cublas": round(nbytes / cublas / 1e9, 3),
               "rel_err_vs_cublas": err}
        rows.append(row)
        print(f"{name:24s} gemv {ours * 1000:8.1f} us {row['TBps_gemv']:5.2f} TB/s (split {split}"
              + (f"; split 1: {split1 * 1000:.1f} us" if split1 else "") + f") | cuBLAS {cublas * 1000:8.1f} us "
              f"{row['TBps_cublas']:5.2f} TB/s"
              + (f" | fused (PRO {pro}) {fused * 1000:.1f} us, apart {apart * 1000:.1f} us" if fused else ""))
        del weights
    return rows


def decode_rows(layers: int, context: int, steps: int) -> list[dict]:
    from qwen35_fast.runtime.model import Qwen35Model

    from e2e import decode_at_contexts, nine_b, random_weights_
    model = Qwen35Model(nine_b(layers), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    out = []
    for _ in range(2):
        for on in (False, True):
            model.set_decode_gemv(on)
            r = decode_at_contexts(model, [context], steps)[0]
            out.append({"projections": "gemv" if on else "cuBLAS", "context": context,
                        "decode_graph_tok_per_s": r["decode_graph_tok_per_s"]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--no-decode", action="store_true", help="the products only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gemv-h200.json"))
    a = ap.parse_args()
    rate = copy_rate()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
              "copy_TBps": round(rate / 1e12, 3), "rows": kernel_rows(a.calls, a.reps)}
    result["decode"] = [] if a.no_decode else decode_rows(a.layers, a.context, a.steps)
    for kind in ("cuBLAS", "gemv"):
        tps = [r["decode_graph_tok_per_s"] for r in result["decode"] if r["projections"] == kind]
        print(f"9B-shaped decode at {a.context} tokens, projections on {kind}: {tps} tok/s")
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
