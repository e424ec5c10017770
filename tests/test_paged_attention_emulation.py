"""A CPU model of paged_attention.cu's decomposition, checked against the reference: the launch plan,
row tiles of (token, q head) rows per kv head (the longest first), each sequence's key tiles and their
split shares, the append ownership (each new token's K/V stored by exactly one block), the causal and
past-the-end masks, the exp2-domain online softmax with P rounded to bf16 per 32-key tile, the partial
outputs and log2-sum-exps, and the combine that skips empty shares. It runs where CI runs (no GPU), so a
change to the tiling or the split arithmetic is caught before a GPU run; the GPU tests check the kernel
itself against the same reference."""
import math
from collections import Counter

import pytest
import torch
from test_paged_attention import _ref, _rel, make_case

from qwen35_fast.kernels.paged_attention.launch import BN, plan

NEG_INF = float("-inf")


def emulate(a, splits=None, sm_count=132):
    """Runs the kernel's algorithm block by block in fp32 torch. Returns (out, appended) where appended
    counts the stores per (sequence, token, kv head)."""
    q, gate, k_new, v_new = a["q"], a["gate"], a["k_new"], a["v_new"]
    k_pool, v_pool, table = a["k_pool"], a["v_pool"], a["block_table"]
    T, H, D = q.shape
    nb, bs, Hkv, _ = k_pool.shape
    N, max_blocks = table.shape
    G = H // Hkv
    p = plan(a["max_q"], N, Hkv, G, max_blocks * bs, sm_count, splits)
    BM, S = 16 * p.warps_m, p.splits
    scale_log2 = D ** -0.5 * math.log2(math.e)
    kf, vf = k_pool.view(nb * bs, Hkv, D), v_pool.view(nb * bs, Hkv, D)
    o_part = torch.full((S, T, H, D), float("nan"))
    lse_part = torch.full((S, T, H), float("nan"))
    out = torch.full((T, H, D), float("nan"))
    appended = Counter()
    pool_reads = set()
    cu, lens = a["cu_q"].tolist(), a["cache_lens"].tolist()
    for z in range(S):
        for y in range(N * Hkv):
            n, kvh = divmod(y, Hkv)
            q0, nq, L = cu[n], cu[n + 1] - cu[n], lens[n]
            rows = nq * G
            for bx in range(p.row_tiles):
                r0 = (p.row_tiles - 1 - bx) * BM
                if r0 >= rows:
                    continue
                if z == 0:  # append: the tokens whose first row is in this tile
                    for t in range(-(-r0 // G), min(nq, -(-(r0 + BM) // G))):
                        pos = L + t
                        slot = int(table[n, pos // bs]) * bs + pos % bs
                        kf[slot, kvh] = k_new[q0 + t, kvh]
                        vf[slot, kvh] = v_new[q0 + t, kvh]
                        appended[(n, t, kvh)] += 1
                kv_end = L + (min(r0 + BM, rows) - 1) // G + 1
                ntiles = -(-kv_end // BN)
                per = -(-ntiles // S)
                j0, j1 = (z * per, min(ntiles, z * per + per)) if S > 1 else (0, ntiles)
                rr = torch.arange(r0, r0 + BM)
                valid = rr < rows
                tok = torch.clamp(rr, max=rows - 1) // G
                head = kvh * G + torch.clamp(rr, max=rows - 1) % G
                if j0 >= j1:
                    lse_part[z, q0 + tok[valid], head[valid]] = NEG_INF
                    continue
                qt = torch.where(valid[:, None], q[q0 + tok, head].float(), torch.zeros(1))  # zero-filled rows
                m = torch.full((BM,), NEG_INF)
                l = torch.zeros(BM)
                o = torch.zeros(BM, D)
                for j in range(j0, j1):
                    pos = torch.arange(j * BN, (j + 1) * BN)
                    kt, vt = torch.zeros(BN, D), torch.zeros(BN, D)
                    for i, pp in enumerate(pos.tolist()):
                        if pp < L:
                            slot = int(table[n, pp // bs]) * bs + pp % bs
                            pool_reads.add(slot // bs)
                            kt[i], vt[i] = kf[slot, kvh].float(), vf[slot, kvh].float()
                        elif pp < L + nq:
                            kt[i], vt[i] = k_new[q0 + pp - L, kvh].float(), v_new[q0 + pp - L, kvh].float()
                    s = (qt.bfloat16().float() @ kt.T) * scale_log2
                    s = torch.where(pos[None, :] <= (L + tok)[:, None], s, torch.full((1,), NEG_INF))
                    mx = torch.maximum(m, s.max(1).values)
                    mu = torch.where(mx == NEG_INF, torch.zeros(1), mx)
                    alpha = torch.exp2(m - mu)
                    pm = torch.exp2(s - mu[:, None])
                    l = l * alpha + pm.sum(1)
                    o = o * alpha[:, None] + pm.bfloat16().float() @ vt
                    m = mx
                inv = torch.where(l > 0, 1 / l, torch.zeros(1))
                res = o * inv[:, None]
                if S > 1:
                    o_part[z, q0 + tok[valid], head[valid]] = res[valid]
                    lse = torch.where(l > 0, m + torch.log2(l), torch.full((1,), NEG_INF))
                    lse_part[z, q0 + tok[valid], head[valid]] = lse[valid]
                else:
                    g = torch.sigmoid(gate[q0 + tok, head].float())
                    out[q0 + tok[valid], head[valid]] = (res * g)[valid]
    if S > 1:  # the combine: empty shares have weight 0 and are not read
        mx = lse_part.max(0).values
        w = torch.where(lse_part == NEG_INF, torch.zeros(1), torch.exp2(lse_part - mx))
        acc = torch.where(w[..., None] > 0, o_part, torch.zeros(1)) * w[..., None]
        out = acc.sum(0) / w.sum(0)[..., None] * torch.sigmoid(gate.float())
    return out.to(q.dtype), appended, pool_reads


CASES = [  # (block size, [(cached, new)], H, Hkv, forced splits)
    (16, [(0, 1)], 8, 2, None), (16, [(37, 5)], 8, 2, None), (64, [(100, 20)], 8, 2, 3),
    (16, [(0, 40), (70, 1), (33, 9)], 8, 2, None), (16, [(90, 7)], 12, 2, None),  # GQA 6: tokens straddle tiles
    (64, [(5, 30)], 12, 2, 2), (16, [(300, 1), (2, 1)], 8, 2, None), (16, [(64, 64)], 4, 1, 5),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_emulated_kernel_matches_reference(case):
    bs, lens, H, Hkv, splits = CASES[case]
    a = make_case(500 + case, bs, lens, H=H, Hkv=Hkv, D=32)
    r = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    out, appended, pool_reads = emulate(a, splits, sm_count=4)
    ref = _ref(r, write_kv=True)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < 1e-2
    G = H // Hkv
    assert appended == Counter({(n, t, h): 1 for n, (_, nq) in enumerate(lens) for t in range(nq) for h in range(Hkv)})
    assert a["nan_block"] not in pool_reads  # padding entries of the table are never followed
    for pool in ("k_pool", "v_pool"):
        assert torch.equal(a[pool].view(torch.int16), r[pool].view(torch.int16))
    assert G * Hkv == H


def test_emulation_can_fail():
    """The comparison has teeth: the same emulation over 40 fewer cached keys misses the reference."""
    a = make_case(9, 16, [(200, 3)], H=8, Hkv=2, D=32)
    r = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    good, _, _ = emulate(a, 4, sm_count=4)
    ref = _ref(r, write_kv=True)
    assert _rel(good, ref) < 1e-2
    short = dict(a, cache_lens=a["cache_lens"] - 40)  # fewer keys seen than the reference sees
    bad, _, _ = emulate(short, 4, sm_count=4)
    assert _rel(bad, ref) > 1e-2
