"""The 27 x 1152 tower's MLP with its 4,304 intermediate features padded to 4,352 (a multiple of 128; zero
weights and bias in the padding give the same output), against 4,304 and, for scale, 4,224: fc1 (bias + tanh-GELU
epilogue) and fc2, each a CUDA graph of 10 calls back to back, at one image's, four images' and a video pass's
rows, ms a call (median of 7 replays). Development only; prints JSON (results/tower-mlp-pad-probe-h100.json).

    python3 bench/experiments/tower_mlp_pad_probe.py
"""
import json

import torch
import torch.nn.functional as F


def graph_ms(fn, reps=10, rounds=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def main():
    d, dev = 1152, torch.device("cuda")
    out = {"device": torch.cuda.get_device_name()}
    for m in (4096, 16384, 23040):
        x = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
        for width in (4304, 4352, 4224):
            w1 = torch.randn(width, d, device=dev, dtype=torch.bfloat16) * 0.02
            b1 = torch.zeros(width, device=dev, dtype=torch.bfloat16)
            w2 = torch.randn(d, width, device=dev, dtype=torch.bfloat16) * 0.02
            b2 = torch.zeros(d, device=dev, dtype=torch.bfloat16)
            h = torch._addmm_activation(b1, x, w1.t(), use_gelu=True)
            fc1 = graph_ms(lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True))
            fc2 = graph_ms(lambda: F.linear(h, w2, b2))
            out[f"{m}x{width}"] = {"fc1": round(fc1, 4), "fc2": round(fc2, 4), "sum": round(fc1 + fc2, 4)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
