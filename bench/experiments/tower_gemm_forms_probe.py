"""Does the vision tower's GEMM form matter? At the 27 x 1152 tower's shapes (rows of one image, four images and
a video pass), each projection timed as the tower calls it (F.linear with the bias: cuBLASLt's bias epilogue)
against the product without the bias (torch.mm: cuBLAS's own kernel choice) and torch.addmm with the bias
broadcast as C (beta 1). CUDA-graph replays of 20 calls, medians of alternating rounds. Development only: a
lever is worth building only where the bias-free product is clearly faster (the bias would then move into
the rotary kernel, or into the next projection's bias). Writes JSON.

    python3 bench/experiments/tower_gemm_forms_probe.py --out probe.json
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (3456, 1152), "proj": (1152, 1152), "fc2": (1152, 4304)}


def graph_ms(fn, calls=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)

    def once():
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / calls
    once()
    return once


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for m in (4096, 16384, 23040):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            forms = {"linear_bias": lambda: F.linear(x, w, bias), "mm": lambda: torch.mm(x, w.t()),
                     "addmm_broadcast": lambda: torch.addmm(bias.expand(m, n), x, w.t())}
            timers = {f: graph_ms(fn) for f, fn in forms.items()}
            got = {f: [] for f in forms}
            for _ in range(args.rounds):
                for f, t in timers.items():
                    got[f].append(t())
            ms = {f: round(statistics.median(v), 4) for f, v in got.items()}
            flop = 2 * m * n * k
            row = {"rows": m, "gemm": name, "n": n, "k": k, "ms": ms,
                   "tflops": {f: round(flop / v / 1e9, 1) for f, v in ms.items()},
                   "mm_over_linear": round(ms["mm"] / ms["linear_bias"], 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
