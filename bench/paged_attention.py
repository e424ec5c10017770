"""Paged attention (kernels/paged_attention) at the 9B shape (16 q / 4 kv heads, head dim 256, bf16):
Nq new tokens after Nkv cached ones, causal over the new tokens, every cached one visible.

    ms_paged       our kernel, the block table shuffled over the pool
    ms_contiguous  the same kernel, the blocks in order
    ms_sdpa        PyTorch SDPA on contiguous [Nkv + Nq] keys with the lower-right causal mask, the fastest
                   backend that takes it (cuDNN, flash, memory-efficient; GQA native or K/V expanded beforehand)
Ours also stores the Nq new K/V in the pool and applies the sigmoid output gate; SDPA does neither.
"cold_prefill": a prompt with nothing cached (Nkv = 0), ours against SDPA with is_causal (cuDNN; what the
runtime runs there).
All timings are CUDA-graph replays of at least 4 calls (median ms per call); for small Nkv each graph cycles through several
copies of the K/V so that they do not sit in L2. For Nq <= 16 the row also gives the K/V bytes over the
measured copy bandwidth (read + written bytes of a 1 GiB device copy), and beside it what a device copy
moving as many bytes reaches in the same setup (same_bytes_copy_bw_fraction: one launch of 4 MB cannot
approach the 1 GiB rate, whatever it does). Writes JSON.

    python3 bench/paged_attention.py [--out bench/results/paged-h200.json]
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast.kernels.paged_attention.launch import card_of, paged_attention_cuda, plan

from gdn import bench_ms, ceilings

DEV = "cuda"
H, HKV, D = 16, 4, 256
NQS = (1, 16, 256, 1024, 4096)
NKVS = (1024, 4096, 16384, 65536)
BLOCKS = (16, 64)
L2_DEFEAT_BYTES = 256 << 20  # cycle through this much K/V per graph when one copy would fit in L2 (50 MB)

# a graph holds at least this many calls (the list repeated), so that the replay's own start (several us, paid
# once per decode step by the model's graph of hundreds of kernels) is not counted as one kernel's
MIN_CALLS_PER_GRAPH = 4


def kv_copies(kv_bytes: int) -> int:
    """Copies of a case's K/V a graph cycles through: L2_DEFEAT_BYTES of them (1K keys at the 9B shape: 64 copies
    of 4 MiB; L2 holds 50 MB)."""
    return max(1, math.ceil(L2_DEFEAT_BYTES / kv_bytes))


def graph_ms(calls):
    """Median ms of one call of `calls` (a list of closures, repeated up to MIN_CALLS_PER_GRAPH), all captured
    in one CUDA graph and replayed. The K/V rows pass lists that L2 cannot hold (kv_copies; a list shorter than
    four is one copy of >= 64 MB: a repeat reads it from memory again); the cold prefills are bound by compute."""
    calls = calls * math.ceil(MIN_CALLS_PER_GRAPH / len(calls))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    torch.cuda.synchronize()
    return bench_ms(g.replay, warmup_ms=20, rep_ms=120) / len(calls)


def same_bytes_copy(nbytes, copies, bw):
    """A device copy moving `nbytes` (read + written), graph-replayed over `copies` buffers as the kernels'
    K/V are: how near the measured copy bandwidth one launch of that size gets (short contexts: far)."""
    src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV) for _ in range(copies)]
    dst = [torch.empty_like(s) for s in src]
    ms = graph_ms([lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)])
    return {"Nkv_bytes": nbytes, "ms_copy": round(ms, 5), "copy_bw_fraction": round(nbytes / (ms * 1e-3) / bw, 3)}


def paged_setup(Nq, Nkv, bs, copies, shuffle, gen):
    """A pool holding `copies` sequences of Nkv cached tokens (+ room for Nq), one block table each."""
    need = math.ceil((Nkv + Nq) / bs)
    nb = need * copies
    k_pool = torch.randn(nb, bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v_pool = torch.randn(nb, bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(nb, device=DEV, generator=gen) if shuffle else torch.arange(nb, device=DEV)
    tables = [order[c * need:(c + 1) * need].to(torch.int32).view(1, need).contiguous() for c in range(copies)]
    return k_pool, v_pool, tables


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/paged-h200.json")
    ap.add_argument("--quick", action="store_true", help="Nkv 1024 and 65536 only")
    ap.add_argument("--cases", default="", help="only these NqxNkv, e.g. 1x65536,4096x16384 (no split sweep)")
    ap.add_argument("--cold", action="store_true", help="only the cold-prefill rows")
    a = ap.parse_args()
    only = {tuple(int(x) for x in c.split("x")) for c in a.cases.split(",") if c}
    t_start = time.time()
    bw, tf = ceilings()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s, bf16 matmul {tf / 1e12:.0f} TFLOP/s")
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, sdpa_notes = [], {}
    nkvs = () if a.cold else (1024, 65536) if a.quick else sorted({kv for _, kv in only}) if only else NKVS
    for Nkv in nkvs:
        kv_bytes = 2 * Nkv * HKV * D * 2
        copies = kv_copies(kv_bytes)
        same = same_bytes_copy(kv_bytes, copies, bw)["copy_bw_fraction"]
        for Nq in NQS:
            if only and (Nq, Nkv) not in only:
                continue
            qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
            q, gate = qg[..., :D], qg[..., D:]
            k_new = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            v_new = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            cache_lens = torch.tensor([Nkv], dtype=torch.int32, device=DEV)
            cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)
            sdpa_ms, sdpa_how = sdpa_time(Nq, Nkv, copies, q, gen)
            sdpa_notes[f"{Nq}x{Nkv}"] = sdpa_how
            for bs in BLOCKS:
                ms = {}
                for name, shuffle in (("paged", True), ("contiguous", False)):
                    k_pool, v_pool, tables = paged_setup(Nq, Nkv, bs, copies, shuffle, gen)
                    calls = [lambda t=t, kp=k_pool, vp=v_pool: paged_attention_cuda(q, k_new, v_new, kp, vp, t,
                                                                                    cache_lens, cu_q, gate, Nq)
                             for t in tables]
                    ms[name] = graph_ms(calls)
                    calls = k_pool = v_pool = tables = None  # frees the pool before the next one
                card = card_of(DEV)
                p = plan(Nq, 1, HKV, H // HKV, math.ceil((Nkv + Nq) / bs) * bs, card.sms, wgmma=card.wgmma,
                         smem_per_sm=card.smem_per_sm)
                row = {"Nq": Nq, "Nkv": Nkv, "block": bs, "ms_paged": round(ms["paged"], 5),
                       "ms_contiguous": round(ms["contiguous"], 5),
                       "ms_sdpa": None if sdpa_ms is None else round(sdpa_ms, 5),
                       "splits": p.splits, "warps_m": p.warps_m, "kernel": p.kernel}
                if Nq <= 16:
                    row["kv_copy_bw_fraction"] = round(kv_bytes / (ms["paged"] * 1e-3) / bw, 3)
                    row["same_bytes_copy_bw_fraction"] = same
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    sweep = {} if only or a.cold else decode_split_sweep(bw, gen)
    cold = [] if only else cold_prefill(gen)
    goals = {"partial_grid": sorted(only)} if only or a.cold else check_goals(rows)  # the goals speak of the whole grid
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": round(bw / 1e12, 3),
              "matmul_TFLOPs": round(tf / 1e12, 1), "shape": {"H": H, "Hkv": HKV, "D": D, "dtype": "bf16"},
              "rows": rows, "sdpa_backend": sdpa_notes, "decode_split_sweep": sweep, "cold_prefill": cold, "goals": goals,
              "seconds": round(time.time() - t_start, 1)}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("| Nq | Nkv | block | paged ms | contiguous ms | SDPA ms | copy-bw fraction |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sdpa = "-" if r["ms_sdpa"] is None else f"{r['ms_sdpa']:.4f}"
        print(f"| {r['Nq']} | {r['Nkv']} | {r['block']} | {r['ms_paged']:.4f} | {r['ms_contiguous']:.4f} | {sdpa} | "
              f"{r.get('kv_copy_bw_fraction', '')} |")
    print(json.dumps(goals, indent=1))
    print(json.dumps(sweep))


def sdpa_time(Nq, Nkv, copies, q, gen):
    """(ms, how) of the fastest SDPA backend on the contiguous keys, or (None, reasons)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    ks = [torch.randn(1, HKV, Nkv + Nq, D, device=DEV, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    vs = [torch.randn_like(k) for k in ks]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Nq, D]
    mask = causal_lower_right(Nq, Nkv + Nq)
    best, how, tried = None, None, []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in ("native", "expanded"):
            try:
                if gqa == "native":
                    kk, vv = ks, vs
                else:
                    kk = [k.repeat_interleave(H // HKV, 1) for k in ks]
                    vv = [v.repeat_interleave(H // HKV, 1) for v in vs]

                def call(k, v, backend=backend, gqa=gqa):
                    with sdpa_kernel([backend]):
                        if Nq == 1:  # one query sees every key: no mask needed
                            return F.scaled_dot_product_attention(qh, k, v, enable_gqa=gqa == "native")
                        return F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=gqa == "native")
                ms = graph_ms([lambda k=k, v=v: call(k, v) for k, v in zip(kk, vv)])
                tried.append(f"{backend.name}/{gqa}: {ms:.4f} ms")
                if best is None or ms < best:
                    best, how = ms, f"{backend.name}/{gqa}"
                del kk, vv
                break  # native GQA worked: expanding can only be slower
            except Exception as e:  # noqa: BLE001 - a backend that does not take the case
                tried.append(f"{backend.name}/{gqa}: {type(e).__name__}: {str(e)[:80]}")
    torch.cuda.empty_cache()
    return best, {"best": how, "tried": tried}


def decode_split_sweep(bw, gen):
    """Nq = 1 over 65,536 keys (block 16): ms and copy-bandwidth fraction per forced split count, on the decode
    kernel (the plan's) and on the one-warp mma.sync blocks it replaced ("mma")."""
    Nq, Nkv, bs = 1, 65536, 16
    kv_bytes = 2 * Nkv * HKV * D * 2
    k_pool, v_pool, tables = paged_setup(Nq, Nkv, bs, 1, True, gen)
    qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    cache_lens = torch.tensor([Nkv], dtype=torch.int32, device=DEV)
    cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)
    out = {}
    for kernel in ("dec", "mma"):
        for s in (16, 32, 64, 99, 128):
            ms = graph_ms([lambda: paged_attention_cuda(qg[..., :D], k_new, k_new, k_pool, v_pool, tables[0],
                                                        cache_lens, cu_q, qg[..., D:], Nq, splits=s, kernel=kernel)])
            out[f"{kernel} {s}"] = {"ms": round(ms, 5), "kv_copy_bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3)}
    return out


def cold_prefill(gen):
    """Nq tokens with nothing cached (block 64): ours (the K/V stored too) against SDPA with is_causal, GQA
    native, flash where it takes the call."""
    out = []
    for Nq in (1024, 4096, 16384, 32768):
        qg = torch.randn(Nq, H, 2 * D, device=DEV, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(2, Nq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        k_pool, v_pool, tables = paged_setup(Nq, 0, 64, 1, True, gen)
        zero = torch.zeros(1, dtype=torch.int32, device=DEV)
        cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=DEV)
        ours = graph_ms([lambda: paged_attention_cuda(qg[..., :D], kv[0], kv[1], k_pool, v_pool, tables[0], zero, cu_q,
                                                      qg[..., D:], Nq)])
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (qg[..., :D], kv[0], kv[1]))
        sdpa = graph_ms([lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)])
        row = {"Nq": Nq, "Nkv": 0, "ms_paged": round(ours, 5), "ms_sdpa_causal": round(sdpa, 5)}
        out.append(row)
        print(json.dumps(row), flush=True)
        k_pool = v_pool = tables = None
        torch.cuda.empty_cache()
    return out


def check_goals(rows):
    paged_vs_contig = max(r["ms_paged"] / r["ms_contiguous"] for r in rows)
    big = [r for r in rows if r["Nq"] >= 256]  # a row without an SDPA time (every backend failed) fails the goal
    small = [r for r in rows if r["Nq"] <= 16]
    return {
        "paged_le_1.1x_contiguous": paged_vs_contig <= 1.1, "worst_paged_over_contiguous": round(paged_vs_contig, 3),
        "paged_le_sdpa_for_Nq_ge_256": bool(big) and all(r["ms_sdpa"] is not None and r["ms_paged"] <= r["ms_sdpa"]
                                                         for r in big),
        "worst_paged_over_sdpa_Nq_ge_256": max((round(r["ms_paged"] / r["ms_sdpa"], 3) for r in big
                                                if r["ms_sdpa"] is not None), default=None),
        "Nq_ge_256_rows_without_sdpa": sum(r["ms_sdpa"] is None for r in big),
        "Nq_le_16_ge_70pct_copy_bw": all(r["kv_copy_bw_fraction"] >= 0.7 for r in small),
        "min_copy_bw_fraction_Nq_le_16": min(r["kv_copy_bw_fraction"] for r in small),
        "copy_bw_fraction_Nq_le_16_at_65536": [r["kv_copy_bw_fraction"] for r in small if r["Nkv"] == 65536],
        "same_bytes_copy_bw_fraction_by_Nkv": {r["Nkv"]: r["same_bytes_copy_bw_fraction"] for r in small},
    }


if __name__ == "__main__":
    main()
