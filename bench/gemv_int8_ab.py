"""One token's product with int8 weights and a scale a row: kernels/gemv's Q8 form (what an int8 model's decode
step runs) against the path before it (runtime/quant.py linear: the matrix dequantized into bf16, then cuBLAS) and
against kernels/gemv on the same matrices in bf16 (a full-weights model's step), on the decode step's shapes
(bench/gemv.py SHAPES); and the int8 product with each split of its row groups forced (ms_int8_split1/2/4,
split_chosen: launch.split_of's pick). (The committed JSON's ms_int8_gemv and rel_err_vs_dequantized columns are the kernel's first form, with the
int-to-float conversion: bench/experiments/gemv_int8.cu in git history, commit 98a832e.) First right: the
kernel's output poisoned with NaN beforehand, against the dequantized product (relative error). Then fast: ms per product in a CUDA graph of `calls` products over
rotated copies of the weights (bench/gemv.py per_call_ms: no copy left in L2 between products) and the weight
bytes read per second against a device copy's rate. Writes bench/results/gemv-int8-ab-h200.json (or --out).

    python3 bench/gemv_int8_ab.py [--calls 40] [--reps 20] [--out PATH]
"""
import argparse
import json
from pathlib import Path

import torch
from gemv import L2_ROTATION_BYTES, SHAPES, copy_rate, per_call_ms

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.kernels.cuda_build import card_of
from qwen35_fast.kernels.gemv.launch import SPLITS, gemv_cuda, split_of
from qwen35_fast.kernels.gemv.launch import takes as gemv_takes
from qwen35_fast.runtime.quant import Int8Weight, linear, quantize_rows


def int8_weight(W: torch.Tensor) -> Int8Weight:
    w = Int8Weight(*W.shape, W.dtype, W.device)
    q, s = quantize_rows(W, W.dtype)
    w.q.data.copy_(q)
    w.scale.data.copy_(s)
    return w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gemv-int8-ab-h200.json"))
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rate = copy_rate()
    rows = []
    for name, (N, K) in SHAPES.items():
        W = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        w = int8_weight(W)
        x = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16)
        ref = linear(x[None], w)[0].float()
        assert gemv_takes(x, w.q, w.scale)
        poison = torch.full((N,), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison  # its block, NaN, is what the allocator hands the kernel's output next
        y = gemv_cuda(x, w.q, scale=w.scale)
        err = float((y.float() - ref).norm() / ref.norm())
        ok = bool(torch.isfinite(y).all()) and err < 1e-2
        copies = max(1, -(-L2_ROTATION_BYTES // (N * K)))  # int8 bytes; the bf16 copies hold twice as much
        ws8 = [w] + [int8_weight(W) for _ in range(copies - 1)]
        ws16 = [W] + [W.clone() for _ in range(max(0, -(-L2_ROTATION_BYTES // (2 * N * K)) - 1))]
        row = {"shape": name, "N": N, "K": K, "kernels_rel_err_vs_dequantized": round(err, 6), "ok": ok,
               "ms_bf16_gemv": per_call_ms(lambda x_, w_: gemv_cuda(x_, w_), ws16, x, a.calls, a.reps),
               "ms_int8_dequant_cublas": per_call_ms(lambda x_, w_: linear(x_[None], w_), ws8, x, a.calls, a.reps),
               "ms_int8_kernels": per_call_ms(lambda x_, w_: gemv_cuda(x_, w_.q, scale=w_.scale), ws8, x, a.calls,
                                              a.reps)}
        for s in SPLITS:  # each split of the row groups forced: what split_of's choice for int8 rests on
            row[f"ms_int8_split{s}"] = per_call_ms(lambda x_, w_, s=s: gemv_cuda(x_, w_.q, split=s, scale=w_.scale),
                                                   ws8, x, a.calls, a.reps)
        row["split_chosen"] = split_of(N, K, card_of(x.device).sms)
        row["int8_kernels_weight_TBps"] = round(N * K / (row["ms_int8_kernels"] * 1e-3) / 1e12, 3)
        rows.append(row)
        print(row, flush=True)
        del ws8, ws16, W, w
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
              "copy_TBps": round(rate / 1e12, 3), "rows": rows, "all_ok": all(r["ok"] for r in rows)}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    if not result["all_ok"]:
        raise SystemExit("gemv_int8: an output is NaN or off the dequantized product (see the rows)")


if __name__ == "__main__":
    main()
