"""plan.plan, the one function that picks the prefill path, split and block shapes, for the cards users own
(no GPU needed). The shared-memory sizes it hands the launcher are checked against the kernels' layouts by
tests/test_kernels_compile.py (the kernels static_assert the sizes passed as -D defines)."""
import pytest

from qwen35_fast.kernels.gdn_prefill import plan as P

CARDS = {  # NVRTC target, SMs, shared memory one block may opt in to, shared memory per SM
    "A100": P.Card("sm_80", 108, 166912, 167936),
    "RTX 3090": P.Card("sm_86", 82, 101376, 102400),
    "RTX 4090": P.Card("sm_89", 128, 101376, 102400),
    "RTX 5090": P.Card("sm_120", 170, 101376, 102400),
    "H100": P.Card("sm_90a", 132, 232448, 233472),
    "H200": P.Card("sm_90a", 132, 232448, 233472),
}
SIZES = [(1, 1), (1, 64), (1, 1024), (1, 4096), (1, 16384), (1, 32768), (8, 4096), (64, 100)]
Hk, Hv = 16, 32


@pytest.mark.parametrize("name", CARDS)
@pytest.mark.parametrize("B,T", SIZES)
def test_every_card_gets_a_plan_that_fits(name, B, T):
    card = CARDS[name]
    p = P.plan(B, T, B, Hk, Hv, False, card)
    assert p.path == ("hopper" if name in ("H100", "H200") else "portable")
    assert p.arch == card.arch
    assert max(p.prep_smem, p.walk_smem, p.out_smem) <= card.smem_per_block
    assert p.slots == B * -(-T // 64) and p.prep_heads in (1, 2)
    if p.path == "portable":
        assert max(p.walk_smem, p.out_smem) <= P.RTX_SMEM
        assert p.walk_smem == P.portable_state_smem(p.dv_split, p.fused_out) and p.out_smem == P.PORTABLE_OUT_SMEM
        assert p.dv_split in (16, 32, 64) and 1 <= p.segments <= 16
        assert p.segments == 1 or -(-T // 64) >= max(P.SEG_MIN_CHUNKS, 2 * p.segments)
    else:
        assert p.out_smem == 0 and p.dv_split in (32, 64, 128)
        assert p.segments == (1 if p.dv_split == 128 else 128 // p.dv_split)
        assert p.walk_smem >= P.hopper_walk_smem(128) or p.segments == 1


def test_hopper_plans():
    h200 = CARDS["H200"]
    p = P.plan(1, 32768, 1, Hk, Hv, False, h200)  # 32 heads: 32-column blocks, each head's 4 split the sequence
    assert (p.dv_split, p.segments, p.grid(Hv, 1)) == (32, 4, (4, Hv, 1))
    assert p.walk_smem == max(P.hopper_walk_smem(32), P.hopper_walk_smem(128))
    p = P.plan(8, 4096, 8, Hk, Hv, False, h200)  # 256 heads fill the card with whole heads
    assert (p.dv_split, p.segments, p.walk_smem) == (128, 1, P.hopper_walk_smem(128))
    p = P.plan(1, 32768, 1, Hk, Hv, False, h200, segments=1)
    assert (p.segments, p.walk_smem) == (1, P.hopper_walk_smem(32))


def test_portable_plans_on_the_h200_as_an_rtx_build():
    h200 = CARDS["H200"]
    for B, T in SIZES:
        p = P.plan(B, T, B, Hk, Hv, False, h200, path="portable", arch="compute_80")
        assert p.path == "portable" and p.arch == "compute_80" and p.walk_smem <= P.RTX_SMEM
    long = P.plan(1, 32768, 1, Hk, Hv, False, h200, path="portable")
    assert long.segments > 1  # one long prompt: the sequence split fills the card
    assert long.grid(Hv, 1) == (128 // long.dv_split * long.segments, Hv, 1)
    assert P.plan(1, 64 * 7, 1, Hk, Hv, False, h200, path="portable").segments == 1  # too short to split


def test_a_card_with_fewer_sms_or_one_block_per_sm_never_gets_more_resident_work_than_it_holds():
    """The cost model counts resident blocks from the shared memory per SM: a 99 KB block is one per SM on
    an RTX card, two on the H200."""
    for name in ("RTX 3090", "RTX 4090", "RTX 5090"):
        card = CARDS[name]
        assert card.smem_per_sm // (P.portable_state_smem(64, True) + 1024) == 1
        assert P.portable_resident(64, card) == card.sms
    assert CARDS["H200"].smem_per_sm // (P.portable_state_smem(64, True) + 1024) == 2
    assert P.portable_resident(64, CARDS["H200"]) == 2 * CARDS["H200"].sms


def test_forced_choices_and_their_errors():
    a100, h200 = CARDS["A100"], CARDS["H200"]
    assert P.plan(1, 4096, 1, Hk, Hv, False, a100, dv_split=16, segments=3).segments == 3
    with pytest.raises(ValueError, match="Hopper path needs an sm_90a card"):
        P.plan(1, 4096, 1, Hk, Hv, False, a100, path="hopper")
    with pytest.raises(ValueError, match="dv_split must be one of"):
        P.plan(1, 4096, 1, Hk, Hv, False, a100, dv_split=128)
    with pytest.raises(ValueError, match="dv_split must be 32, 64 or 128"):
        P.plan(1, 4096, 1, Hk, Hv, False, h200, dv_split=16)
    with pytest.raises(ValueError, match="segments must be 1 to 16"):
        P.plan(1, 4096, 1, Hk, Hv, False, a100, segments=17)
    with pytest.raises(ValueError, match="path must be"):
        P.plan(1, 4096, 1, Hk, Hv, False, a100, path="fused")
    small = P.Card("sm_86", 40, 65536, 102400)  # a card whose blocks get 64 KB: a forced 64-column walk needs more
    with pytest.raises(ValueError, match="dv_split 64 needs 100352 bytes of shared memory per block, this GPU "
                                         "allows 65536"):
        P.plan(1, 4096, 1, Hk, Hv, False, small, dv_split=64)


def test_packed_slots_and_the_one_launch_limit():
    assert P.prep_slots(8, 4096, 8, False) == 512
    assert P.prep_slots(1, 1000, 3, True) == 16 + 3 + 1  # packed: one spare slot per sequence
    with pytest.raises(ValueError, match="prefill in smaller pieces"):
        P.prep_slots(1, 64 * 65536, 1, False)
    assert P.prep_slots(1, 64 * P.MAX_SLOTS, 1, False) == P.MAX_SLOTS == 65535  # the grid's y limit itself runs
    p = P.plan(1, 1000, 3, Hk, Hv, True, CARDS["RTX 4090"])
    assert p.slots == 20 and p.grid(Hv, 3)[1:] == (Hv, 3)


def test_prep_heads_per_block():
    assert P.prep_heads(16, 32, 16, 132) == 1  # 1,024 tokens: one wave of blocks either way
    assert P.prep_heads(16, 32, 512, 132) == 2  # 32k tokens: K K^T, Q K^T once per q/k head
    assert P.prep_heads(16, 48, 512, 132) == 3
    assert P.prep_heads(16, 16, 512, 132) == 1


def test_layout_sizes():
    """The sizes the kernels are built with (each also static_asserted in its source)."""
    assert P.prep_smem() == 51712  # 4 prep blocks per SM on every card from sm_80
    assert [P.portable_state_smem(d, True) for d in (16, 32, 64)] == [75776, 83968, 100352]
    assert [P.portable_state_smem(d, False) for d in (16, 32, 64)] == [58368, 66560, 82944]
    assert 2 * (P.portable_state_smem(64, False) + 1024) <= 167936  # two blocks on an A100 SM (164 KB)
    assert P.PORTABLE_OUT_SMEM == 45056  # two output blocks per SM on the RTX cards (100 KB each)
    assert 2 * (P.PORTABLE_OUT_SMEM + 1024) <= 102400  # 1 KB reserved per block of an SM's 100 KB
    assert P.hopper_walk_smem(128) == 199680 and P.hopper_walk_smem(32) == 203776


def test_development_patches_still_apply():
    """Every bench/patches/*.patch (clock64 marks for the walks, experiments waiting for a GPU run) applies to
    today's sources."""
    import shutil
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout")
    patches = sorted((root / "bench" / "patches").glob("*.patch"))
    assert patches
    for patch in patches:
        r = subprocess.run(["git", "apply", "--check", str(patch.relative_to(root))], cwd=root,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{patch.name}: {r.stderr}"


def test_out_ranks_cover_every_chunk_with_at_most_a_short_segments_padding():
    """gdn_chunk_out's grid: packed calls one rank per prep slot; B rows of T tokens B x segments x chunks per
    segment, at least every chunk and fewer than one padding rank per segment beyond (a short last segment)."""
    assert P.out_ranks(1, 4096, True, 4, 77) == 77
    for B, T, nseg in ((1, 1024, 4), (2, 700, 3), (1, 566, 4), (8, 4096, 1), (1, 32768, 4), (3, 300, 4), (1, 1, 1)):
        chunks = -(-T // 64)
        ns = P.seg_count(nseg, chunks)  # what the plan hands the launcher
        ranks = P.out_ranks(B, T, False, ns, B * chunks)
        assert B * chunks <= ranks < B * (chunks + ns)
        # portable.cu reads a rank as (row, segment, chunk of the segment), ceil(chunks / segments) of them a
        # segment: fewer ranks would leave the last segments' chunks unwritten
        assert ranks == B * ns * -(-chunks // ns)


def test_a_forced_split_of_short_sequences_is_one_segment_in_the_plan_of_an_unpacked_call():
    """The kernels cut a sequence of fewer than SEG_MIN_CHUNKS chunks into one segment: an unpacked call's plan
    says so (the output kernel and its grid take the plan's count as is); a packed call keeps the count asked
    for, as its sequences' lengths differ and the walk decides per sequence."""
    h200 = CARDS["H200"]
    assert P.plan(1, 64 * 7, 1, Hk, Hv, False, h200, path="portable", segments=4).segments == 1
    assert P.plan(1, 64 * 8, 1, Hk, Hv, False, h200, path="portable", segments=4).segments == 4
    assert P.plan(1, 64 * 7, 2, Hk, Hv, True, h200, path="portable", segments=4).segments == 4
    assert [P.seg_count(4, c) for c in (1, 7, 8, 100)] == [1, 1, 4, 4]


def test_the_portable_walk_forms_o_where_its_blocks_are_wide_and_cover_half_the_sms():
    """fused_out (o formed in the state walk, no output kernel): 32- or 64-column blocks covering at least half
    the SMs (the H200's plans at every size of bench/gdn.py); 16 columns or fewer blocks keep gdn_chunk_out; an
    override wins; the Hopper path never sets it."""
    h200 = CARDS["H200"]
    for B, L in SIZES:
        if B * L >= 1024:
            assert P.plan(B, L, B, Hk, Hv, False, h200, path="portable").fused_out, (B, L)
    for card in CARDS.values():
        for B, L in SIZES:
            p = P.plan(B, L, B, Hk, Hv, False, card, path="portable")
            blocks = B * Hv * (128 // p.dv_split) * p.segments
            assert p.fused_out == (p.dv_split >= 32 and 2 * blocks >= card.sms), (card, B, L)
    assert not P.out_in_walk(16, 1000, h200) and not P.out_in_walk(64, 64, h200) and P.out_in_walk(64, 66, h200)
    p = P.plan(1, 1024, 1, Hk, Hv, False, h200, path="portable", fused_out=False)
    assert not p.fused_out and p.walk_smem == P.portable_state_smem(p.dv_split, False)
    assert P.plan(1, 16384, 1, Hk, Hv, False, h200, path="portable", fused_out=True).fused_out
    assert not P.plan(1, 1024, 1, Hk, Hv, False, h200).fused_out  # hopper
