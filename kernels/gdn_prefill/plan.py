"""Which prefill path, split and block shape one call takes: one pure function of the shapes and the card.

Two paths (kernels/gdn_prefill/NOTES.md says why):
- "hopper" (sm_90a, 227 KB of shared memory per block): prep.cu, then gdn_prefill.cu's walk, which computes
  the state and o in one pass on wgmma with TMA copies; long sequences split into segments.
- "portable" (every card from sm_80 to sm_120; no block above 99 KB): prep.cu, then portable.cu's state
  walk (mma.sync; column slices and segments) and its output kernel over all chunks at once.

The shared-memory sizes below are the kernels' layouts; the launcher passes them as -D defines and the
kernels static_assert against them (tests/test_kernels_compile.py compiles every size it can ask for).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..cuda_build import Card

D = 128  # key / value head dim
CH = 64  # chunk length
KST, BST = D + 8, 72  # row strides (elements) of the K / Q tiles and of T / P
RTX_SMEM = 101376  # 99 KB: the most one block gets on sm_86 / sm_89 / sm_120; the portable path's bound
MAX_SLOTS = 65535  # the prep kernel's grid y: (chunk, sequence) slots of one call


# ----------------------------------------------------------------------------- layouts (bytes)

def prep_smem() -> int:
    """gdn_chunk_prep (prep.cu PSM_TOTAL): K, Q; the 16-bit T; the inverse's scratch; rk, rq, G, beta x 4 heads."""
    return 2 * CH * KST * 2 + CH * BST * 2 + 4 * 16 * 20 * 4 + (2 + 2 * PREP_MAX_HEADS) * CH * 4


def hopper_walk_smem(dvs: int) -> int:
    """gdn_chunk_prefill_fwd: the mma.sync walk of dvs columns (Geo<W>::TOTAL in walk_mma.cuh: NST stages of
    K, Q, V, T, P, vectors, then S, rhs lo, scaled u hi / lo), or at 128 the wgmma walk (GeoWG::TOTAL in
    walk_wgmma.cuh: 2 swizzled stages, S, rhs lo, scaled u, 1 KB of alignment)."""
    if dvs == D:
        stage = 3 * CH * D * 2 + 2 * CH * CH * 2 + 4 * CH * 4
        return 2 * stage + D * D * 2 + 2 * CH * D * 2 + 1024
    vst, nst = dvs + 8, 3 if dvs <= 32 else 2
    stage = 2 * CH * KST * 2 + CH * vst * 2 + 2 * CH * BST * 2 + 4 * CH * 4
    return nst * stage + D * vst * 2 + 3 * CH * vst * 2


def portable_state_smem(dvs: int, out_in_walk: bool) -> int:
    """gdn_chunk_state (portable.cu SM_TOTAL): 2 stages of K and the vectors; v (then rhs hi); T; Q when it
    forms o itself; S (later the scaled u); rhs lo (later u). With Q 74 / 82 / 98 KB at 16 / 32 / 64 columns,
    without 57 / 65 / 81 KB."""
    vst = dvs + 8
    stage = CH * KST * 2 + 4 * CH * 4
    return 2 * stage + CH * vst * 2 + CH * BST * 2 + (CH * KST * 2 if out_in_walk else 0) + D * vst * 2 + CH * vst * 2


PORTABLE_OUT_THREADS = 256
# gdn_chunk_out (portable.cu OSM_TOTAL): Q, P, the vectors of one (chunk, head), and a ring of two 32-row
# slices of the 16-bit state and u: 44 KB, two blocks per SM on the RTX cards
PORTABLE_OUT_SMEM = CH * KST * 2 + CH * BST * 2 + 4 * CH * 4 + 2 * 32 * KST * 2

