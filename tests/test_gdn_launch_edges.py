"""Edge cases of the GDN prefill / decode, conv1d and gemv launchers and references: the largest K the gemv takes,
gates and operands given in two dtypes, calls without sequences. The GPU tests skip without CUDA; the reference
tests run on the CPU."""

import pytest
import torch

from qwen35_fast.kernels.conv1d.reference import causal_conv1d_prefill_ref
from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_chunked, gdn_prefill_recurrent_f64

from _models import rel

gpu = pytest.mark.gpu


def _gdn_inputs(T, Hk, Hv, n_states, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, device="cuda")
    q, k, v = r(1, T, Hk, 128).bfloat16(), r(1, T, Hk, 128).bfloat16(), r(1, T, Hv, 128).bfloat16()
    a, b = r(1, T, Hv), r(1, T, Hv)
    A_log = torch.empty(Hv, device="cuda").uniform_(1.0, 16.0, generator=g).log()
    dt_bias = r(Hv) * 0.5
    h0 = r(n_states, Hv, 128, 128) * 0.1
    return q, k, v, a, b, A_log, dt_bias, h0


# ---------------------------------------------------------------- gemv's fused norm at K = MAX_K
@gpu
def test_fused_add_norm_gemv_launches_at_the_largest_k_the_launcher_takes():
    """gemv.launch takes K up to MAX_K = 24,576: 48 KB of x in dynamic shared memory, and the fused build's
    static part[8] (32 bytes) besides; past 48 KB in all, the launch must allow the dynamic part (it was allowed
    only above 48 KB of dynamic memory, and this launch failed)."""
    from qwen35_fast.kernels.gemv.launch import MAX_K, gemv_add_rms_norm_cuda
    from qwen35_fast.kernels.gemv.reference import gemv_add_rms_norm_ref
    g = torch.Generator(device="cuda").manual_seed(3)
    K, N = MAX_K, 16
    res = torch.randn(K, generator=g, device="cuda").bfloat16()
    x = torch.randn(K, generator=g, device="cuda").bfloat16()
    norm_w = torch.randn(K, generator=g, device="cuda") * 0.1
    weight = (torch.randn(N, K, generator=g, device="cuda") * 0.02).bfloat16()
    s, y = gemv_add_rms_norm_cuda(res, x, norm_w, 1e-6, weight, fuse=True)
    s_ref, y_ref = gemv_add_rms_norm_ref(res, x, norm_w, 1e-6, weight)
    assert torch.equal(s, s_ref)
    assert rel(y, y_ref) < 1e-2


# ---------------------------------------------------------------- mixed dtypes rounded to the narrower one
@gpu
def test_prefill_gates_of_two_dtypes_are_not_rounded_to_the_narrower_one():
    """a bf16 with b fp32: both go in as fp32 (b was rounded to bf16, where the reference takes it as given), so
    the call equals the one with a given in fp32 (the same values), bit for bit."""
    from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda
    q, k, v, a, b, A_log, dt_bias, h0 = _gdn_inputs(200, 2, 4, 1, seed=5)
    a16 = a.bfloat16()
    o1, h1 = gdn_chunk_prefill_cuda(q, k, v, a16, b, A_log, dt_bias, h0)
    o2, h2 = gdn_chunk_prefill_cuda(q, k, v, a16.float(), b, A_log, dt_bias, h0)
    assert torch.equal(h1, h2) and torch.equal(o1, o2)


def test_decode_step_refuses_more_sequences_than_its_grid_takes():
    """The launch's grid has one z index a sequence (at most 65,535): more is refused by name before any launch
    (the driver's bare "CUresult 1" otherwise). Checked before the tensors' device is asked, so on any machine."""
    from qwen35_fast.kernels.gdn_decode.launch import MAX_N, gdn_decode_step_cuda
    N = MAX_N + 1
    q, v, ab = torch.zeros(N, 1, 16), torch.zeros(N, 1, 32), torch.zeros(N, 1)
    with pytest.raises(ValueError, match="65536 sequences in one call; the kernel takes at most 65,535"):
        gdn_decode_step_cuda(q, q, v, ab, ab, torch.zeros(1), torch.zeros(1), torch.zeros(1))


