"""GDN kernels on the GPU in hand, side by side with the peers, in one run.

    python bench/gdn.py [--out bench/results/gdn-h200.json] [--no-peers] [--budget-s 420]

Measures, in the same run: the card's copy bandwidth (bytes read + written) and bf16 matmul rate;
the chunked prefill of ours (kernels/gdn_prefill/launch.py: the plan's choice on this card as "ours", and
the portable path forced and built as the RTX cards get it, compute_80 PTX, as "ours-portable"), fla's Triton path (FLA_FLASH_QLA=0) and
FlashQLA on Qwen3.5-9B GDN shapes (16 q/k heads, 32 v heads, dim 128, bf16, initial and final
state), eager from Python and as CUDA-graph replay, with a roofline floor per row; our decode step's
state bandwidth at N = 8, 64, 256; our causal conv1d. Writes a JSON list of rows and prints a table.

The peers take the log-decay g and beta precomputed (as in ../shared/anchors/gdn_anchors.py); ours
takes the raw projections a, b and computes gates inside. Peers that are not installed, or ours
when it is not there yet, are reported as missing and the rest still runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's own Triton kernels, not its FlashQLA route

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _import  # noqa: E402,F401  (the repository as `qwen35_fast`)

DEV = "cuda"
HK, HV, D = 16, 32, 128
PREFILL_SIZES = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (8, 4096)]
DECODE_N = [8, 64, 256]
# other paths of gdn_chunk_prefill_cuda timed beside the default: the portable path (plan.py) as an sm_80-class
# card builds it (PTX for compute_80, which the driver finishes for this GPU; every block within 99 KB)
VARIANTS = {"portable": {"path": "portable", "arch": "compute_80"}}
PREFILL_IMPLS = ["ours"] + [f"ours-{v}" for v in VARIANTS] + ["fla", "flashqla"]
T0 = time.time()


# ----------------------------------------------------------------------------- timing

def bench_ms(fn, warmup_ms=50, rep_ms=300):
    """Median milliseconds of fn() between CUDA events (triton's do_bench when present)."""
    try:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t, 1e-6) * 1e3
    for _ in range(max(1, int(warmup_ms / one))):
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / one))):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def graph_of(fn):
    """fn captured in a CUDA graph (warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def ceilings():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    bw = 2 * n / (bench_ms(lambda: b.copy_(a)) * 1e-3)
    a = b = None  # frees the buffers (the lambda above is done with them)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    tf = 2 * 8192 ** 3 / (bench_ms(lambda: x @ y) * 1e-3)
    x = y = None
    torch.cuda.empty_cache()
    return bw, tf


def graph_replay_floor_ms(kernels=(1, 3)) -> dict:
    """Graph-replay ms of graphs holding 1 and 3 one-thread kernels, timed as the rows are: the part of a
    short prefill's graph time that is the replay and its kernel boundaries, not the kernels' work."""
    z = torch.zeros(1, device=DEV)
    out = {}
    for n in kernels:
        def tiny(n=n):
            for _ in range(n):
                z.add_(1)
        out[f"graph_{n}_tiny_kernels_ms"] = round(bench_ms(graph_of(tiny).replay), 4)
    return out


# ----------------------------------------------------------------------------- prefill implementations

def prefill_inputs(B, L, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, L, HK, D, dtype=torch.bfloat16, device=DEV, generator=g)
    k = torch.randn(B, L, HK, D, dtype=torch.bfloat16, device=DEV, generator=g)
    v = torch.randn(B, L, HV, D, dtype=torch.bfloat16, device=DEV, generator=g)
    a = torch.randn(B, L, HV, dtype=torch.bfloat16, device=DEV, generator=g)
    b = torch.randn(B, L, HV, dtype=torch.bfloat16, device=DEV, generator=g)
    A_log = torch.empty(HV, device=DEV).uniform_(1, 16, generator=g).log()
    dt_bias = torch.ones(HV, device=DEV)
    h0 = torch.randn(B, HV, D, D, device=DEV, generator=g) * 0.1
    from qwen35_fast.kernels.gdn_prefill.reference import gate_and_beta
    gl, beta = gate_and_beta(a, b, A_log, dt_bias)
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, h0=h0, g=gl, beta=beta.to(torch.bfloat16))


def load_impls(chosen):
    """The prefill implementations named in `chosen` that import here, and why the others did not; a peer
    left out of `chosen` is never imported."""
    impls, missing = {}, {}
    if any(n.startswith("ours") for n in chosen):
        try:
            from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda as ours

            def run_ours(x):
                return ours(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["h0"], None)
            impls["ours"] = run_ours
            for var, kw in VARIANTS.items():
                def run_var(x, kw=kw):
                    return ours(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["h0"], None,
                                **kw)
                impls[f"ours-{var}"] = run_var
        except Exception as e:
            missing["ours"] = f"{type(e).__name__}: {str(e)[:200]}"
            for var in VARIANTS:
                missing[f"ours-{var}"] = missing["ours"]
    if "fla" in chosen:
        try:
            import fla.ops.gated_delta_rule as fgdr

            def run_fla(x):
                return fgdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                   initial_state=x["h0"], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
            impls["fla"] = run_fla
        except Exception as e:
            missing["fla"] = f"{type(e).__name__}: {str(e)[:200]}"
    if "flashqla" in chosen:
        try:
            from flash_qla import chunk_gated_delta_rule as fq

            def run_flashqla(x):
                return fq(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
            impls["flashqla"] = run_flashqla
        except Exception as e:
            missing["flashqla"] = f"{type(e).__name__}: {str(e)[:200]}"
    return ({n: f for n, f in impls.items() if n in chosen},
            {n: why for n, why in missing.items() if n in chosen})


def kernel_breakdown(f, x, reps=5):
    """GPU milliseconds of each kernel one call of ours launches (CUDA events around every launch,
    median over reps; eager, warm L2): where the time of the prep / sequential / output kernels goes."""
    import qwen35_fast.kernels.gdn_prefill.launch as L
    orig_launch, orig_get = L.launch, L.get_function
    names, rec, per = {}, [], {}

    def get_function(src, name, dev, defines=None, **kw):
        fn = orig_get(src, name, dev, defines, **kw)
        names[id(fn)] = name
        return fn

    def launch(fn, grid, block, args, shared_mem=0):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        orig_launch(fn, grid, block, args, shared_mem=shared_mem)
        e.record()
        rec.append((names.get(id(fn), "?"), s, e))

    L.launch, L.get_function = launch, get_function
    try:
        for _ in range(reps):
            rec.clear()
            f(x)
            torch.cuda.synchronize()
            for name, s, e in rec:
                per.setdefault(name, []).append(s.elapsed_time(e))
    finally:
        L.launch, L.get_function = orig_launch, orig_get
    return {k: round(sorted(v)[len(v) // 2], 4) for k, v in per.items()}


def prefill_cost(B, L):
    """Fewest bytes (inputs read once, output and states once) and a chunked-form FLOP count
    (chunk 64; the same count as ../shared/anchors/gdn_anchors.py)."""
    tok = B * L * (2 * HK * D * 2 + HV * D * 2 + 2 * HV * 2 + HV * D * 2)
    nbytes = tok + 2 * B * HV * D * D * 4
    flops = B * L * HV * 2 * (64 * D * 2 + 64 * D * 2 + D * D * 4)
    return nbytes, flops


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def accuracy(impls, L=300):
    """Each implementation against the float64 recurrence of the inputs it was given: ours forms beta from b in
    fp32; the peers are handed beta rounded to bf16 (prefill_inputs), so theirs is the recurrence of that beta
    (b = logit(beta) in float64), and the rounding of their input is not counted as their error."""
    from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_recurrent_f64
    x = prefill_inputs(1, L, seed=1)
    beta = x["beta"].double()
    refs = {b: gdn_prefill_recurrent_f64(x["q"], x["k"], x["v"], x["a"], bv, x["A_log"], x["dt_bias"], x["h0"])
            for b, bv in (("fp32 from b", x["b"]), ("bf16 as given", beta.log() - (-beta).log1p()))}
    out = {}
    for name, f in impls.items():
        try:
            o, S = f(x)
            torch.cuda.synchronize()
            given = "fp32 from b" if name.startswith("ours") else "bf16 as given"
            o_ref, S_ref = refs[given]
            out[name] = {"out_rel": float(f"{rel(o, o_ref):.3e}"), "state_rel": float(f"{rel(S, S_ref):.3e}"),
                         "beta": given}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"accuracy {name}: {out[name]}", flush=True)
    return out


# ----------------------------------------------------------------------------- decode and conv1d

def decode_rows(bw):
    from qwen35_fast.kernels.gdn_decode.launch import gdn_decode_step_cuda
    rows = []
    for N in DECODE_N:
        state_bytes = N * HV * D * D * 4
        copies = max(1, math.ceil(256 * 2 ** 20 / state_bytes))  # > L2 (50 MB) between reuses of one state
        g = torch.Generator(device=DEV).manual_seed(N)
        sets = []
        for _ in range(copies):
            sets.append(dict(q=torch.randn(N, HK, D, dtype=torch.bfloat16, device=DEV, generator=g),
                             k=torch.randn(N, HK, D, dtype=torch.bfloat16, device=DEV, generator=g),
                             v=torch.randn(N, HV, D, dtype=torch.bfloat16, device=DEV, generator=g),
                             a=torch.randn(N, HV, dtype=torch.bfloat16, device=DEV, generator=g),
                             b=torch.randn(N, HV, dtype=torch.bfloat16, device=DEV, generator=g),
                             state=torch.randn(N, HV, D, D, device=DEV, generator=g) * 0.1))
        A_log = torch.rand(HV, device=DEV) + 0.5
        dt_bias = torch.ones(HV, device=DEV)

        def step_all():
            for s in sets:
                gdn_decode_step_cuda(s["q"], s["k"], s["v"], s["a"], s["b"], A_log, dt_bias, s["state"])

        moved = 2 * state_bytes + N * (2 * HK * D + 2 * HV * D + 2 * HV) * 2
        ms_eager = bench_ms(step_all) / copies
        try:
            graph = graph_of(step_all)
            ms_graph, note = bench_ms(graph.replay) / copies, None
        except Exception as e:
            ms_graph, note = None, f"capture failed: {type(e).__name__}: {str(e)[:160]}"
        best = ms_graph if ms_graph is not None else ms_eager
        row = {"impl": "ours-decode", "N": N, "Hk": HK, "Hv": HV, "D": D, "ms_eager": round(ms_eager, 5),
               "ms_graph": None if ms_graph is None else round(ms_graph, 5), "bytes": moved,
               "GBps": round(moved / (best * 1e-3) / 1e9, 1), "frac_of_copy_bw": round(moved / (best * 1e-3) / bw, 3),
               "floor_ms": round(moved / bw * 1e3, 5), "state_copies_rotated": copies}
        if note:
            row["note"] = note
        print(json.dumps(row), flush=True)
        rows.append(row)
        sets = None
        torch.cuda.empty_cache()
    return rows


def conv_rows(bw):
    from qwen35_fast.kernels.conv1d.launch import causal_conv1d_prefill_cuda, causal_conv1d_update_cuda
    C, W = 2 * 2048 + 4096, 4
    rows = []
    for B, L in [(1, 4096), (1, 32768), (8, 4096)]:
        x = torch.randn(B, L, C, dtype=torch.bfloat16, device=DEV)
        w = torch.randn(C, W, dtype=torch.bfloat16, device=DEV)
        bias = torch.randn(C, dtype=torch.bfloat16, device=DEV)
        h0 = torch.randn(B, C, W - 1, dtype=torch.bfloat16, device=DEV)
        f = lambda: causal_conv1d_prefill_cuda(x, w, bias, h0)  # noqa: E731
        moved = 2 * x.numel() * 2
        ms = bench_ms(f)
        try:
            ms_graph = bench_ms(graph_of(f).replay)
        except Exception:
            ms_graph = None
        best = ms_graph or ms
        row = {"impl": "ours-conv1d-prefill", "B": B, "L": L, "C": C, "ms_eager": round(ms, 5),
               "ms_graph": None if ms_graph is None else round(ms_graph, 5),
               "GBps": round(moved / (best * 1e-3) / 1e9, 1), "floor_ms": round(moved / bw * 1e3, 5)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    for N in [8, 64, 256]:
        x = torch.randn(N, C, dtype=torch.bfloat16, device=DEV)
        st = torch.randn(N, C, W - 1, dtype=torch.bfloat16, device=DEV)
        f = lambda: causal_conv1d_update_cuda(x, st, w, bias)  # noqa: E731
        ms = bench_ms(f)
        ms_graph = bench_ms(graph_of(f).replay)
        row = {"impl": "ours-conv1d-update", "N": N, "C": C, "ms_eager": round(ms, 5), "ms_graph": round(ms_graph, 5)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- main

def _kms(r):
    k = r.get("kernels_ms")
    if not isinstance(k, dict):
        return str(k or "")
    return " ".join(f"{n.replace('gdn_chunk_', '')} {v:.3f}" for n, v in k.items())


def table(rows):
    lines = ["| impl | B | L | ms eager | ms graph | floor ms | graph (or eager) / floor | note or kernel ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("impl") in PREFILL_IMPLS:
            best = r.get("ms_graph") or r.get("ms_eager")
            ratio = f"{best / r['floor_ms']:.1f}" if best else "—"
            fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
            lines.append(f"| {r['impl']} | {r['B']} | {r['L']:,} | {fmt(r.get('ms_eager'))} | {fmt(r.get('ms_graph'))} "
                         f"| {r['floor_ms']:.3f} | {ratio} | {r.get('note', r.get('error', _kms(r)))[:80]} |")
    lines += ["", "| decode N | ms eager | ms graph | GB/s | of copy BW |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("impl") == "ours-decode":
            lines.append(f"| {r['N']} | {r['ms_eager']:.4f} | {r['ms_graph'] if r['ms_graph'] is not None else '—'} "
                         f"| {r['GBps']:,} | {100 * r['frac_of_copy_bw']:.0f}% |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gdn-h200.json"))
    ap.add_argument("--no-peers", action="store_true", help="time ours only")
    ap.add_argument("--budget-s", type=float, default=420, help="skip the remaining prefill rows after this long")
    ap.add_argument("--impls", default=",".join(PREFILL_IMPLS),
                    help="the prefill implementations to time (a comma-separated subset); with a subset the decode "
                         "and conv1d rows are left out")
    args = ap.parse_args()
    chosen = [n for n in PREFILL_IMPLS if n in args.impls.split(",")]
    if not chosen:
        ap.error(f"--impls names none of {', '.join(PREFILL_IMPLS)}")
    rows = []

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")

    bw, tf = ceilings()
    info = {"impl": "ceilings", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "copy_TBps": round(bw / 1e12, 3), "bf16_TFLOPs": round(tf / 1e12, 1), **graph_replay_floor_ms()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(info), flush=True)
    rows.append(info)
    save()

    for name, fn in (("decode", decode_rows), ("conv1d", conv_rows)) if len(chosen) == len(PREFILL_IMPLS) else ():
        try:
            rows.extend(fn(bw))
        except Exception as e:
            traceback.print_exc()
            rows.append({"impl": f"ours-{name}", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        save()

    impls, missing = load_impls([n for n in chosen if n.startswith("ours") or not args.no_peers])
    for name, why in missing.items():
        print(f"{name}: missing ({why})", flush=True)
    info["accuracy_L300"] = accuracy(impls)
    info["accuracy_L4096"] = accuracy(impls, 4096)  # long enough for the sequence split
    save()

    for B, L in PREFILL_SIZES:
        nbytes, flops = prefill_cost(B, L)
        floor = max(nbytes / bw, flops / tf) * 1e3
        x = prefill_inputs(B, L)
        for name in chosen:
            row = {"impl": name, "B": B, "L": L, "ms_eager": None, "ms_graph": None, "floor_ms": round(floor, 4),
                   "floor_bytes_ms": round(nbytes / bw * 1e3, 4), "floor_flops_ms": round(flops / tf * 1e3, 4)}
            if name not in impls:
                row["note"] = "missing: " + missing.get(name, "not run")
            elif time.time() - T0 > args.budget_s:
                row["note"] = "skipped: benchmark time budget spent"
            else:
                f = impls[name]
                try:
                    f(x)
                    torch.cuda.synchronize()
                    row["ms_eager"] = round(bench_ms(lambda: f(x)), 4)
                    row["tok_per_s"] = round(B * L / row["ms_eager"] * 1e3)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if row["ms_eager"] is not None and name.startswith("ours"):
                    try:
                        row["kernels_ms"] = kernel_breakdown(f, x)
                    except Exception as e:
                        row["kernels_ms"] = f"{type(e).__name__}: {str(e)[:160]}"
                if row["ms_eager"] is not None:
                    try:
                        row["ms_graph"] = round(bench_ms(graph_of(lambda: f(x)).replay), 4)
                    except Exception as e:
                        row["note"] = f"cannot be captured in a CUDA graph: {type(e).__name__}: {str(e)[:160]}"
                        torch.cuda.synchronize()
            print(json.dumps(row), flush=True)
            rows.append(row)
            save()
        x = None
        torch.cuda.empty_cache()

    print()
    print(f"{info['gpu']}: copy {info['copy_TBps']} TB/s, bf16 matmul {info['bf16_TFLOPs']} TFLOP/s, graph replay "
          f"of 1 / 3 tiny kernels {info['graph_1_tiny_kernels_ms']} / {info['graph_3_tiny_kernels_ms']} ms")
    print(table(rows))
    save()


if __name__ == "__main__":
    main()
