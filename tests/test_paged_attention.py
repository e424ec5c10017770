"""Paged attention (kernels/paged_attention): the reference against plain attention on contiguous K/V
(CPU), the op's fake and schema, the launch plan, compiles for every target; on a GPU the kernels against
the reference over a sampled grid of block sizes, prefixes (0..32K), new tokens (1..4K) and GQA shapes,
with shuffled block tables, NaN in every pool block a sequence does not own, and a NaN-poisoned output."""
import math

import pytest
import torch

from qwen35_fast.kernels import cuda_build, ops
from qwen35_fast.kernels.paged_attention import launch as pa_launch
from qwen35_fast.kernels.paged_attention.reference import (
    MAX_RUNS,
    gather_kv,
    paged_attention_on_device,
    paged_attention_ref,
    runs,
)

SRC = pa_launch.SRC


def make_case(seed, block_size, lens, H=16, Hkv=4, D=256, device="cpu", spare_blocks=3, shuffle=True):
    """Random inputs for sequences with (cached, new) token counts `lens`: a pool with each sequence's
    blocks scattered (shuffled), every block nobody owns full of NaN, block-table padding pointing at a
    NaN block. Returns a dict of the op's arguments plus `nan_block`."""
    g = torch.Generator().manual_seed(seed)
    N = len(lens)
    need = [math.ceil((L + nq) / block_size) for L, nq in lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)  # drawn either way: the same values follow
    perm = perm if shuffle else torch.arange(num_blocks)
    nan_block = int(perm[-1])
    table = torch.full((N, max_blocks), nan_block, dtype=torch.int32)
    at = 0
    for n, k in enumerate(need):
        table[n, :k] = perm[at:at + k].to(torch.int32)
        at += k
    pool_shape = (num_blocks, block_size, Hkv, D)
    k_pool = torch.full(pool_shape, float("nan"), dtype=torch.bfloat16)
    v_pool = torch.full(pool_shape, float("nan"), dtype=torch.bfloat16)
    flat_k, flat_v = k_pool.view(-1, Hkv, D), v_pool.view(-1, Hkv, D)
    for n, (L, _) in enumerate(lens):  # only the cached positions hold numbers; new slots stay NaN until written
        pos = torch.arange(L)
        s = table[n].long()[pos // block_size] * block_size + pos % block_size
        flat_k[s] = torch.randn(L, Hkv, D, generator=g).to(torch.bfloat16)
        flat_v[s] = torch.randn(L, Hkv, D, generator=g).to(torch.bfloat16)
    T = sum(nq for _, nq in lens)
    cu = torch.tensor([0] + [nq for _, nq in lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    qg = torch.randn(T, H, 2 * D, generator=g).to(torch.bfloat16)  # q and gate interleaved per head, as the model's view
    args = dict(q=qg[..., :D], gate=qg[..., D:] * 2, k_new=torch.randn(T, Hkv, D, generator=g).to(torch.bfloat16),
                v_new=torch.randn(T, Hkv, D, generator=g).to(torch.bfloat16), k_pool=k_pool, v_pool=v_pool,
                block_table=table, cache_lens=torch.tensor([L for L, _ in lens], dtype=torch.int32), cu_q=cu)
    args = {k: v.to(device) for k, v in args.items()}
    args["max_q"] = max(nq for _, nq in lens)
    args["nan_block"] = nan_block
    return args


def _ref(a, write_kv=True):
    return paged_attention_ref(a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], a["block_table"],
                               a["cache_lens"], a["cu_q"], a["gate"], write_kv=write_kv)


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


# ----------------------------------------------------------------------------- reference (CPU)

def test_reference_matches_plain_attention_on_contiguous_kv():
    """Gathering through a shuffled table and masking lower-right equals float64 softmax attention written
    out by hand over the concatenated keys."""
    lens = [(37, 5), (0, 9), (70, 1)]
    a = make_case(1, 16, lens, H=8, Hkv=2, D=64)
    out = _ref(a, write_kv=False)
    assert torch.isfinite(out).all()
    cu, G = a["cu_q"].tolist(), 4
    for n, (L, nq) in enumerate(lens):
        k = torch.cat([gather_kv(a["k_pool"], a["block_table"][n], L), a["k_new"][cu[n]:cu[n + 1]]]).double()
        v = torch.cat([gather_kv(a["v_pool"], a["block_table"][n], L), a["v_new"][cu[n]:cu[n + 1]]]).double()
        q = a["q"][cu[n]:cu[n + 1]].double()
        for h in range(8):
            s = q[:, h] @ k[:, h // G].T / 8.0
            for i in range(nq):
                s[i, L + i + 1:] = -math.inf
            o = torch.softmax(s, -1) @ v[:, h // G]
            o = o * torch.sigmoid(a["gate"][cu[n]:cu[n + 1], h].double())
            assert _rel(out[cu[n]:cu[n + 1], h], o) < 4e-3


def test_reference_block_order_and_nan_blocks_do_not_matter():
    lens = [(100, 7), (33, 2)]
    a = make_case(2, 16, lens, H=8, Hkv=2, D=64, shuffle=True)
    b = make_case(2, 16, lens, H=8, Hkv=2, D=64, shuffle=False)
    # same random K/V values (drawn in the same order), another placement in the pool
    torch.testing.assert_close(_ref(a, False), _ref(b, False), rtol=0, atol=0)


def test_reference_writes_new_kv_into_their_slots():
    lens = [(20, 13), (0, 3)]
    a = make_case(3, 16, lens, H=4, Hkv=2, D=32)
    _ref(a, write_kv=True)
    for n, (L, nq) in enumerate(lens):
        got = gather_kv(a["k_pool"], a["block_table"][n], L + nq)[L:]
        assert torch.equal(got, a["k_new"][int(a["cu_q"][n]):int(a["cu_q"][n + 1])])
    assert torch.isnan(a["k_pool"][a["nan_block"]]).all()



def test_runs_of_consecutive_slots():
    assert runs([4, 5, 6, 9, 10, 2], 90, 16) == [(64, 48), (144, 32), (32, 10)]
    assert runs([7], 1, 64) == [(448, 1)]
    assert runs([3, 4, 5, 6], 64, 16) == [(48, 64)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
def test_reference_reads_the_keys_where_they_lie(shuffle, block_size):
    """With write_kv the keys are read in the pool (views of each stretch of consecutive slots; gathered past
    MAX_RUNS stretches): the same attention as gathering the cache and appending the new tokens (write_kv off),
    within fp32 rounding, and the new K/V stored all the same."""
    lens = [(37, 5), (0, 9), (700, 1), (129, 16)]
    a = make_case(7, block_size, lens, H=8, Hkv=2, D=64, shuffle=shuffle)
    b = make_case(7, block_size, lens, H=8, Hkv=2, D=64, shuffle=shuffle)
    stretches = [len(runs(a["block_table"][n].tolist(), L + nq, block_size)) for n, (L, nq) in enumerate(lens)]
    if shuffle and block_size == 16:
        assert max(stretches) > MAX_RUNS and min(stretches) <= MAX_RUNS  # both forms in one call
    elif not shuffle:
        assert stretches == [1] * len(lens)
    out = _ref(a, write_kv=True)
    assert torch.isfinite(out).all()
    assert _rel(out, _ref(b, write_kv=False)) < 2e-3
    for n, (L, nq) in enumerate(lens):
        got = gather_kv(a["k_pool"], a["block_table"][n], L + nq)[L:]
        assert torch.equal(got, a["k_new"][int(a["cu_q"][n]):int(a["cu_q"][n + 1])])


@pytest.mark.parametrize("write_kv", [True, False])
@pytest.mark.parametrize("block_size, H, Hkv, D", [(16, 8, 2, 64), (64, 16, 4, 256), (16, 4, 4, 32)])
def test_the_device_form_reads_nothing_back_and_equals_the_reference(write_kv, block_size, H, Hkv, D, monkeypatch):
    """The form GPUs run (paged_attention_on_device, here on the CPU): every slot of each table row read, PAD and
    NaN blocks among them, the same attention as the reference, the same pool writes, and no value read back to
    the host (what would make a GPU wait, and a CUDA-graph capture fail)."""
    lens = [(37, 5), (0, 9), (300, 1), (129, 16), (64, 0)]
    a = make_case(11, block_size, lens, H=H, Hkv=Hkv, D=D)
    b = make_case(11, block_size, lens, H=H, Hkv=Hkv, D=D)
    a["block_table"][1, -1] = -1  # a PAD entry (kv_pool.PAD) past a sequence's blocks
    b["block_table"][1, -1] = -1
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *x, _n=name, _f=real, **k: reads.append(_n) or _f(self, *x, **k))
    got = paged_attention_on_device(a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], a["block_table"],
                                    a["cache_lens"], a["cu_q"], a["gate"], write_kv=write_kv)
    assert reads == []
    monkeypatch.undo()
    want = _ref(b, write_kv=write_kv)
    assert torch.isfinite(got).all() and got.dtype == want.dtype
    assert _rel(got, want) < 2e-3
    assert torch.equal(a["k_pool"].nan_to_num(7.0), b["k_pool"].nan_to_num(7.0))
    assert torch.equal(a["v_pool"].nan_to_num(7.0), b["v_pool"].nan_to_num(7.0))


@pytest.mark.parametrize("form", ["reference", "device"])
def test_many_new_tokens_over_a_long_cache_run_in_row_chunks(form, monkeypatch):
    """Many new tokens over a long cache hold at most SCORE_BYTES of scores at a time (row chunks; the CPU form
    also leaves out the keys no row of a chunk sees): the attention of the call in one piece, and the same
    pool writes."""
    from qwen35_fast.kernels.paged_attention import reference
    fn = paged_attention_ref if form == "reference" else paged_attention_on_device
    lens = [(300, 70), (0, 33), (129, 1)]
    a, b = (make_case(13, 16, lens, H=8, Hkv=2, D=64) for _ in range(2))
    args = ("q", "k_new", "v_new", "k_pool", "v_pool", "block_table", "cache_lens", "cu_q", "gate")
    want = fn(*(b[k] for k in args))
    sizes, real = [], torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, *p, **k: sizes.append(x.numel()) or real(x, *p, **k))
    monkeypatch.setattr(reference, "SCORE_BYTES", 4 * 8 * 400 * 7)  # 7 rows of 8 heads over 400 keys
    got = fn(*(a[k] for k in args))
    monkeypatch.undo()
    assert len(sizes) > 2 * len(lens) and 4 * max(sizes) <= 4 * 8 * 400 * 7
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-4
    assert torch.equal(a["k_pool"].nan_to_num(7.0), b["k_pool"].nan_to_num(7.0))


def test_op_reference_path_and_fake():
    a = make_case(4, 16, [(10, 4)], H=4, Hkv=2, D=32)
    args = (a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], a["block_table"], a["cache_lens"],
            a["cu_q"], a["gate"], a["max_q"], 32 ** -0.5, True, False)
    ref = _ref(make_case(4, 16, [(10, 4)], H=4, Hkv=2, D=32))
    out = ops.paged_attention_op(*args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.library.opcheck(ops.paged_attention_op, args, test_utils=("test_schema", "test_faketensor"))


def test_public_wrapper_runs_the_reference_off_cuda():
    from qwen35_fast import kernels
    a = make_case(5, 16, [(20, 6), (3, 2)], H=8, Hkv=2, D=64)
    ref = _ref(make_case(5, 16, [(20, 6), (3, 2)], H=8, Hkv=2, D=64))
    be = kernels.select_backend("auto", "cpu")
    out = kernels.paged_attention(a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], a["block_table"],
                                  a["cache_lens"], a["cu_q"], a["gate"], max_q=a["max_q"], backend=be)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # write_kv=False: the same attention, the pool left as it was (its new slots still NaN)
    b = make_case(5, 16, [(20, 6), (3, 2)], H=8, Hkv=2, D=64)
    pools = b["k_pool"].clone(), b["v_pool"].clone()
    out = kernels.paged_attention(b["q"], b["k_new"], b["v_new"], b["k_pool"], b["v_pool"], b["block_table"],
                                  b["cache_lens"], b["cu_q"], b["gate"], max_q=b["max_q"], write_kv=False, backend=be)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip((b["k_pool"], b["v_pool"]), pools):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_plan_is_fixed_by_shapes():
    """Decode (1 token, 9B heads): the decode kernel's 16-row blocks, keys split until two blocks per H200 SM;
    shorter capacity fewer splits (a decode share down to one 32-key tile); no split that leaves a partly
    filled second wave; a long prefill needs no split."""
    p = pa_launch.plan(1, 1, 4, 4, 65536, 132)
    assert p.kernel == "dec" and p.row_tiles == 1 and p.splits == math.ceil(2 * 132 / 4)
    assert pa_launch.plan(4, 1, 4, 4, 65536, 132).kernel == "dec"  # 16 rows: still one decode block
    assert pa_launch.plan(5, 1, 4, 4, 65536, 132).kernel == "mma"
    # 5 to 16 new tokens over short contexts: the decode kernel's blocks (one per 16 rows) while each reads few keys
    assert pa_launch.plan(16, 1, 4, 4, 1040, 132) == pa_launch.Plan(1, 4, 16, "dec")  # 256 blocks: one wave
    assert pa_launch.plan(8, 1, 4, 4, 4096, 132).kernel == "dec"
    assert pa_launch.plan(12, 1, 4, 4, 4096, 132).kernel == "mma"
    assert pa_launch.plan(16, 1, 4, 4, 1040, 132, head_dim=96).kernel == "mma"
    assert pa_launch.plan(1, 1, 4, 4, 65536, 132, head_dim=96).kernel == "mma"  # the decode kernel: dims % 64
    assert pa_launch.plan(1, 1, 4, 4, 1024, 132).splits == 1024 // pa_launch.BN  # one tile a share
    assert pa_launch.plan(1, 1, 4, 4, 100, 132).splits == 4  # 100 keys (+ the new one): four tiles
    assert pa_launch.plan(2, 1, 4, 4, 1024, 132, kernel="mma").splits == 1024 // pa_launch.MIN_KEYS_PER_SPLIT
    assert pa_launch.plan(16, 1, 4, 4, 65536, 132) == pa_launch.Plan(4, 1, 66)
    assert pa_launch.plan(4096, 1, 4, 4, 65536, 132).splits == 1
    # 256 tokens: 64 row tiles x kv heads; 4 splits fill one wave of 2 x 132 blocks, 5 would need a second
    assert pa_launch.plan(256, 1, 4, 4, 65536, 132).splits == 4
    assert pa_launch.plan(1024, 1, 4, 4, 65536, 132).splits == 1  # 256 blocks: one wave without a split
    assert pa_launch.plan(4, 8, 4, 4, 4096, 132).warps_m == 1


def test_plan_counts_the_blocks_an_sm_holds():
    """An RTX card's 100 KB SM holds one decode block (76 KB) and one 4-warp mma.sync block (101 KB), an A100's
    164 KB two: the splits fill one wave of what the SM holds, not of an H200's."""
    rtx, a100 = 102_400, 167_936
    assert pa_launch.decode_blocks_per_sm(256, rtx) == 1 and pa_launch.decode_blocks_per_sm(256, a100) == 2
    assert pa_launch.decode_blocks_per_sm(256, 233_472) == 2  # three fit; two fill the wave best (measured)
    assert pa_launch.plan(1, 1, 4, 4, 65536, 82, smem_per_sm=rtx).splits == 82 // 4  # 21 starts a second wave
    assert pa_launch.plan(1, 1, 4, 4, 65536, 108, smem_per_sm=a100).splits == 2 * 108 // 4
    assert pa_launch.plan(16, 1, 4, 4, 65536, 128, smem_per_sm=rtx).splits == 128 // 4
    assert pa_launch.plan(16, 1, 4, 4, 65536, 132).splits == 2 * 132 // 4


def test_plan_takes_the_warpgroup_kernel_for_prefills_on_hopper():
    """sm_90a: what the decode kernel does not take goes to paged_attention_wg (one block per SM): 128 rows a
    block above 64 rows (16 tokens x 4 q heads), 64 rows up to there; decode steps stay on the decode kernel;
    elsewhere the mma.sync kernel takes them."""
    p = pa_launch.plan(16, 1, 4, 4, 65536, 132, wgmma=True)
    assert (p.kernel, p.warps_m, p.row_tiles, p.splits) == ("wg", 4, 1, 33)  # 33 x 4 blocks: one wave
    assert pa_launch.plan(5, 1, 4, 4, 65536, 132, wgmma=True).kernel == "wg"
    assert pa_launch.plan(16, 1, 4, 4, 65536, 132).kernel == "mma"
    assert pa_launch.plan(16, 1, 4, 4, 1024, 132, wgmma=True).kernel == "dec"  # short contexts: DEC_KEY_ROWS
    assert pa_launch.plan(4, 1, 4, 4, 65536, 132, wgmma=True).kernel == "dec"
    assert pa_launch.plan(1, 1, 4, 4, 65536, 132, wgmma=True) == pa_launch.plan(1, 1, 4, 4, 65536, 132)
    p = pa_launch.plan(1024, 1, 4, 4, 65536, 132, wgmma=True)
    assert (p.kernel, p.row_tiles, p.splits) == ("wg", 32, 1)  # 128 blocks: one wave of 132
    p = pa_launch.plan(256, 1, 4, 4, 65536, 132, wgmma=True)
    assert (p.kernel, p.row_tiles, p.splits) == ("wg", 8, 4)  # 32 blocks x 4 splits = 128, a fifth spills
    assert pa_launch.plan(256, 1, 4, 4, 65536, 132, kernel="mma").kernel == "mma"
    assert pa_launch.plan(17, 1, 4, 4, 65536, 132, kernel="wg").warps_m == 8
    assert pa_launch.plan(4096, 1, 4, 4, 1024, 132).kernel == "mma"
    with pytest.raises(ValueError, match="'mma', 'dec' or 'wg'"):
        pa_launch.plan(256, 1, 4, 4, 65536, 132, kernel="wgmma")


def test_the_launcher_names_pools_and_outputs_it_cannot_take_and_a_grid_past_its_limit():
    """Before any launch (no GPU needed): pools or an output that start off a 16-byte boundary (views at an offset:
    the kernels read and write them in 16-byte pieces) and more (sequence, kv head) rows than a grid's y dimension
    holds are refused with what to pass instead."""
    a = make_case(0, 16, [(20, 3)])
    args = [a[k] for k in ("q", "k_new", "v_new", "k_pool", "v_pool", "block_table", "cache_lens", "cu_q")]

    def shifted(t):  # the same values, one element past a 16-byte boundary
        s = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
        return s.copy_(t)
    for i, name in ((3, "k_pool"), (4, "v_pool")):
        bad = list(args)
        bad[i] = shifted(args[i])
        with pytest.raises(ValueError, match=f"{name} must be on cpu and start on a 16-byte boundary, got cpu, byte 2"):
            pa_launch.paged_attention_cuda(*bad, None, 3)
    with pytest.raises(ValueError, match="out must be a contiguous .* starting on a 16-byte boundary, .* at byte 2"):
        pa_launch.paged_attention_cuda(*args, None, 3, out=shifted(torch.empty_like(args[0])))
    N, T = 16_384, 16_384  # one new token for each of 16,384 sequences, 4 kv heads: 65,536 grid rows
    q, kv = torch.zeros(T, 16, 256, dtype=torch.bfloat16), torch.zeros(T, 4, 256, dtype=torch.bfloat16)
    many = [q, kv, kv, args[3], args[4], torch.zeros(N, 1, dtype=torch.int32), torch.zeros(N, dtype=torch.int32),
            torch.arange(N + 1, dtype=torch.int32)]
    with pytest.raises(ValueError, match="16,384 sequences x 4 kv heads make 65,536 grid rows, more than the 65,535 "
                                         "a launch takes; pass at most 16,383 sequences a call"):
        pa_launch.paged_attention_cuda(*many, None, 1)


def test_shared_memory_fits_consumer_cards():
    assert pa_launch.smem_bytes(4, 256) <= 101_376  # RTX 30/40/50 opt-in maximum
    assert pa_launch.smem_bytes(1, 256) <= 101_376
    assert pa_launch.smem_bytes_decode(256) == 76_032  # three decode blocks per H100 / H200 SM (228 KB)
    assert 3 * (pa_launch.smem_bytes_decode(256) + 1024) <= 233_472
    assert pa_launch.smem_bytes_decode(128) == 8192 + 4 * 32 * 136 * 2  # the partial S outgrows Q at dim 128
    assert pa_launch.smem_bytes_wg(256, 1) <= 232_448 and pa_launch.smem_bytes_wg(256, 2) <= 232_448  # Hopper


# ----------------------------------------------------------------------------- compiles (CPU, NVRTC)

def _nvrtc_missing():
    try:
        cuda_build.nvrtc_version()
    except cuda_build.KernelBuildError as e:
        return str(e)
    return None


VARIANTS = [{"GROUP": g, "WARPS_M": w, "BLOCK_SIZE": b, "SPLIT": s, "GATE": 1}
            for g in (4, 6) for w in (1, 2, 4) for b in (16, 64) for s in (0, 1)] + [{"GATE": 0, "HEAD_DIM": 128}]


@pytest.mark.skipif(_nvrtc_missing() is not None, reason="NVRTC is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_120"])
def test_compiles_for_every_card(arch):
    if int(arch[3:].rstrip("a")) not in cuda_build.supported_archs():
        pytest.skip(f"NVRTC {cuda_build.nvrtc_version()} does not target {arch}")
    sets = VARIANTS if arch in ("sm_80", "sm_90a") else VARIANTS[:: 5] + VARIANTS[-1:]
    for d in sets:
        assert cuda_build.compile_cubin(SRC, arch, d)[:4] == b"\x7fELF", f"{arch} {d}"
    for d in {tuple(sorted((k, v) for k, v in d.items() if k != "WARPS_M")): 0 for d in sets}:  # the decode kernel
        assert cuda_build.compile_cubin(pa_launch.SRC_DEC, arch, dict(d))[:4] == b"\x7fELF", f"dec {d}"
    if arch == "sm_90a":  # the warpgroup-mma kernel: Hopper only
        for d in VARIANTS[:: 3] + VARIANTS[-1:]:
            d = {k: v for k, v in d.items() if k != "WARPS_M"}
            for wgs in (1, 2):
                assert cuda_build.compile_cubin(pa_launch.SRC_WG, arch, {**d, "WARPGROUPS": wgs})[:4] == b"\x7fELF", \
                    f"wg {wgs} {d}"