@gpu
def test_decode_step_of_mixed_dtypes_matches_the_reference():
    """q, a, A_log in bf16 and k, b, dt_bias in fp32: each pair goes in as the wider dtype (k, b and dt_bias were
    rounded to bf16, where the reference computes in fp32 from the values given: the state differed by ~1e-3,
    against the 1e-5 the decode tests hold)."""
    from qwen35_fast.kernels.gdn_decode.launch import gdn_decode_step_cuda
    from qwen35_fast.kernels.gdn_decode.reference import gdn_decode_step_ref
    g = torch.Generator(device="cuda").manual_seed(9)
    N, Hk, Hv, D = 3, 2, 4, 128

    def r(*s):
        return torch.randn(*s, generator=g, device="cuda")
    q, k, v = r(N, Hk, D).bfloat16(), r(N, Hk, D), r(N, Hv, D).bfloat16()
    a, b = (r(N, Hv) * 2).bfloat16(), r(N, Hv) * 2
    A_log = torch.empty(Hv, device="cuda").uniform_(1.0, 16.0, generator=g).log().bfloat16()
    dt_bias = r(Hv) * 0.5 + 1.0
    state = r(N, Hv, D, D) * 0.3
    state_ref = state.clone()
    o_ref = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
    o = gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
    assert rel(state, state_ref) < 1e-5
    assert rel(o, o_ref) < 1e-2