# ----------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Plan:
    path: str            # "hopper" or "portable"
    arch: str            # NVRTC target of the modules
    dv_split: int        # state columns per walk block
    segments: int        # blocks a sequence's chunks may be cut into (1: no sequence split)
    prep_heads: int      # value heads per prep block
    slots: int           # (chunk, sequence) slots of the prep buffers
    prep_smem: int
    walk_smem: int       # hopper: gdn_chunk_prefill_fwd; portable: gdn_chunk_state
    out_smem: int        # portable: gdn_chunk_out (0 on the Hopper path)
    fused_out: bool = False  # portable: the state walk forms o itself (no Hs / Ug, no gdn_chunk_out launch)

    def grid(self, Hv: int, N: int) -> tuple:
        """Grid of the walk (hopper) or state (portable) kernel."""
        nseg = self.segments if self.path == "portable" else 1
        return (D // self.dv_split * nseg, Hv, N)


PREP_MAX_HEADS = 4  # value heads one prep block can take (PREP_MAX_HEADS in prep.cu)
PREP_BLOCKS_PER_SM = 4
# Cycles of one prep block (H200, 4 blocks of 8 warps per SM): ~19k to load K, Q and form K K^T, Q K^T,
# ~9k more per value head (L, the inverse, T; P alongside).
PREP_SHARED_CYCLES, PREP_HEAD_CYCLES = 19_000, 9_000


def prep_heads(Hk: int, Hv: int, slots: int, sms: int) -> int:
    """Value heads per prep block (a divisor of Hv / Hk, at most PREP_MAX_HEADS) with the fewest estimated
    cycles: waves of blocks times one block's life. One head per block when that fits in one wave."""
    r = Hv // Hk
    per_wave = PREP_BLOCKS_PER_SM * sms

    def cost(hpb):
        return -(-(Hv // hpb) * slots // per_wave) * (PREP_SHARED_CYCLES + hpb * PREP_HEAD_CYCLES)
    return min((d for d in range(1, min(r, PREP_MAX_HEADS) + 1) if r % d == 0), key=lambda d: (cost(d), d))


def hopper_dv_split(n_heads_total: int, sms: int) -> int:
    """State columns per block: split the 128 value columns until the grid covers the SMs."""
    for dvs in (128, 64):
        if n_heads_total * (D // dvs) >= 0.9 * sms:
            return dvs
    return 32


# Portable state walk, measured on the H200 (compute_80 build, bench/gdn_prefill_portable.py): microseconds
# per chunk step of one block at 16 / 32 / 64 columns with two blocks per SM, o formed in the walk at 32 and 64
# columns, at 16 the walk's step plus its share of the output kernel. A block alone on its SM steps in ~0.65 of
# that time (clock64 profile: ~5,450 against ~8,400 cycles). With them the plan picks what the sweep found
# fastest at every size of bench/gdn.py (64 columns; 4 segments for one long prompt).
PORTABLE_STEP_US = {16: 3.1, 32: 4.2, 64: 6.7}
PORTABLE_ALONE = 0.65
PORTABLE_SPLITS = (16, 32, 64)
PORTABLE_SEGMENTS = (1, 2, 4, 8, 16)
SEG_MIN_CHUNKS = 8  # segments.cuh: shorter sequences are never split


def out_in_walk(dvs: int, blocks: int, card: Card) -> bool:
    """Whether the state walk forms o itself (portable.cu OUT_IN_WALK: no Hs / Ug round trip through device
    memory, no output kernel) rather than gdn_chunk_out. Its Q S and P u lengthen every step of the sequential
    walk (~1.6 us at 64 columns), which pays when the walk's blocks cover at least half the SMs and are 32 or
    64 columns wide. H200, graph, o in walk / output kernel (bench/results/gdn-portable-out-in-walk-h200.json):
    64 columns x 4 segments 1k 0.056 / 0.065, 4k 0.162 / 0.186, 32k 1.12 / 1.25; 32 columns 0.88-0.91;
    64 blocks on 132 SMs (64 columns, one segment) 1.05-1.16; 16 columns 0.93-1.13 (Q S once per narrow
    slice)."""
    return dvs >= 32 and 2 * blocks >= card.sms


def seg_count(nseg: int, chunks: int) -> int:
    """Segments a sequence of `chunks` chunks is cut into when nseg are asked for (segments.cuh's seg_count)."""
    return nseg if chunks >= SEG_MIN_CHUNKS else 1


def portable_resident(dvs: int, card: Card) -> int:
    """State blocks of dvs columns the card holds at once (one wave), in the layout they mostly take (Q in it
    at 32 and 64 columns)."""
    smem = portable_state_smem(dvs, dvs >= 32) + 1024
    return max(1, min(2, card.smem_per_sm // smem)) * card.sms  # 2: registers' bound


def portable_choice(n_heads_total: int, chunks: int, card: Card, splits=PORTABLE_SPLITS) -> tuple[int, int]:
    """(columns per state block, segments per sequence) with the fewest estimated microseconds: waves of
    resident blocks times chunk steps per block (a segment's share plus one warm-up chunk) times the step
    time at that width (PORTABLE_ALONE of it where every block has its SM to itself); ties go to fewer
    segments, then wider blocks."""
    cap = min(card.smem_per_block, RTX_SMEM)
    best = None
    for dvs in splits:
        smem = portable_state_smem(dvs, dvs >= 32)
        if smem > cap and len(splits) > 1:
            continue
        resident = portable_resident(dvs, card)
        for nseg in PORTABLE_SEGMENTS:
            if nseg > 1 and (chunks < SEG_MIN_CHUNKS or chunks < 2 * nseg):
                continue
            blocks = n_heads_total * (D // dvs) * nseg
            steps = -(-chunks // nseg) + (1 if nseg > 1 else 0)
            alone = PORTABLE_ALONE if resident == card.sms or blocks <= card.sms else 1.0
            cost = -(-blocks // resident) * steps * PORTABLE_STEP_US[dvs] * alone
            key = (round(cost, 6), nseg, -dvs)
            if best is None or key < best[0]:
                best = (key, dvs, nseg)
    return best[1], best[2]


def out_ranks(B: int, T: int, packed: bool, segments: int, slots: int) -> int:
    """Grid x of gdn_chunk_out (portable.cu): the prep slots when packed, else B sequences x the walk's
    segments (the plan's count for T) x the chunks per segment (the walk's last steps first; a short last
    segment leaves ranks with nothing to do)."""
    if packed:
        return slots
    chunks = -(-T // CH)
    return B * segments * -(-chunks // segments)


def prep_slots(B: int, T: int, N: int, packed: bool) -> int:
    """(chunk, head) slots of the prep buffers: B * ceil(T / 64), or ceil(T / 64) + N + 1 when packed."""
    slots = (T + CH - 1) // CH + N + 1 if packed else B * ((T + CH - 1) // CH)
    if slots > MAX_SLOTS:
        raise ValueError(f"gdn prefill: {B} x {T} tokens make {slots} chunks of 64 in one call; the kernel takes "
                         f"at most {MAX_SLOTS} (about 4.19 million tokens): prefill in smaller pieces")
    return slots


@lru_cache(maxsize=512)  # pure, and asked on every prefill call (~13 us of host time each on a CPU core)
def plan(B: int, T: int, N: int, Hk: int, Hv: int, packed: bool, card: Card, path: Optional[str] = None,
         dv_split: Optional[int] = None, segments: Optional[int] = None, arch: Optional[str] = None,
         fused_out: Optional[bool] = None) -> Plan:
    """The plan of one prefill call: B rows of T tokens (packed: N sequences in one row of T), Hk q/k heads,
    Hv value heads, on `card`. path / dv_split / segments / arch / fused_out override the choice (tests and
    benchmarks: e.g. path="portable", arch="compute_80" runs what an RTX card runs); an override that cannot
    run raises ValueError. Hopper: segments is 128 / dv_split when the walk may split sequences, else 1."""
    hopper_ok = card.wgmma and card.smem_per_block >= hopper_walk_smem(32)
    if path is None:
        path = "hopper" if hopper_ok and arch in (None, "sm_90a") else "portable"
    if path not in ("hopper", "portable"):
        raise ValueError(f"gdn prefill path must be 'hopper' or 'portable', got {path!r}")
    if path == "hopper" and not hopper_ok:
        raise ValueError(f"gdn prefill: the Hopper path needs an sm_90a card with {hopper_walk_smem(32)} bytes of "
                         f"shared memory per block; this one is {card.arch} with {card.smem_per_block}")
    slots = prep_slots(B, T, N, packed)
    hpb = prep_heads(Hk, Hv, slots, card.sms)
    chunks = -(-T // CH) if not packed else -(-T // (CH * max(N, 1)))  # a packed call: the mean length
    if path == "hopper":
        dvs = dv_split or hopper_dv_split(N * Hv, card.sms)
        if dvs not in (32, 64, 128):
            raise ValueError(f"dv_split must be 32, 64 or 128 on the Hopper path, got {dvs}")
        nseg = 1 if segments == 1 or dvs == D else D // dvs
        smem = max(hopper_walk_smem(dvs), hopper_walk_smem(D)) if nseg > 1 else hopper_walk_smem(dvs)
        return Plan("hopper", arch or card.arch, dvs, nseg, hpb, slots, prep_smem(), smem, 0)
    if dv_split is not None and dv_split not in PORTABLE_SPLITS:
        raise ValueError(f"dv_split must be one of {PORTABLE_SPLITS} on the portable path, got {dv_split}")
    dvs, auto_nseg = portable_choice(N * Hv, chunks, card, (dv_split,) if dv_split else PORTABLE_SPLITS)
    nseg = segments or auto_nseg
    if not 1 <= nseg <= 16:
        raise ValueError(f"segments must be 1 to 16, got {nseg}")
    if not packed:  # every sequence has T tokens: the kernels cut it into seg_count segments
        nseg = seg_count(nseg, chunks)
    if fused_out is None:
        fused_out = out_in_walk(dvs, N * Hv * (D // dvs) * nseg, card)
    smem = portable_state_smem(dvs, bool(fused_out))
    if smem > card.smem_per_block:
        raise ValueError(f"gdn prefill: dv_split {dvs} needs {smem} bytes of shared memory per block, this GPU "
                         f"allows {card.smem_per_block}; leave dv_split unset and the plan picks one that fits")
    return Plan("portable", arch or card.arch, dvs, nseg, hpb, slots, prep_smem(), smem, PORTABLE_OUT_SMEM,
                bool(fused_out))
