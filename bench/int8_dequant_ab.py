"""An int8 matrix times its rows' scales in bf16 (what each matmul of an int8 model's prompt multiplies by,
runtime/quant.py linear): kernels/dequant's kernel against the PyTorch expression it replaces (torch.mul of the
int8 rows by the scales' column, one elementwise op), on the 9B's and 4B's matrices and the LM head's piece of
quant.DEQUANT_BYTES. First right: the kernel's output, NaN-poisoned beforehand, equal to the expression's bit for
bit. Then fast: ms a call in a CUDA graph of `calls` calls over copies of the matrix rotated through more bytes than
L2 holds (bench/gemv.py per_call_ms), and the bytes moved a second (one read, two written a weight) against a
device copy's rate. Writes bench/results/int8-dequant-ab-<card>.json (or --out).

    python3 bench/int8_dequant_ab.py [--calls 12] [--reps 15] [--out PATH]
"""
import argparse
import json
from pathlib import Path

import torch
from gemv import L2_ROTATION_BYTES, SHAPES, copy_rate, per_call_ms

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.kernels.dequant.launch import dequant_rows_cuda, takes
from qwen35_fast.kernels.dequant.reference import dequant_rows_ref
from qwen35_fast.runtime.quant import DEQUANT_BYTES


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="default: results/int8-dequant-ab-<card>.json, e.g. -h200")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rate = copy_rate()
    shapes = {name: nk for name, nk in SHAPES.items() if name.startswith(("9B", "4B"))}
    shapes["9B lm_head"] = (DEQUANT_BYTES // (2 * 4096), 4096)  # one piece of it, as linear makes them
    rows = []
    for name, (N, K) in shapes.items():
        q = torch.randint(-127, 128, (N, K), generator=g, device="cuda", dtype=torch.int8)
        s = (torch.rand(N, generator=g, device="cuda") * 0.05 / 127).bfloat16()
        assert takes(q, s)
        poison = torch.full((N, K), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison  # its block, NaN, is what the allocator hands the kernel's output next
        same = bool(torch.equal(dequant_rows_cuda(q, s).view(torch.int16), dequant_rows_ref(q, s).view(torch.int16)))
        mats = [(q, s)] + [(q.clone(), s.clone()) for _ in range(max(0, -(-L2_ROTATION_BYTES // (3 * N * K)) - 1))]
        row = {"shape": name, "N": N, "K": K, "bit_for_bit": same,
               "ms_torch": per_call_ms(lambda _, m: dequant_rows_ref(*m), mats, None, a.calls, a.reps),
               "ms_kernel": per_call_ms(lambda _, m: dequant_rows_cuda(*m), mats, None, a.calls, a.reps)}
        for k in ("torch", "kernel"):
            row[f"{k}_TBps"] = round(3 * N * K / (row[f"ms_{k}"] * 1e-3) / 1e12, 3)
        rows.append(row)
        print(row, flush=True)
        del mats, q, s
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpu": host_cpu(),
              "copy_TBps": round(rate / 1e12, 3), "rows": rows, "all_bit_for_bit": all(r["bit_for_bit"] for r in rows)}
    out = a.out or str(Path(__file__).parent / "results" /
                       f"int8-dequant-ab-{torch.cuda.get_device_name().split()[1].lower()}.json")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    if not result["all_bit_for_bit"]:
        raise SystemExit("int8_dequant_ab: the kernel's output differs from the expression's (see the rows)")


if __name__ == "__main__":
    main()
