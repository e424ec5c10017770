"""Tile and unroll variants of the decode and conv1d kernels, each checked and timed in one run
(graph replay, median), to pick the launchers' defaults. Prints one table.

    python bench/variants.py [--decode VTxTHREADS,... [--n 8,32]]   (--decode: only those decode tiles)
    python bench/variants.py --conv-chunks 16,8,4   (only the conv's least tokens per thread, at short lengths)
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _import  # noqa: E402,F401

from qwen35_fast.kernels.conv1d import launch as conv  # noqa: E402
from qwen35_fast.kernels.conv1d.reference import causal_conv1d_prefill_ref  # noqa: E402
from qwen35_fast.kernels.gdn_decode import launch as dec  # noqa: E402
from qwen35_fast.kernels.gdn_decode.reference import gdn_decode_step_ref  # noqa: E402

from gdn import bench_ms, ceilings, graph_of  # noqa: E402

DEV = "cuda"
HK, HV, D = 16, 32, 128


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def decode_sets(N, copies):
    return [dict(q=torch.randn(N, HK, D, dtype=torch.bfloat16, device=DEV),
                 k=torch.randn(N, HK, D, dtype=torch.bfloat16, device=DEV),
                 v=torch.randn(N, HV, D, dtype=torch.bfloat16, device=DEV),
                 a=torch.randn(N, HV, dtype=torch.bfloat16, device=DEV),
                 b=torch.randn(N, HV, dtype=torch.bfloat16, device=DEV),
                 state=torch.randn(N, HV, D, D, device=DEV) * 0.1) for _ in range(copies)]


def conv_chunks(mins: list[int]) -> None:
    """The conv prefill at prompt lengths of a short prefill (a question after a reused prefix, the 9B shape: x a
    channel slice of the in_proj output, an initial state) and longer, for each least chunk (MIN_CHUNK)."""
    C, W, wide = 8192, 4, 12352
    w = torch.randn(C, W, dtype=torch.bfloat16, device=DEV)
    init = torch.randn(1, C, W - 1, dtype=torch.bfloat16, device=DEV)
    xs = {L: torch.randn(1, L, wide, dtype=torch.bfloat16, device=DEV)[:, :, :C] for L in (64, 256, 1294, 4096)}
    for m in mins:
        conv.MIN_CHUNK = m
        res = []
        for L, x in xs.items():
            y, st = conv.causal_conv1d_prefill_cuda(x, w, None, init)
            y_ref, st_ref = causal_conv1d_prefill_ref(x, w, None, init)
            ok = torch.equal(st, st_ref) and (y.float() - y_ref.float()).abs().max().item() < 0.05
            ms = bench_ms(graph_of(lambda: conv.causal_conv1d_prefill_cuda(x, w, None, init)).replay)
            res.append(f"L={L}: {ms * 1e3:.2f} us ok={ok}")
        print(f"conv MIN_CHUNK={m} | " + " | ".join(res), flush=True)


def main():
    if "--conv-chunks" in sys.argv:
        conv_chunks([int(v) for v in sys.argv[sys.argv.index("--conv-chunks") + 1].split(",")])
        return
    bw, _ = ceilings()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    torch.manual_seed(0)
    A_log, dt_bias = torch.rand(HV, device=DEV) + 0.5, torch.ones(HV, device=DEV)
    lines = []
    cfgs = [(32, 128), (32, 256), (16, 64), (16, 128), (64, 256), (64, 128)]
    ns = (8, 64, 256)
    only_decode = "--decode" in sys.argv
    if only_decode:
        cfgs = [tuple(int(x) for x in c.split("x")) for c in sys.argv[sys.argv.index("--decode") + 1].split(",")]
        if "--n" in sys.argv:
            ns = tuple(int(x) for x in sys.argv[sys.argv.index("--n") + 1].split(","))
    sets = {N: decode_sets(N, max(1, (256 << 20) // (N * HV * D * D * 4))) for N in ns}
    for cfg in cfgs:
        dec.CONFIG = {"tiny": cfg, "small": cfg, "large": cfg}
        dec._fns.clear()
        s = decode_sets(3, 1)[0]
        st_ref = s["state"].clone()
        o_ref = gdn_decode_step_ref(s["q"], s["k"], s["v"], s["a"], s["b"], A_log, dt_bias, st_ref)
        o = dec.gdn_decode_step_cuda(s["q"], s["k"], s["v"], s["a"], s["b"], A_log, dt_bias, s["state"])
        ok = rel(s["state"], st_ref) < 1e-5 and rel(o, o_ref) < 1e-2
        res = []
        for N, ss in sets.items():
            def step_all():
                for x in ss:
                    dec.gdn_decode_step_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], A_log, dt_bias, x["state"])
            ms = bench_ms(graph_of(step_all).replay) / len(ss)
            res.append(f"N={N}: {ms * 1e3:.1f} us {2 * N * HV * D * D * 4 / (ms * 1e-3) / bw:.0%}")
        lines.append(f"decode VT,THREADS={cfg} ok={ok} | " + " | ".join(res))
        print(lines[-1], flush=True)
    if only_decode:
        return

    # host overhead of one eager decode call (CPU time per call while the GPU keeps up)
    dec.CONFIG = {"tiny": (32, 128), "small": (32, 128), "large": (32, 128)}
    x = sets[8][0]
    for _ in range(20):
        dec.gdn_decode_step_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], A_log, dt_bias, x["state"])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(500):
        dec.gdn_decode_step_cuda(x["q"], x["k"], x["v"], x["a"], x["b"], A_log, dt_bias, x["state"])
    host_us = (time.perf_counter() - t) / 500 * 1e6
    torch.cuda.synchronize()
    lines.append(f"decode eager host time per call: {host_us:.1f} us")
    print(lines[-1], flush=True)
    del sets

    C, W = 8192, 4
    xs = {L: torch.randn(1, L, C, dtype=torch.bfloat16, device=DEV) for L in (4096, 32768)}
    w = torch.randn(C, W, dtype=torch.bfloat16, device=DEV)
    bias = torch.randn(C, dtype=torch.bfloat16, device=DEV)
    for vec_bytes in (16, 8):
        for unroll in (4, 8, 16):
            conv.VEC_BYTES, conv.UNROLL = vec_bytes, unroll
            xt = torch.randn(1, 300, C, dtype=torch.bfloat16, device=DEV)
            init = torch.randn(3, C, W - 1, dtype=torch.bfloat16, device=DEV)
            cu = torch.tensor([0, 5, 200, 300], dtype=torch.int32, device=DEV)
            y, st = conv.causal_conv1d_prefill_cuda(xt, w, bias, init, cu)
            y_ref, st_ref = causal_conv1d_prefill_ref(xt, w, bias, init, cu)
            ok = torch.equal(st, st_ref) and (y.float() - y_ref.float()).abs().max().item() < 0.05
            res = []
            for L, x in xs.items():
                ms = bench_ms(graph_of(lambda: conv.causal_conv1d_prefill_cuda(x, w, bias, None)).replay)
                res.append(f"L={L}: {ms * 1e3:.1f} us {4 * x.numel() / (ms * 1e-3) / bw:.0%}")
            lines.append(f"conv VEC_BYTES={vec_bytes} UNROLL={unroll} ok={ok} | " + " | ".join(res))
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