# ---------------------------------------------------------------- the references and a call with no sequences
def test_prefill_references_take_a_call_with_no_sequences():
    """For N = 0 (cu_seqlens [0], or B = 0) the references (the op's CPU path) return o and an empty
    [0, Hv, D, Dv] state, as the CUDA launcher and the op's fake do (they raised in torch.stack([])): the state of
    the dtype and per-sequence shape a call with one sequence gives (fp32 for the chunked walk whatever the
    inputs' dtype, float64 for the recurrence) on the inputs' device, keys and values of different widths told
    apart."""
    from qwen35_fast.kernels.ops import _prefill_fake
    T, Hv, D, Dv = 5, 2, 32, 16
    q, k = torch.randn(1, T, 1, D).bfloat16(), torch.randn(1, T, 1, D).bfloat16()
    v, a, b = torch.randn(1, T, Hv, Dv).bfloat16(), torch.randn(1, T, Hv), torch.randn(1, T, Hv)
    A_log, dt_bias = torch.zeros(Hv), torch.zeros(Hv)
    none = torch.zeros(1, dtype=torch.int32)
    for fn in (gdn_prefill_chunked, gdn_prefill_recurrent_f64):
        _, one = fn(q, k, v, a, b, A_log, dt_bias, None, torch.tensor([0, T], dtype=torch.int32))
        assert one.shape == (1, Hv, D, Dv)
        o, ht = fn(q, k, v, a, b, A_log, dt_bias, None, none)
        assert o.shape == (1, T, Hv, Dv) and ht.shape == (0, Hv, D, Dv) and ht.dtype == one.dtype
        o, ht = fn(*(x[:0] for x in (q, k, v, a, b)), A_log, dt_bias)
        assert o.shape == (0, T, Hv, Dv) and ht.shape == (0, Hv, D, Dv) and ht.dtype == one.dtype
        meta = [x[:0].to("meta") for x in (q, k, v, a, b)]  # on the inputs' device, wherever that is
        assert fn(*meta, A_log.to("meta"), dt_bias.to("meta"))[1].device.type == "meta"
    _, fake = _prefill_fake(q, k, v, a, b, A_log, dt_bias, None, none, False)
    _, ht = gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, None, none)
    assert (ht.shape, ht.dtype) == (fake.shape, fake.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_reference_takes_a_call_with_no_sequences(dtype):
    """The reference returns an empty [0, C, W-1] state in x's dtype for N = 0, as causal_conv1d_prefill_cuda
    and the op's fake do."""
    from qwen35_fast.kernels.ops import _conv_prefill_fake
    x, w = torch.randn(1, 5, 8, dtype=dtype), torch.randn(8, 4)
    none = torch.zeros(1, dtype=torch.int32)
    y, final = causal_conv1d_prefill_ref(x, w, None, None, none)
    _, fake = _conv_prefill_fake(x, w, None, None, none, False)
    assert y.shape == x.shape and final.shape == (0, 8, 3) and final.dtype == dtype
    assert (final.shape, final.dtype) == (fake.shape, fake.dtype)


# ---------------------------------------------------------------- what the prefill launcher looks up once
CARDS = {"H100": ("sm_90a", 132, 232448, 233472), "A100": ("sm_80", 108, 166912, 167936)}


@pytest.fixture
def recorded(monkeypatch):
    """gdn_chunk_prefill_cuda on the CPU with its lookups and launches recorded, not run: get_function returns
    the kernel's name, tensor_map the map's address, dims, strides and box."""
    from qwen35_fast.kernels import cuda_build as cb
    from qwen35_fast.kernels.gdn_prefill import launch as L
    rec = {"functions": [], "maps": [], "launches": [], "card": CARDS["H100"]}

    def get_function(src, name, dev, defines, arch):
        rec["functions"].append((name, dict(defines), arch))
        return name

    def tensor_map(x, dims, strides, box):
        rec["maps"].append((x.data_ptr(), dims, strides, box))
        return rec["maps"][-1]
    monkeypatch.setattr(L, "card_of", lambda dev: cb.Card(*rec["card"]))
    monkeypatch.setattr(L, "get_function", get_function)
    monkeypatch.setattr(L, "_map", lambda x, dims, strides, box: tensor_map(x, dims, strides, box))
    monkeypatch.setattr(L, "launch", lambda fn, grid, block, args, shared_mem: rec["launches"].append((fn, args)))
    monkeypatch.setattr(L, "_kernel_sets", {})
    monkeypatch.setattr(L, "_walk_maps", {})
    return L, rec


def _cpu_inputs(T, Hk, Hv):
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(1, T, Hk, 128, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, T, Hv, 128, generator=g).bfloat16()
    a, b = torch.randn(1, T, Hv, generator=g), torch.randn(1, T, Hv, generator=g)
    return q, k, v, a, b, torch.zeros(Hv), torch.zeros(Hv)


@pytest.mark.parametrize("card", list(CARDS))
def test_prefill_launcher_looks_its_kernels_up_once_per_plan_dtypes_and_defines(recorded, card):
    """Each layer of a prefill asks for the same kernels: they are looked up on the first call of a plan and kept
    (Hopper: prep and the walk; portable: prep, the state walk and, unless o is formed in the walk, the out
    kernel). Another gate dtype or defines get their own; the launches name the kernels in order."""
    L, rec = recorded
    rec["card"] = CARDS[card]
    x = _cpu_inputs(300, 2, 4)
    L.gdn_chunk_prefill_cuda(*x)
    first = [f[0] for f in rec["functions"]]
    walk = ["gdn_chunk_prefill_fwd"] if card == "H100" else ["gdn_chunk_state", "gdn_chunk_out"]
    assert sorted(first) == sorted(["gdn_chunk_prep"] + walk[:len(first) - 1]) and len(first) >= 2
    assert [fn for fn, _ in rec["launches"]] == ["gdn_chunk_prep", *(n for n in walk if n in first)]
    assert all(arch == CARDS[card][0] for _, _, arch in rec["functions"])
    for _ in range(3):
        L.gdn_chunk_prefill_cuda(*x)
    assert len(rec["functions"]) == len(first) and len(rec["launches"]) == 4 * len(first)
    for T in (290, 310, 400):  # other lengths, other plans (slots): the same builds
        L.gdn_chunk_prefill_cuda(*_cpu_inputs(T, 2, 4))
    assert len(rec["functions"]) == len(first) and len(L._kernel_sets) == 1
    q, k, v, a, b, A_log, dt_bias = x
    L.gdn_chunk_prefill_cuda(q, k, v, a.bfloat16(), b.bfloat16(), A_log, dt_bias)
    assert rec["functions"][len(first)] == ("gdn_chunk_prep", {**rec["functions"][0][1], "AB_T": 2},
                                            CARDS[card][0])
    n = len(rec["functions"])
    L.gdn_chunk_prefill_cuda(*x, defines={"X": 1})
    assert len(rec["functions"]) == n + len(first) and all(f[1]["X"] == 1 for f in rec["functions"][n:])


@pytest.mark.parametrize("card", list(CARDS))
@pytest.mark.parametrize("keep", [None, [0, 64, 256]])
def test_prefill_launches_pass_each_kernel_the_parameters_it_declares(recorded, card, keep):
    """Each launch of a prefill passes as many values as its kernel declares (the driver takes one per declared
    parameter, in order: a value too many or too few shifts every later one, and the kernel reads garbage), the
    kept states' included; counted in the PTX NVRTC builds for the plan's defines. The call returns the kept
    states only when asked for them."""
    import re

    from qwen35_fast.kernels import cuda_build as cb
    try:
        cb.nvrtc_version()
    except cb.KernelBuildError as e:
        pytest.skip(f"NVRTC is not installed: {e}")
    L, rec = recorded
    rec["card"] = CARDS[card]
    out = L.gdn_chunk_prefill_cuda(*_cpu_inputs(300, 2, 4), keep=keep)
    assert len(out) == (2 if keep is None else 3)
    found = {name: (defines, arch) for name, defines, arch in rec["functions"]}
    src = {"gdn_chunk_prep": L.SRC_PREP, "gdn_chunk_prefill_fwd": L.SRC_HOPPER, "gdn_chunk_state": L.SRC_PORTABLE,
           "gdn_chunk_out": L.SRC_PORTABLE}
    assert len(rec["launches"]) >= 2
    for name, args in rec["launches"]:
        defines, arch = found[name]
        ptx = cb.compile_cubin(src[name], arch.replace("sm_", "compute_"), defines).decode()
        entry = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S)
        assert entry and entry.group(1).count(".param") == len(args), (name, len(args))