# ----------------------------------------------------------------------------- kernels vs reference (GPU)

# (block size, [(cached, new) per sequence], H, Hkv): prefixes 0..32K, new tokens 1..4K, GQA 4 and 6
CASES = [
    (16, [(0, 1)], 16, 4), (64, [(0, 1)], 16, 4), (16, [(0, 7)], 16, 4), (64, [(0, 100)], 16, 4),
    (16, [(5, 1)], 16, 4), (64, [(63, 16)], 16, 4), (16, [(100, 3)], 16, 4), (64, [(1000, 1)], 16, 4),
    (16, [(4096, 16)], 16, 4), (64, [(4095, 256)], 16, 4), (16, [(32768, 1)], 16, 4), (64, [(32768, 16)], 16, 4),
    (16, [(0, 4096)], 16, 4), (64, [(8192, 1024)], 16, 4), (16, [(32768, 4096)], 16, 4), (64, [(1, 2048)], 16, 4),
    (16, [(777, 333)], 16, 4), (64, [(20000, 9)], 16, 4),
    (16, [(300, 50)], 24, 4), (64, [(5000, 1)], 24, 4), (16, [(0, 513)], 24, 4),  # 27B: 24 q / 4 kv heads
    (64, [(1234, 77)], 8, 2), (16, [(9000, 2)], 8, 2),  # 0.8B: 8 q / 2 kv heads
    (16, [(0, 50), (1000, 1), (300, 17), (64, 64)], 16, 4),  # varlen batch
    (64, [(4000, 1), (17, 1), (0, 1), (31000, 1)], 16, 4),  # decode batch
    (16, [(2048, 4), (100, 16), (7, 11)], 16, 4),
]


