"""Which kernels the prefill launcher picks for a card's shared memory per block, checked on the CPU with
the kernel launches recorded instead of run (the GPU tests check the results of every path)."""
import pytest
import torch

from qwen35_fast.kernels.gdn_prefill import launch as L

H200, A100, RTX = 232448, 166912, 101376  # bytes of shared memory one block may opt in to


class Fn:
    def __init__(self, name, defines):
        self.name, self.defines = name, dict(defines)


@pytest.fixture
def calls(monkeypatch):
    """A card with 132 SMs; get_function and launch record what would run."""
    rec = []
    monkeypatch.setattr(L, "_num_sms", lambda dev: 132)
    monkeypatch.setattr(L, "_prefer_smem", lambda fn, dev: None)
    monkeypatch.setattr(L, "get_function", lambda src, name, dev, defines: Fn(name, defines))
    monkeypatch.setattr(L, "launch", lambda fn, grid, block, args, shared_mem=0:
                        rec.append((fn.name, fn.defines.get("DVS"), tuple(grid), shared_mem, args)))
    monkeypatch.setattr(L, "_uses_tma", lambda dev, defines: False)  # the TMA test below turns it on
    monkeypatch.setattr(L, "_zero_maps", lambda: ["zero map"] * 5)
    return rec


SEG = -6  # the sequential kernel's `seg` argument: before the five tensor maps


def run(monkeypatch, limit, B=1, T=4096, Hk=16, Hv=32, **kw):
    monkeypatch.setattr(L, "max_shared_memory", lambda dev: limit)
    q = torch.zeros(B, T, Hk, 128, dtype=torch.bfloat16)
    v = torch.zeros(B, T, Hv, 128, dtype=torch.bfloat16)
    a = torch.zeros(B, T, Hv)
    return L.gdn_chunk_prefill_cuda(q, q, v, a, a, torch.zeros(Hv), torch.zeros(Hv), **kw)


def test_hopper_takes_the_two_kernel_path_with_the_sequence_split(calls, monkeypatch):
    run(monkeypatch, H200)
    assert [c[0] for c in calls] == ["gdn_chunk_prep", "gdn_chunk_prefill_fwd"]
    name, dvs, grid, smem, args = calls[1]
    assert dvs == 32 and grid == (4, 32, 1)  # B=1, Hv=32: four blocks per head
    assert int(args[SEG]) == 1 and smem == L.smem_bytes(128) <= H200  # the split walks 128 columns


def test_no_split_when_asked_or_with_whole_state_columns(calls, monkeypatch):
    run(monkeypatch, H200, segments=False)
    assert int(calls[-1][4][SEG]) == 0 and calls[-1][3] == L.smem_bytes(32)
    run(monkeypatch, H200, B=8)  # 256 heads fill the card with DVS 128: nothing to split
    assert calls[-1][1] == 128 and int(calls[-1][4][SEG]) == 0
    assert list(calls[-1][4][-5:]) == ["zero map"] * 5  # no tensor maps where the kernel does not use them


@pytest.mark.parametrize("limit", [A100, RTX])
@pytest.mark.parametrize("B", [1, 8])
def test_smaller_cards_take_split_o_and_every_block_fits(calls, monkeypatch, limit, B):
    run(monkeypatch, limit, B=B)
    assert [c[0] for c in calls] == ["gdn_chunk_prep", "gdn_chunk_state", "gdn_chunk_out"]
    assert all(c[3] <= limit for c in calls)


def test_forced_configuration_that_does_not_fit_is_a_clear_error(calls, monkeypatch):
    with pytest.raises(ValueError, match="shared memory per block.*leave dv_split"):
        run(monkeypatch, RTX, dv_split=32)
    with pytest.raises(ValueError, match="fused kernel"):
        run(monkeypatch, A100, fused=True)
    with pytest.raises(ValueError, match="split_o at dv_split 128"):
        run(monkeypatch, RTX, variant="split_o", dv_split=128)
    assert calls == [] or all(c[3] <= RTX for c in calls)