def test_walk_maps_come_from_one_lookup_per_addresses_and_strides(recorded):
    """The Hopper walk's six maps (k, q, v, T, P, o) are encoded once per addresses, strides and sizes and found
    again by the next call with the same ones; another address or stride gets its own, a packed copy (strides the
    copy engine refuses) is handed to the caller to hold and its maps are not kept, and at most 256 are kept."""
    L, rec = recorded
    q, k, v, *_ = _cpu_inputs(200, 2, 4)
    B, T, Hk, Hv = 1, 200, 2, 4
    Tg, Pg = torch.empty(2, 4, Hv, 64, 64, dtype=torch.bfloat16).unbind(0)
    o = torch.empty(B, T, Hv, 128, dtype=torch.bfloat16)
    keep: list = []
    maps = L._tensor_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, keep)
    row = lambda x: (x.stride(2) * 2, x.stride(1) * 2, x.stride(0) * 2)  # noqa: E731
    assert [m[0] for m in maps] == [x.data_ptr() for x in (k, q, v, Tg, Pg, o)] and keep == []
    assert maps[2] == (v.data_ptr(), (128, Hv, T, B), row(v), (64, 1, 64, 1))
    assert maps[3][1:] == ((64, 4 * Hv * 64), (128,), (64, 64))
    assert L._tensor_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, keep) is maps and len(rec["maps"]) == 6
    other = torch.empty_like(o)
    assert L._tensor_maps(q, k, v, Tg, Pg, other, B, T, Hk, Hv, keep)[:5] == maps[:5]
    wide = torch.empty(1, T, Hk, 256, dtype=torch.bfloat16)[..., :128]  # q's shape, another row stride
    assert L._tensor_maps(wide, k, v, Tg, Pg, o, B, T, Hk, Hv, keep)[1][2] == row(wide)
    assert len(rec["maps"]) == 18

    def refuse_heads_outermost(x, dims, strides, box):
        if len(strides) == 3 and strides[0] > strides[1]:
            raise ValueError("strides")
        return (x.data_ptr(), dims, strides, box)
    L._map = refuse_heads_outermost  # (the fixture's monkeypatch restores it)
    heads_out = q.transpose(1, 2).contiguous().transpose(1, 2)
    maps = L._tensor_maps(heads_out, k, v, Tg, Pg, o, B, T, Hk, Hv, keep)
    assert len(keep) == 1 and torch.equal(keep[0], heads_out) and maps[1][0] == keep[0].data_ptr()
    n = len(L._walk_maps)
    L._tensor_maps(heads_out, k, v, Tg, Pg, o, B, T, Hk, Hv, [])
    assert len(L._walk_maps) == n
    for t in range(1, 300):
        L._tensor_maps(q[:, :t], k[:, :t], v[:, :t], Tg, Pg, o, B, t, Hk, Hv, [])
    assert 0 < len(L._walk_maps) <= 256