def _run_cuda(a, splits=None, kernel=None):
    out = torch.full_like(a["q"], float("nan"), memory_format=torch.contiguous_format)
    pa_launch.paged_attention_cuda(a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], a["block_table"],
                                   a["cache_lens"], a["cu_q"], a["gate"], a["max_q"], out=out, splits=splits,
                                   kernel=kernel)
    return out


def _hopper():
    return torch.cuda.is_available() and pa_launch.card_of("cuda").wgmma


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "dec", "wg"])
@pytest.mark.parametrize("forced_splits", [None, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_vs_reference(case, forced_splits, kernel):
    """Each kernel forced on every case (the warpgroup one on sm_90a: one warpgroup up to 64 rows, decode rows
    too, 1 token in 64 rows; two above; the decode kernel on prefills too, 16 rows a block)."""
    if kernel == "wg" and not _hopper():
        pytest.skip("the warpgroup-mma kernel runs on sm_90a only")
    bs, lens, H, Hkv = CASES[case]
    a = make_case(1000 * case + (forced_splits or 0), bs, lens, H=H, Hkv=Hkv, device="cuda")
    before_k, before_v = a["k_pool"].clone(), a["v_pool"].clone()
    out = _run_cuda(a, forced_splits, kernel)
    r = {k: (v.clone() if k in ("k_pool", "v_pool") else v) for k, v in a.items()}
    r["k_pool"], r["v_pool"] = before_k.clone(), before_v.clone()
    ref = _ref(r, write_kv=True)
    assert not torch.isnan(out).any(), "an output element was not written, or a NaN block was read"
    err = _rel(out, ref)
    assert err < 1e-2, f"relative error {err:.2e}"
    # the pool afterwards: exactly the reference's (new K/V in their slots, nothing else touched)
    for got, want in ((a["k_pool"], r["k_pool"]), (a["v_pool"], r["v_pool"])):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_combine_shape_stays_inside_the_kernels_arrays():
    """paged_combine.cu holds rows x splits weights (128), one float4 per thread (256 threads) and
    one sum per 8 threads for the groups' sums; every group count and column width the launcher can give stays
    inside them."""
    for D in (32, 64, 96, 128, 160, 256):
        for splits in range(2, pa_launch.MAX_SPLITS + 1):
            cols, groups, rows = pa_launch.combine_shape(D, splits)
            assert D % cols == 0 and 8 * groups >= splits
            assert groups * cols // 4 * rows <= 256 and rows * splits <= 128 and rows * groups <= 32, (D, splits)
            # few groups a row: several rows a block, at least 64 threads and no more rows than fit in ~128
            row_threads = groups * cols // 4
            assert rows * row_threads >= 64 and (rows == 1 or (rows + 1) * row_threads > 128), (D, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 8, 9, 17, 25, 33, 99])
@pytest.mark.parametrize("H, Hkv, D", [(16, 4, 256), (6, 2, 96), (6, 3, 64)])
def test_combine_of_every_group_count(splits, H, Hkv, D):
    """The combine takes one group of threads per run of 8 shares (99 shares: 13 groups, the last one partly
    empty), 64 / 32 columns a block at head dims 256 and 64 / 96, and several rows a block when the groups are
    few (6 heads: a block's rows end past the last row): each against the reference, with empty shares past
    the keys at 99."""
    a = make_case(31 + splits, 16, [(3000, 1), (700, 2)], H=H, Hkv=Hkv, D=D, device="cuda")
    before_k, before_v = a["k_pool"].clone(), a["v_pool"].clone()
    out = _run_cuda(a, splits)
    r = {**a, "k_pool": before_k, "v_pool": before_v}
    assert not torch.isnan(out).any()
    assert _rel(out, _ref(r, write_kv=True)) < 1e-2


@pytest.mark.gpu
def test_paged_attention_block_order_does_not_change_the_result():
    lens = [(5000, 16), (300, 1)]
    a = make_case(7, 16, lens, device="cuda", shuffle=True)
    b = make_case(7, 16, lens, device="cuda", shuffle=False)
    assert torch.equal(_run_cuda(a), _run_cuda(b))


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    """One launch shape for a capacity: capture once, then move cache_lens on the device and replay."""
    lens = [(2000, 1), (30000, 1)]
    a = make_case(11, 64, lens, device="cuda", spare_blocks=8)
    out = torch.empty_like(a["q"])
    args = (a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], a["block_table"], a["cache_lens"], a["cu_q"],
            a["gate"], 1)
    pa_launch.paged_attention_cuda(*args, write_kv=False, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa_launch.paged_attention_cuda(*args, write_kv=False, out=out)
    for lens_now in ([1999, 29000], [5, 12345], [2000, 30000]):
        a["cache_lens"].copy_(torch.tensor(lens_now, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = _ref(a, write_kv=False)
        assert not torch.isnan(out).any()
        assert _rel(out, ref) < 1e-2, lens_now


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_the_merge_waits_for_the_shares_it_reads(graphed, monkeypatch):
    """The merge of a split call may start while the split kernel still runs (a programmatic launch on sm_90
    and newer, plain elsewhere) and must read each share only once it is written: split calls one after
    another (a decode step on the decode kernel, 16 new tokens on the warpgroup or mma.sync kernel), eager and
    replayed in a CUDA graph, equal the same calls launched plainly bit for bit, for new queries each time (a
    merge that read early would read the call before's shares, in memory the allocator hands on, or NaN)."""
    cases = [make_case(60 + i, 16, lens, device="cuda") for i, lens in enumerate([[(20000, 1)], [(9000, 16)]] * 2)]
    card = pa_launch.card_of("cuda")
    for c in cases:
        assert pa_launch.plan(c["max_q"], 1, 4, 4, c["block_table"].shape[1] * 16, card.sms, wgmma=card.wgmma,
                              smem_per_sm=card.smem_per_sm).splits > 1

    def run_all():
        return [_run_cuda(c) for c in cases]

    def fresh(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for c in cases:
            c["q"].copy_(torch.randn(c["q"].shape, generator=g, device="cuda").bfloat16())

    run_all()  # the kernels load outside the capture
    if graphed:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run_all()
    for seed in range(1, 6):
        fresh(seed)
        monkeypatch.setattr(cuda_build, "PROGRAMMATIC", False)
        want = run_all()
        monkeypatch.setattr(cuda_build, "PROGRAMMATIC", True)
        if graphed:
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            got = outs
        else:
            got = run_all()
        for g_, w in zip(got, want):
            assert not torch.isnan(w).any()
            assert torch.equal(g_, w), seed