def test_prep_value_heads_per_block(monkeypatch):
    monkeypatch.setattr(L, "_num_sms", lambda dev: 132)
    assert L.choose_prep_heads(16, 32, 16, None) == 1  # 1,024 tokens: one wave of blocks either way
    assert L.choose_prep_heads(16, 32, 512, None) == 2  # 32k tokens: K K^T, Q K^T once per q/k head
    assert L.choose_prep_heads(16, 48, 512, None) == 3
    assert L.choose_prep_heads(16, 16, 512, None) == 1


def test_hopper_passes_tensor_maps_of_k_q_v_t_p_o(calls, monkeypatch):
    """On sm_90 the walk's copies are TMA tiles: 64 tokens x 64 columns of K, Q, V ([B][T][H][128], strides
    in bytes as the tensors have them), 64 x 64 tiles of T and P, and o's tiles like V's (o contiguous)."""
    made = []

    class Map:
        def __init__(self, ptr, dims, strides, box, promotion=2):
            made.append((ptr, dims, strides, box))
    monkeypatch.setattr(L, "_uses_tma", lambda dev, defines: True)
    monkeypatch.setattr(L, "TensorMap", Map)
    L._maps.clear()
    B, T, Hk, Hv = 2, 300, 2, 4
    qkv = torch.zeros(B, T, (2 * Hk + Hv) * 128, dtype=torch.bfloat16)  # q, k, v as slices of one projection
    q = qkv[..., :Hk * 128].view(B, T, Hk, 128)
    k = qkv[..., Hk * 128:2 * Hk * 128].view(B, T, Hk, 128)
    v = qkv[..., 2 * Hk * 128:].view(B, T, Hv, 128)
    monkeypatch.setattr(L, "max_shared_memory", lambda dev: H200)
    a = torch.zeros(B, T, Hv)
    L.gdn_chunk_prefill_cuda(q, k, v, a, a, torch.zeros(Hv), torch.zeros(Hv))
    L._maps.clear()
    row = qkv.stride(1) * 2
    slots = B * ((T + 63) // 64)
    assert [m[1:] for m in made] == [
        ((128, Hk, T, B), (256, row, row * T), (64, 1, 64, 1)),  # k
        ((128, Hk, T, B), (256, row, row * T), (64, 1, 64, 1)),  # q
        ((128, Hv, T, B), (256, row, row * T), (64, 1, 64, 1)),  # v
        ((64, slots * Hv * 64), (128,), (64, 64)),                # T
        ((64, slots * Hv * 64), (128,), (64, 64)),                # P
        ((128, Hv, T, B), (256, Hv * 256, Hv * 256 * T), (64, 1, 64, 1)),  # o
    ]
    assert [m[0] for m in made[:3]] == [k.data_ptr(), q.data_ptr(), v.data_ptr()]
    assert made[5][0] == calls[-1][4][8].data_ptr()  # the o the kernel writes
    assert all(isinstance(x, Map) for x in calls[-1][4][-6:])


def test_tensor_maps_fall_back_to_a_packed_copy(calls, monkeypatch):
    """Strides the copy engine refuses (here: heads outermost, as a [B, H, T, D] tensor viewed as
    [B, T, H, D]) make the launcher map a packed copy instead of failing."""
    class Map:
        def __init__(self, ptr, dims, strides, box, promotion=2):
            if list(strides) != sorted(strides):
                raise ValueError("strides")
            self.ptr, self.strides = ptr, strides
    monkeypatch.setattr(L, "_uses_tma", lambda dev, defines: True)
    monkeypatch.setattr(L, "TensorMap", Map)
    monkeypatch.setattr(L, "max_shared_memory", lambda dev: H200)
    L._maps.clear()
    B, T, H = 1, 200, 2
    q = torch.zeros(B, H, T, 128, dtype=torch.bfloat16).transpose(1, 2)  # strides (.., 128, T * 128, 1)
    a = torch.zeros(B, T, H)
    L.gdn_chunk_prefill_cuda(q, q, q, a, a, torch.zeros(H), torch.zeros(H))
    L._maps.clear()
    maps = calls[-1][4][-6:]
    assert [m.strides for m in maps[:3]] == [(256, H * 256, H * 256 * T)] * 3
    assert q.data_ptr() not in {m.ptr for m in maps}
    assert len({m.ptr for m in maps[:3]}) == 3  # each copy stays alive until the launch: no reuse of its memory
