"""The Qwen3.5 text model: weights and the forward pass (prefill over a prompt, one-token decode).

Projections that read the same input are fused into one matrix at load time (GDN's qkv/z/b/a,
attention's q+gate/k/v, the MLP's gate/up), so each layer runs three or four matmuls. The GDN math
(causal conv1d, gated delta rule) and the RMSNorms go through `kernels`, which runs CUDA kernels or the
PyTorch references according to the backend picked at load.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import progress, rope
from .config import LINEAR, TextConfig
from .devices import empty_cache
from .errors import Qwen35Error
from .host import upload
from .kv_pool import PAD, SequenceBlocks
from .kv_store import KVStore, default_budget_bytes
from .packed import apply_packed, flat_view, pack_views, views_like
from .quant import Int8Weight, embedding, linear, matrix

# A prefill that keeps the GDN states at cuts (prefix.py: the end of the system prompt, of the last image, of
# the user turn) gets them, on the CUDA kernels, in one of two forms (cut_form), and on the PyTorch path from the
# recurrence run in parts (a conv and a GDN call per part in each of the 24 GDN layers):
# - kept (KeptCuts): the prompt's own walk stores the state at each cut's chunk boundary (the cut rounded down to
#   64 tokens) as it passes it (kernels.gdn_chunk_prefill keep), and one more call walks the rest of each cut's
#   chunk from there for TAIL_LAYERS layers at once (the layers as heads): no token walked twice but the tails.
# - packed (PackedCuts): one GDN call walks the prompt and each prefix before a cut again, as packed sequences from
#   the same initial state: one call a layer, for the GDN work and a copy of the rows of the prefixes again.
# Where the GPU outruns the host (Hopper cards) a short prompt waits for the host's calls, and the packed form's
# single call a layer wins; past PACKED_CUT_TOKENS (the prompt and the prefixes together) its recompute costs more
# than the kept form's calls. H100, a 9B-shaped model, cold prefill with cuts at (200, T - 65, T - 5), kept / parts
# / packed wall ms (bench/results/gdn-cuts-tails8-ab-h100.json): T = 600 (1,930 tokens packed) 26.2 / 37.1 /
# 23.0; 1,088 (cuts 1,023, 1,083) 28.6 / 29.7 / 30.3; 1,300 33.4 / 35.3 / 35.6; 2,600 63.6 / 65.8 / 68.5; 4,096
# 99.9 / 103.3 / 106.7; 8,192 196.0 / 195.9 / 210.6. The 1,088-token image prompt read cold with its states kept
# (bench/results/vision-e2e-cuts-h100.json): kept 41.8, parts 42.6, packed 44.3 ms (the tower's CUDA graph keeps
# the GPU busy while the host queues the text layers). Other cards are GPU-bound (the host's calls hide under their
# GEMMs): there the kept form walks each token once.
PACKED_CUT_TOKENS = 2048

# A prompt longer than PREFILL_PIECE tokens is read in pieces of that many, each attending to the K/V the
# pieces before it left in the cache and starting from their GDN states: what a layer holds at once is one
# piece's activations, not the whole prompt's (9B, by runtime/memory.py's estimate: ~200 KB a token, 1.6 GiB a
# piece, where a 24,000-token video prompt in one pass takes 4.6 GiB), and the GEMMs of 8,192 rows run at the
# full rate. The same computation as one pass, up to the rounding of where the recurrence and the attention's
# blocks are cut.
PREFILL_PIECE = 8192


@dataclass(frozen=True)
class PackedCuts:
    """A prefill's cuts as extra sequences of one GDN kernel call: the T tokens, then the first c tokens for
    each cut c (cu_seqlens), and the cuts on the device, where the conv states are gathered."""
    cuts: tuple
    cu_seqlens: torch.Tensor  # int32 [2 + len(cuts)], on the device
    ends: torch.Tensor  # long [len(cuts)], on the device: the points whose conv states are kept

    @staticmethod
    def build(cuts, T: int, device) -> "PackedCuts":
        cuts = tuple(int(c) for c in cuts)
        bounds = [0, T]
        for c in cuts:
            bounds.append(bounds[-1] + c)
        return PackedCuts(cuts, upload(bounds, torch.int32, device), upload(list(cuts), torch.long, device))


def cut_form(cuts, T: int, be: kernels.Backend, device) -> "PackedCuts | KeptCuts | None":
    """How a prefill of T tokens gets its GDN states at cuts (increasing, inside the T tokens; the comment
    above): packed on a Hopper card while the prompt and the prefixes add up to at most PACKED_CUT_TOKENS, else
    kept, on the kernels; None (the parts, one by one) without cuts, on the PyTorch path, or with more cuts than
    the walk keeps states."""
    if not cuts or not be.use_cuda:
        return None
    if T + sum(cuts) <= PACKED_CUT_TOKENS and kernels.hopper_card(device):
        return PackedCuts.build(cuts, T, device)
    return KeptCuts.plan(cuts, be, device)


@dataclass
class KeptCuts:
    """A prefill's cuts as the GDN kernels take them (the comment above): the chunk boundaries the walk keeps the
    states at, and the tails after them as packed sequences of one more call, from those states. One per prefill:
    each GDN layer leaves its tails' rows and its boundary states here (gather), and one call walks the tails of
    TAIL_LAYERS layers at a time (walk_tails), the layers side by side as heads."""
    cuts: tuple
    bounds: tuple  # each cut rounded down to a chunk boundary: the walk's keep
    tails: tuple  # (boundary, cut) of the cuts off a boundary, in order
    cu_tails: torch.Tensor | None  # int32 [len(tails) + 1] on the device
    tailed: torch.Tensor | None  # long [len(tails)] on the device: the cuts (their indices) the tails end at
    tail_rows: torch.Tensor | None  # long [sum of the tails' lengths] on the device: the prompt rows they walk
    ends: torch.Tensor  # long [len(cuts)], on the device: the points whose conv states are kept
    gathered: list = field(default_factory=list)  # (layer, conv rows, (b, a) rows, boundary states) of each layer

    @staticmethod
    def plan(cuts, be: kernels.Backend, device) -> "KeptCuts | None":
        """The kept form for cuts (increasing, inside the prompt), or None where the parts run one by one (no
        cuts, the PyTorch path, or more cuts than the walk keeps states)."""
        cuts = tuple(int(c) for c in cuts)
        if not cuts or not be.use_cuda or len(cuts) > kernels.GDN_MAX_KEEP:
            return None
        bounds = tuple(c - c % kernels.GDN_CHUNK for c in cuts)
        tailed = [n for n, (b, c) in enumerate(zip(bounds, cuts)) if b < c]
        tails = tuple((bounds[n], cuts[n]) for n in tailed)
        cu = [0]
        for b, c in tails:
            cu.append(cu[-1] + c - b)
        if not tails:
            return KeptCuts(cuts, bounds, tails, None, None, None, upload(list(cuts), torch.long, device))
        rows = [r for b, c in tails for r in range(b, c)]
        return KeptCuts(cuts, bounds, tails, upload(cu, torch.int32, device), upload(tailed, torch.long, device),
                        upload(rows, torch.long, device), upload(list(cuts), torch.long, device))

    def gather(self, i: int, y, ba, hk, model: "Qwen35Model", be: kernels.Backend) -> None:
        """GDN layer i's part of the tails: its conv output's and (b, a)'s rows of them ([1, T, ...]) and the
        states its walk kept at the boundaries hk [cuts, Hv, 128, 128], into which the tails' states go. Every
        TAIL_LAYERS layers (and after the last, walk_tails) one call walks the tails of the layers gathered."""
        self.gathered.append((i, y[0].index_select(0, self.tail_rows), ba[0].index_select(0, self.tail_rows), hk))
        if len(self.gathered) == TAIL_LAYERS:
            self.walk_tails(model, be)

    def walk_tails(self, model: "Qwen35Model", be: kernels.Backend) -> None:
        """The gathered layers' tails in one GDN call from their boundary states, each tail's end state into its
        cut's place in its layer's hk. The layers stand side by side as heads: value head h of the l-th layer is
        head l Hv + h, its q / k head l Hk + h // (Hv / Hk), the kernels' map of value heads to q / k heads."""
        if not self.gathered:
            return
        c = model.config
        hv, d = c.linear_num_value_heads, c.linear_key_head_dim
        layers, ys, bas, kept = zip(*self.gathered)
        self.gathered.clear()
        rows, n = self.tail_rows.shape[0], len(layers)
        y = torch.stack(ys, dim=1)  # [rows, layers, conv_dim]
        q, k, v = (t.reshape(1, rows, -1, d) for t in model._qkv_heads(y))  # [1, rows, layers x heads, d]
        b, a = (t.reshape(1, rows, n * hv) for t in torch.stack(bas, dim=1).split([hv, hv], dim=-1))
        h0 = torch.stack(kept, dim=1).index_select(0, self.tailed).view(-1, n * hv, d, d)
        mixers = [model.blocks[i].mixer for i in layers]
        A_log, dt_bias = torch.cat([m.A_log for m in mixers]), torch.cat([m.dt_bias for m in mixers])
        _, ht = kernels.gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, initial_state=h0,
                                          cu_seqlens=self.cu_tails, backend=be)
        ht = ht.view(-1, n, hv, d, d)
        for l, hk in enumerate(kept):
            hk.index_copy_(0, self.tailed, ht[:, l])


# The kept form walks its cuts' tails (KeptCuts.walk_tails) in one call per this many GDN layers: fewer calls
# (each ~0.15 ms of host) against the memory of the call (the states at the cuts gathered, at the tails' starts and
# at their ends: 144 MiB for three cuts of eight layers on the 9B, whose state is 2 MiB a layer).
TAIL_LAYERS = 8


class GDNLayer(nn.Module):
    def __init__(self, c: TextConfig, dtype, device, int8: bool):
        super().__init__()
        h, hv = c.hidden_size, c.linear_num_value_heads
        e = dict(dtype=dtype, device=device)
        self.in_proj = matrix(c.conv_dim + c.value_dim + 2 * hv, h, dtype, device, int8)
        self.conv_w = nn.Parameter(torch.empty(c.conv_dim, c.linear_conv_kernel_dim, **e), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hv, dtype=torch.float32, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=torch.float32, device=device), requires_grad=False)
        self.norm_w = nn.Parameter(torch.empty(c.linear_value_head_dim, **e), requires_grad=False)
        self.out_proj = matrix(h, c.value_dim, dtype, device, int8)


class AttentionLayer(nn.Module):
    def __init__(self, c: TextConfig, dtype, device, int8: bool):
        super().__init__()
        qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.qkv = matrix(2 * qd + 2 * kd, c.hidden_size, dtype, device, int8)
        self.o_proj = matrix(c.hidden_size, qd, dtype, device, int8)
        self.q_norm = nn.Parameter(torch.empty(c.head_dim, dtype=torch.float32, device=device), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(c.head_dim, dtype=torch.float32, device=device), requires_grad=False)


class Block(nn.Module):
    """One decoder layer: a token mixer (GDN or attention) and the MLP, each behind a norm."""

    def __init__(self, c: TextConfig, kind: str, dtype, device, int8: bool):
        super().__init__()
        self.kind = kind
        h = c.hidden_size
        self.input_norm = nn.Parameter(torch.empty(h, dtype=torch.float32, device=device), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(h, dtype=torch.float32, device=device), requires_grad=False)
        self.mixer = (GDNLayer if kind == LINEAR else AttentionLayer)(c, dtype, device, int8)
        self.gate_up = matrix(2 * c.intermediate_size, h, dtype, device, int8)
        self.down = matrix(h, c.intermediate_size, dtype, device, int8)


class Cache:
    """One sequence's state after `length` tokens: the GDN layers' conv and recurrent states, and the
    attention layers' K/V in blocks of the model's paged store (kv_store.py).

    conv[i]: [1, conv_dim, W-1]; ssm[i]: [1, Hv, Dk, Dv] fp32 (GDN layers, None elsewhere); seq: this
    sequence's blocks in `store` (positions 0 .. length-1 hold K/V; room for `capacity`), given back when
    the Cache is collected. rope_delta: what a token appended at slot `length` adds to its slot to get
    its rotary position (0 for text; negative after images, whose tokens share positions; see rope.py).
    """

    def __init__(self, conv: list, ssm: list, store: KVStore, seq: SequenceBlocks | None = None,
                 rope_delta: int = 0):
        self.conv, self.ssm, self.store, self.rope_delta = conv, ssm, store, rope_delta
        self.seq = seq if seq is not None else store.sequence(self, 0)

    @property
    def length(self) -> int:
        return self.seq.num_tokens

    @length.setter
    def length(self, n: int) -> None:
        self.seq.num_tokens = n

    @property
    def capacity(self) -> int:
        return self.seq.capacity(self.store.block_size)

    @torch.compiler.disable  # host bookkeeping under a lock; and dynamo fails on the message's format spec
    def reserve(self, capacity: int) -> None:
        """Room for `capacity` positions: blocks appended (KVStore.reserve: an auto store grows, a fixed one
        names the shortage)."""
        self.store.reserve(self.seq, capacity, f"room for {capacity:,} tokens")

    def clone(self, capacity: int | None = None, device: torch.device | None = None) -> "Cache":
        """A fork: the same K/V blocks, shared (a partly filled last block copied, since the fork writes
        after it), and copies of the GDN states on `device` (default: where they are); room for `capacity`."""
        return self.restart(GDNState(self.conv, self.ssm, self.length, self.rope_delta),
                            max(capacity or self.capacity, self.length), device)

    def gather_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the K and V of positions 0 .. length-1, [length, Hkv, head_dim] per attention layer
        (tests and inspection; the forward pass reads the blocks where they are)."""
        slots = self.store.slots(self.seq, 0, self.length)
        flat = lambda t: t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])  # noqa: E731
        return [(flat(self.store.k[j])[slots], flat(self.store.v[j])[slots]) for j in range(self.store.k.shape[0])]

    def to(self, device: torch.device | str) -> None:
        """Moves the GDN states to `device`, in place (the K/V stay in the store, which moves with the
        model: a cached prefill can wait in system RAM while its model is unloaded)."""
        _move(self.conv, device)
        _move(self.ssm, device)

    def restart(self, state: "GDNState", capacity: int, device: torch.device | None = None,
                copy: bool = True) -> "Cache":
        """A new cache at the point `state` was taken: this cache's first `state.length` K/V positions (the
        tokens this cache held then; they never change), shared, and copies of `state`'s GDN states on
        `device` (default: where they are), with room for `capacity` tokens. Neither input changes (with
        copy off the states are state's own where they lie on `device`: for a caller that replaces
        them without writing into them)."""
        if state.length > self.length:
            raise ValueError(f"Cache.restart: a state after {state.length} tokens does not fit a cache of {self.length}")
        return Cache.resume(self.store, self.seq.blocks, state, capacity, device, copy)

    @staticmethod
    def resume(store: KVStore, blocks, state: "GDNState", capacity: int, device: torch.device | None = None,
               copy: bool = True, snapshot=None) -> "Cache":
        """A cache whose first state.length positions are those of `blocks` (shared, a partly filled last one
        copied) with copies of `state`'s GDN states (copy: see restart); room for `capacity` tokens.
        snapshot: the kv_pool.Snapshot blocks and state come from (kept while the cache takes its blocks)."""
        cache = Cache(_take(state.conv, device, copy), _take(state.ssm, device, copy), store, SequenceBlocks(),
                      state.rope_delta)
        cache.seq = store.share(cache, blocks, state.length, capacity, f"a sequence of {capacity:,} tokens", snapshot)
        return cache


@dataclass(eq=False)
class GDNState:
    """The GDN layers' conv and recurrent states after the first `length` tokens of a prompt, and the
    rope_delta there. With the K/V of those tokens it is the whole model state at that point, so a prompt
    that shares those tokens can restart from it (Cache.restart). Same shapes as Cache.conv / Cache.ssm;
    9B: 24 x [32, 128, 128] fp32 + 24 x [8192, 3], 49 MiB."""
    conv: list
    ssm: list
    length: int
    rope_delta: int = 0

    def to(self, device: torch.device | str) -> None:
        """Moves the states to `device`, in place (like Cache.to); packed states stay packed."""
        _move(self.conv, device)
        _move(self.ssm, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm if t is not None)

    def own(self) -> "GDNState":
        """The same tensors in lists of its own (no copy): `to` on it moves what it holds, never the lists of
        the state it came from (a Prefill's turn and the prefix cache's snapshot of that point)."""
        return GDNState(list(self.conv), list(self.ssm), self.length, self.rope_delta)

    def packed(self) -> "GDNState":
        """The same state with the conv states and the recurrent states each in one flat tensor (the list
        entries views of it), so that a graphed prefill copies it in with two copies, not one a layer
        (prefill_graph.PaddedPrefill); self when already so."""
        if all(flat_view(xs) is not None for xs in (self.conv, self.ssm) if any(t is not None for t in xs)):
            return self
        return GDNState(pack_views(self.conv), pack_views(self.ssm), self.length, self.rope_delta)


def _move(xs: list, device) -> None:
    """The tensors of xs moved to `device`, in place in the list: a packed list (GDNState.packed) in one copy, and
    packed still (a graphed prefill from it copies it in at once)."""
    apply_packed(xs, lambda t: t.to(device))


def _take(xs: list, device, copy: bool) -> list:
    """The tensors of xs on `device` (default: where each is), copies when `copy`: one copy for a packed
    list (GDNState.packed), nothing at all for a list already there without copy."""
    dev = torch.device(device) if device is not None else None
    if not copy and all(t is None or dev is None or t.device == dev for t in xs):
        return list(xs)
    flat = flat_view(xs)
    if flat is None:
        return [None if t is None else t.to(dev or t.device, copy=copy) for t in xs]
    return views_like(flat.to(dev or flat.device, copy=copy), xs)


class DecodeSlot:
    """Where the next decoded token goes, kept on the device so a CUDA graph can replay the step: pos [1]
    (its slot), the paged attention's inputs for one new token (lens = pos as int32, cu_q = [0, 1]) and a
    block table of fixed width whose entries the caller fills as the sequence grows (set_blocks)."""

    def __init__(self, width: int, device: torch.device):
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
        self.table = torch.full((1, width), PAD, dtype=torch.int32, device=device)

    def set(self, position: int) -> None:
        self.pos.fill_(position)
        self.lens.fill_(position)

    def set_blocks(self, blocks) -> None:
        if len(blocks) > self.table.shape[1]:
            raise ValueError(f"DecodeSlot: {len(blocks)} blocks do not fit a table of {self.table.shape[1]}")
        self.table[0, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def advance(self, by: int = 1) -> None:
        self.pos.add_(by)
        self.lens.add_(by)


@dataclass(frozen=True)
class KVStep:
    """How one forward pass reaches the paged K/V: `slots` (pool rows of the new tokens) when nothing is
    cached before them (plain causal attention over the new tokens, K/V then stored), else the paged
    attention's block table, cache_lens [1], cu_q [2] and max_q."""
    slots: torch.Tensor | None = None
    table: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    max_q: int = 1


@dataclass(frozen=True)
class Padding:
    """Padded prefill (forward_prefill_padded): of the T tokens, the first `n` are the prompt and the rest
    fill a fixed shape; `cut`: also keep the GDN states after the first `cut` tokens. Both long [1] on the
    device, so one captured pass serves any n <= T (prefill_graph.py)."""
    n: torch.Tensor
    cut: torch.Tensor


@dataclass(frozen=True)
class PaddedCut:
    """A padded prefill's GDN layers as one kernel call each: the T tokens twice, as a batch of two sequences
    from the same state, the first masked from `cut` on (its final state is the cut's), the second from `n`
    on (the prompt's state, and its outputs). Made on the device once per pass, from Padding's tensors."""
    off: torch.Tensor  # bool [2, T, 1]: the masked rows of each copy (a = b = -1e4)
    ends: torch.Tensor  # long [2]: cut and n, where the conv states are gathered

    @staticmethod
    def of(pad: Padding, T: int, device) -> "PaddedCut":
        ends = torch.cat([pad.cut, pad.n])
        return PaddedCut((torch.arange(T, device=device) >= ends[:, None]).view(2, T, 1), ends)


def _rows(weight, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight matrix (its rows lo .. hi-1 for rows = (lo, hi)) as kernels.gemv takes it: (matrix, None), or an
    Int8Weight's (int8 rows, their scales)."""
    s = slice(*rows) if rows is not None else slice(None)
    return (weight.q[s], weight.scale[s]) if isinstance(weight, Int8Weight) else (weight[s], None)


def text_positions(cache: Cache, T: int, device) -> torch.Tensor:
    """Rotary ids [3, T] of T text tokens appended to `cache` (its slots plus its rope_delta)."""
    return (torch.arange(cache.length, cache.length + T, device=device) + cache.rope_delta).expand(3, T)


def rope_delta_after(cache: Cache, positions: torch.Tensor | None, k: int) -> int:
    """The rope_delta after the first k of the tokens appended to `cache` at rotary ids `positions` [3, T]
    (None: text, the cache's delta)."""
    if positions is None:
        return cache.rope_delta
    return int(positions[:, :k].max()) + 1 - (cache.length + k)  # host positions: no synchronisation


_SERIALS = itertools.count(1)


class Qwen35Model(nn.Module):
    """Qwen3.5 dense text model. Weights only; `forward_*` are the prefill and decode passes. With int8 the
    weight matrices (projections, MLPs, embedding, LM head) are kept in 8 bits and computed in `dtype`
    (quant.py); norms, convolutions and the vision tower stay in their dtypes."""

    def __init__(self, config: TextConfig, dtype: torch.dtype, device: torch.device, int8: bool = False):
        super().__init__()
        # names this model for the prefills it makes (id() may return a freed model's number to the next)
        self.serial = next(_SERIALS)
        self.config = config
        self.dtype = dtype
        self.int8 = int8
        self.embed = matrix(config.vocab_size, config.hidden_size, dtype, device, int8)
        self.blocks = nn.ModuleList(Block(config, t, dtype, device, int8) for t in config.layer_types)
        self.final_norm = nn.Parameter(torch.empty(config.hidden_size, dtype=torch.float32, device=device),
                                       requires_grad=False)
        self.lm_head = (None if config.tie_word_embeddings
                        else matrix(config.vocab_size, config.hidden_size, dtype, device, int8))
        rd = config.rotary_dim
        self.register_buffer("inv_freq", rope.inv_freq(rd, config.rope_theta, device), persistent=False)
        self.register_buffer("rope_section", rope.section_index(rd, config.mrope_section, device),
                             persistent=False)
        self.vision = None  # the vision tower (vision.VisionTower) when the checkpoint has one
        self.vision_note = "no vision tower loaded"  # why vision is None, or which tower it is
        self.requested_backend = "auto"
        self.backend = kernels.select_backend("torch", device)
        self._backend_device = None
        self._kv: KVStore | None = None
        # captured passes (prefill_graph.py) by key; they read the weights' and the store's addresses, so a
        # move or a new store drops them
        self.graphs: dict = {}
        # one-row projections (a decode step) through kernels.gemv: None = where kernels.gemv_preferred says
        self.decode_gemv: bool | None = None
        self._gemv = False

    # --- the paged K/V store ----------------------------------------------------------------
    @property
    def kv(self) -> KVStore:
        """The model's K/V store (made with the default budget on first use unless setup_kv made it)."""
        if self._kv is None:
            self.setup_kv()
        return self._kv

    def setup_kv(self, budget_bytes: int | None = None) -> KVStore:
        """(Re)makes the K/V store on the model's device: `budget_bytes` for its blocks and snapshots, fixed;
        None: the auto budget (kv_store.default_budget_bytes), grown when a prompt needs more. Caches made
        before keep the old store alive."""
        self._kv = None
        self.graphs.clear()
        auto = budget_bytes is None
        budget = default_budget_bytes(self.config, self.device, self.dtype) if auto else int(budget_bytes)
        try:
            self._kv = KVStore(self.config, budget, self.dtype, self.device, growable=auto)
            return self._kv
        except (RuntimeError, MemoryError) as e:
            from .memory import is_out_of_memory  # memory.py imports this module
            if not isinstance(e, MemoryError) and not is_out_of_memory(e):
                raise
        from .memory import free_bytes  # out of the except block: what the failed allocation held is gone
        empty_cache(self.device)
        free, _ = free_bytes(self.device)
        raise Qwen35Error(f"a K/V cache of {budget / 2**20:.0f} MiB does not fit on {self.device}: "
                          f"{free / 2**20:.0f} MiB is free beside the model's weights. Lower the loader's K/V cache "
                          "budget, or set it to 0 (auto: sized to the free memory, grown when a prompt needs it)")

    def _apply(self, fn, recurse=True):
        # the graphs read the weights where they are: dropped before the move, which may fail part-way (out of RAM)
        # with some weights moved and their memory freed, the model still reported on its device
        getattr(self, "graphs", {}).clear()
        if getattr(self, "vision", None) is not None:
            self.vision.forget_kept()
        super()._apply(fn, recurse)
        if getattr(self, "_kv", None) is not None:  # the store moves with the weights
            self._kv.apply(fn)
        return self

    @property
    def device(self) -> torch.device:
        return self.final_norm.device

    # --- the weights let go and read again (a model unloaded where RAM is short) ------------
    @property
    def weights_dropped(self) -> bool:
        """The weights were let go (drop_weights) and are not back yet (reload_weights)."""
        return self.final_norm.is_meta

    def drop_weights(self, park: torch.device | str) -> None:
        """Lets the weights go: each parameter becomes a meta tensor of its shape (no memory anywhere); the
        K/V store and the buffers move to `park`, so the prefills made before stay usable. reload_weights
        reads the weights again from the checkpoint they were loaded from (load_model keeps where that is)."""
        if getattr(self, "checkpoint", None) is None:
            raise Qwen35Error("drop_weights: this model was not loaded from a checkpoint (load_model), so its "
                              "weights could not be read again")
        park = torch.device(park)
        self._apply(lambda t: torch.empty_like(t, device="meta") if isinstance(t, nn.Parameter) else t.to(park))

    def reload_weights(self, device: torch.device | str) -> None:
        """Reads the weights let go by drop_weights from the checkpoint straight onto `device` (the K/V store
        and the buffers move there too). Raises Qwen35Error when a checkpoint file changed or went away since
        load_model read it."""
        from .loader import check_unchanged, refill  # loader.py imports this module
        check_unchanged(self.checkpoint, self.checkpoint_stamp)
        device = torch.device(device)
        park = self._kv.device if self._kv is not None else self.inv_freq.device
        self._apply(lambda t: torch.empty_like(t, device=device) if isinstance(t, nn.Parameter) else t.to(device))
        try:
            refill(self)
        except BaseException:  # out of memory, a read error: no half-read weights stay, nothing moved
            self.drop_weights(park)
            raise

    def flops(self, tokens: int, logits: int = 1) -> float:
        """Matmul FLOPs of a cold prefill of `tokens` tokens that keeps `logits` positions' logits: the layers'
        projections and MLPs, the full-attention layers' causal scores and values, the LM head; the last layer
        as _attention_last runs it (the K/V rows of its projection for every token, the rest for the last
        token alone). The GDN recurrence is not counted (a few % of a 1K-token prompt on 9B shapes): a floor,
        not an estimate."""
        c = self.config
        *body, last = self.blocks
        H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def mats(b):
            return (b.gate_up, b.down, *((b.mixer.in_proj, b.mixer.out_proj) if b.kind == LINEAR
                                         else (b.mixer.qkv, b.mixer.o_proj)))
        per_token = sum(p.numel() for b in body for p in mats(b))
        once = last.gate_up.numel() + last.down.numel()  # the last token's
        if last.kind == LINEAR:
            per_token += last.mixer.in_proj.numel() + last.mixer.out_proj.numel()
        else:
            kv_rows = 2 * Hkv * hd * c.hidden_size
            per_token += kv_rows
            once += last.mixer.qkv.numel() - kv_rows + last.mixer.o_proj.numel()
        pairs = tokens * (tokens + 1) // 2  # causal (query, key) pairs
        full = sum(1 for b in body if b.kind != LINEAR)
        attention = 4 * H * hd * (full * pairs + (tokens if last.kind != LINEAR else 0))
        head = self.embed if self.lm_head is None else self.lm_head
        return 2 * tokens * per_token + 2 * once + attention + 2 * logits * head.numel()

    def select_backend(self) -> kernels.Backend:
        """Pick the GDN backend for the device the weights are on now (again after a move)."""
        if self._backend_device != self.device:
            self.graphs.clear()  # captured with the kernels of the backend they ran on
            try:
                self.backend = kernels.select_backend(self.requested_backend, self.device, self.dtype)
            except (RuntimeError, ValueError) as e:
                raise Qwen35Error(str(e)) from None
            self._backend_device = self.device
            # int8 matrices take gemv on every card (dequantized for cuBLAS instead, a 9B decode step read ~3x
            # the bytes: 28 tok/s against 210 with full weights, bench/results/int8-weights-h200.json); 16-bit
            # ones where it was measured faster than cuBLAS
            preferred = (self.int8 and self.dtype in (torch.bfloat16, torch.float16)) or kernels.gemv_preferred(self.device)
            self._gemv = self.backend.use_cuda and (
                self.decode_gemv if self.decode_gemv is not None else preferred)
        return self.backend

    @property
    def backend_device(self) -> torch.device | None:
        """The device the backend was picked for (select_backend), where the model runs; it stays while the
        weights wait elsewhere (unloaded to the cpu, or let go) until a run moves them back. None before a pick."""
        return self._backend_device

    def set_decode_gemv(self, on: bool | None) -> None:
        """One-row projections through kernels.gemv (True), through cuBLAS (False), or the default (None): int8
        matrices through gemv, 16-bit ones as kernels.gemv_preferred says for the device; captured passes are made
        again."""
        self.decode_gemv, self._backend_device = on, None

    def set_backend(self, requested: str) -> kernels.Backend:
        """Choose the GDN backend again ("auto", "cuda" or "torch")."""
        self.requested_backend, self._backend_device = requested, None
        return self.select_backend()

    # --- rotary embedding -------------------------------------------------------------------
    def rope(self, positions: torch.Tensor):
        """cos, sin [T, rotary_dim] for position ids [3, T] (temporal, height, width; equal for text);
        the three are interleaved over the frequencies as rope.py describes."""
        return rope.cos_sin(positions, self.inv_freq, self.rope_section, self.dtype)

    # --- layers -----------------------------------------------------------------------------
    def _proj(self, x, weight, be: kernels.Backend, rows: tuple[int, int] | None = None):
        """x @ weight^T (weight's rows lo .. hi-1 alone for rows = (lo, hi)); one row (a decode step) through
        kernels.gemv where the backend prefers it (int8 rows with their scales), else quant.linear."""
        if self._gemv and x.numel() == x.shape[-1]:
            w, scale = _rows(weight, rows)
            return kernels.gemv(x, w, backend=be, scale=scale)
        return linear(x, weight, be, rows)

    def _split_gdn(self, m: GDNLayer, x, be: kernels.Backend):
        return self._gdn_parts(self._proj(x, m.in_proj, be))

    def _gdn_parts(self, proj):
        c = self.config
        hv = c.linear_num_value_heads
        return proj.split([c.conv_dim, c.value_dim, hv, hv], dim=-1)  # mixed qkv, z, b, a

    def _qkv_heads(self, mixed):
        c = self.config
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        shape = mixed.shape[:-1]
        return (q.reshape(*shape, c.linear_num_key_heads, c.linear_key_head_dim),
                k.reshape(*shape, c.linear_num_key_heads, c.linear_key_head_dim),
                v.reshape(*shape, c.linear_num_value_heads, c.linear_value_head_dim))

    def _gdn_out(self, m: GDNLayer, o, z, be: kernels.Backend):
        c = self.config
        z = z.reshape(*z.shape[:-1], c.linear_num_value_heads, c.linear_value_head_dim)
        o = kernels.gated_rms_norm(o, z, m.norm_w, c.rms_norm_eps, backend=be)
        return self._proj(o.flatten(-2), m.out_proj, be)

    def _gdn_prefill(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend, cut=(),
                     form: "PackedCuts | KeptCuts | None" = None):
        # a cache that already holds tokens continues from its states (None in a fresh cache). With
        # cut = [(c, state), ...] the recurrence runs in parts split at each c and the states at each cut go
        # to its state: the projections and norms still run once over all T tokens. With a form (cut_form),
        # the kernels' calls of that form give them.
        if isinstance(form, PackedCuts):
            return self._gdn_prefill_packed(m, x, cache, i, be, cut, form)
        if isinstance(form, KeptCuts):
            return self._gdn_prefill_kept(m, x, cache, i, be, cut, form)
        mixed, z, b, a = self._split_gdn(m, x, be)
        T = x.shape[1]
        bounds = (0, *(c for c, _ in cut), T)
        outs = []
        for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if n:
                cut[n - 1][1].conv[i], cut[n - 1][1].ssm[i] = cache.conv[i], cache.ssm[i]
            y, cache.conv[i] = kernels.causal_conv1d_prefill(mixed[:, lo:hi], m.conv_w, initial_state=cache.conv[i],
                                                             backend=be)
            q, k, v = self._qkv_heads(y)
            o, cache.ssm[i] = kernels.gdn_chunk_prefill(q, k, v, a[:, lo:hi], b[:, lo:hi], m.A_log, m.dt_bias,
                                                        initial_state=cache.ssm[i], backend=be)
            outs.append(o)
        return self._gdn_out(m, outs[0] if len(outs) == 1 else torch.cat(outs, dim=1), z, be)

    def _gdn_conv_cut(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend, ends):
        """A cut prefill's GDN layer up to its recurrence: the in_proj product split into the conv's input, z and
        (b, a), the conv's output y (the cache's conv state advanced past the T tokens) and the conv state at each
        of `ends` [n, 1, C, W - 1], as the conv kernel leaves it after that many tokens."""
        c = self.config
        mixed, z, ba = linear(x, m.in_proj, be).split([c.conv_dim, c.value_dim, 2 * c.linear_num_value_heads], dim=-1)
        conv0 = cache.conv[i]
        y, cache.conv[i] = kernels.causal_conv1d_prefill(mixed, m.conv_w, initial_state=conv0, backend=be)
        convs = kernels.causal_conv1d_states(mixed, conv0, ends, m.conv_w.shape[1], backend=be)[:, None]
        return y, z, ba, convs

    def _gdn_prefill_packed(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend, cut, pc: PackedCuts):
        hv = self.config.linear_num_value_heads
        y, z, ba, convs = self._gdn_conv_cut(m, x, cache, i, be, pc.ends)
        T = y.shape[1]

        def rows(t):  # the T tokens, then the first c of them for each cut, packed
            return torch.cat([t, *(t[:, :c] for c in pc.cuts)], dim=1)
        q, k, v = self._qkv_heads(rows(y))
        b, a = rows(ba).split([hv, hv], dim=-1)
        h0 = cache.ssm[i]
        if h0 is not None:
            h0 = h0.expand(1 + len(cut), *h0.shape[1:])
        o, ht = kernels.gdn_chunk_prefill(q, k, v, a, b, m.A_log, m.dt_bias, initial_state=h0,
                                          cu_seqlens=pc.cu_seqlens, backend=be)
        cache.ssm[i] = ht[:1].clone()  # its own: a view would keep every cut's state alive with the prompt's
        for n, (_, state) in enumerate(cut):
            state.conv[i], state.ssm[i] = convs[n], ht[n + 1:n + 2]
        return self._gdn_out(m, o[:, :T], z, be)

    def _gdn_prefill_kept(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend, cut, kc: KeptCuts):
        hv = self.config.linear_num_value_heads
        y, z, ba, convs = self._gdn_conv_cut(m, x, cache, i, be, kc.ends)
        q, k, v = self._qkv_heads(y)
        b, a = ba.split([hv, hv], dim=-1)
        o, cache.ssm[i], hk = kernels.gdn_chunk_prefill(q, k, v, a, b, m.A_log, m.dt_bias,
                                                        initial_state=cache.ssm[i], keep=list(kc.bounds), backend=be)
        for n, (_, state) in enumerate(cut):
            state.conv[i], state.ssm[i] = convs[n], hk[n:n + 1]
        if kc.tails:  # the cuts off a boundary: their states go into hk when the tails are walked
            kc.gather(i, y, ba, hk, self, be)
        return self._gdn_out(m, o, z, be)

    def _gdn_prefill_padded(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend, pc: PaddedCut,
                            kept: "GDNState"):
        # Masked tokens get a = b = -1e4: decay exp(g) = 1 and beta = 0 exactly, so they leave the recurrent
        # state as the last unmasked token left it (their outputs are never read). One call walks the tokens
        # as a batch of two sequences over the same inputs (batch stride 0): masked from `cut` on (the cut's
        # state) and from `n` on (the prompt's state and outputs). The incoming state is given once per
        # sequence (the graphed pass keeps it so, PaddedPrefill), else expanded. The conv states are the
        # last W-1 inputs before each point, gathered.
        c = self.config
        hv = c.linear_num_value_heads
        mixed, z, ba = linear(x, m.in_proj, be).split([c.conv_dim, c.value_dim, 2 * hv], dim=-1)
        T, C = x.shape[1], mixed.shape[2]
        conv0, h0 = cache.conv[i], cache.ssm[i]  # a padded prefill follows a cached prefix: both exist
        y, _ = kernels.causal_conv1d_prefill(mixed, m.conv_w, initial_state=conv0, backend=be)
        q, k, v = self._qkv_heads(y.expand(2, T, C))
        b, a = torch.where(pc.off, -1e4, ba).split([hv, hv], -1)
        h0 = h0 if h0.shape[0] == 2 else h0.expand(2, *h0.shape[1:])
        o, ssm = kernels.gdn_chunk_prefill(q, k, v, a, b, m.A_log, m.dt_bias, initial_state=h0, backend=be)
        convs = kernels.causal_conv1d_states(mixed, conv0, pc.ends, m.conv_w.shape[1], backend=be)
        kept.conv[i], kept.ssm[i] = convs[:1], ssm[:1]
        cache.conv[i], cache.ssm[i] = convs[1:], ssm[1:]
        return self._gdn_out(m, o[1:], z, be)

    def _gdn_decode(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend):
        return self._gdn_decode_from(m, self._proj(x, m.in_proj, be), cache, i, be)

    def _gdn_decode_from(self, m: GDNLayer, proj, cache: Cache, i: int, be: kernels.Backend):
        """A decode step's GDN layer from its input's in_proj product proj [B, 1, N]."""
        mixed, z, b, a = self._gdn_parts(proj[:, 0])
        mixed = kernels.causal_conv1d_update(mixed, cache.conv[i], m.conv_w, backend=be)
        q, k, v = self._qkv_heads(mixed)
        o = kernels.gdn_decode_step(q, k, v, a, b, m.A_log, m.dt_bias, cache.ssm[i], backend=be)
        return self._gdn_out(m, o[:, None], z[:, None], be)

    def _attention(self, m: AttentionLayer, x, cache: Cache, i: int, cos, sin, be: kernels.Backend, kv: KVStep):
        return self._attention_from(m, self._proj(x, m.qkv, be), cache, i, cos, sin, be, kv)

    def _attention_from(self, m: AttentionLayer, proj, cache: Cache, i: int, cos, sin, be: kernels.Backend,
                        kv: KVStep):
        """An attention layer from its input's qkv product proj [B, T, N]."""
        c = self.config
        B, T, _ = proj.shape
        H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg, k, v = proj.split([2 * H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, gate = qg.view(B, T, H, 2 * hd).chunk(2, dim=-1)
        q = kernels.rms_norm_rope(q, m.q_norm, c.rms_norm_eps, cos, sin, backend=be)  # rotary: half-split
        k = kernels.rms_norm_rope(k.view(B, T, Hkv, hd), m.k_norm, c.rms_norm_eps, cos, sin, backend=be)
        v = v.view(B, T, Hkv, hd)
        store = cache.store
        if kv.slots is not None:  # nothing cached before these tokens: causal attention among them
            store.write(i, kv.slots, k[0], v[0])
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=T > 1, scale=hd ** -0.5, enable_gqa=H != Hkv)
            out = (out.transpose(1, 2) * torch.sigmoid(gate)).reshape(B, T, H * hd)  # no copy of the strided gate
        else:  # over the cached blocks and, causally, each other; K/V stored in the same launch
            j = store.index[i]
            out = kernels.paged_attention(q[0], k[0], v[0], store.k[j], store.v[j], kv.table, kv.lens, kv.cu_q,
                                          gate[0], max_q=kv.max_q, scale=hd ** -0.5, backend=be)
            out = out.reshape(B, T, H * hd)
        return self._proj(out, m.o_proj, be)

    def _attention_last(self, m: AttentionLayer, x, cache: Cache, i: int, cos, sin, be: kernels.Backend,
                        kv: KVStep):
        """The last layer of a prefill as an attention layer, where only the last token's output is read (its
        logits): the K/V of all T tokens go to the cache, the query, attention and o_proj run for that token
        alone. kv: the T tokens' slots, and where tokens are cached before them the paged attention's table
        and cache_lens [1] = cache length + T - 1 (the last token's K/V given to it, stored already)."""
        c = self.config
        B, T, _ = x.shape
        H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        nq, nkv = 2 * H * hd, 2 * Hkv * hd  # the projection's query and gate rows for the last token, K/V for all
        qg, kvp = self._proj(x[:, -1:], m.qkv, be, (0, nq)), linear(x, m.qkv, be, (nq, nq + nkv))
        k, v = kvp.split([Hkv * hd, Hkv * hd], dim=-1)
        q, gate = qg.view(B, 1, H, 2 * hd).chunk(2, dim=-1)
        q = kernels.rms_norm_rope(q, m.q_norm, c.rms_norm_eps, cos[-1:], sin[-1:], backend=be)
        k = kernels.rms_norm_rope(k.view(B, T, Hkv, hd), m.k_norm, c.rms_norm_eps, cos, sin, backend=be)
        v = v.view(B, T, Hkv, hd)
        store = cache.store
        store.write(i, kv.slots, k[0], v[0])
        if kv.table is None:  # nothing cached before: the last token sees all T
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 scale=hd ** -0.5, enable_gqa=H != Hkv)
            out = (out.transpose(1, 2) * torch.sigmoid(gate)).reshape(B, 1, H * hd)
        else:
            j = store.index[i]
            out = kernels.paged_attention(q[0], k[0, -1:], v[0, -1:], store.k[j], store.v[j], kv.table, kv.lens,
                                          kv.cu_q, gate[0], max_q=1, scale=hd ** -0.5, write_kv=False, backend=be)
            out = out.reshape(B, 1, H * hd)
        return self._proj(out, m.o_proj, be)

    def _mlp(self, blk: Block, x, be: kernels.Backend):
        return self._proj(kernels.silu_mul(self._proj(x, blk.gate_up, be), backend=be), blk.down, be)

    def _layers(self, h, cache: Cache, decode: bool, kv: KVStep, slot=None, positions=None, cut=(),
                pad: tuple[Padding, "GDNState"] | None = None, kv_last: KVStep | None = None):
        """The blocks over h [B, T, hidden]; returns the residual stream after the last. With kv_last (a
        prefill whose last token's logits alone are read, _kv_last) the last block forms the output of the
        last token only and returns [B, 1, hidden]: the K/V and GDN states of all T tokens are kept as in a
        full pass, the query, attention output and MLP of the others (1/L of the layers' work) are not run."""
        c = self.config
        T = h.shape[1]
        if positions is None:  # text: the slot (the cache's, or the graphed step's) plus the offset images left
            positions = (text_positions(cache, T, h.device) if slot is None
                         else (slot.pos + cache.rope_delta if cache.rope_delta else slot.pos).expand(3, T))
        cos, sin = self.rope(positions)
        be = self.select_backend()  # once per forward pass; every operator below takes it
        eps, blocks = c.rms_norm_eps, self.blocks
        form = cut_form([k for k, _ in cut], T, be, h.device) if cut and not decode and pad is None else None
        padded = PaddedCut.of(pad[0], T, h.device) if pad is not None else None
        if decode and self._gemv and h.numel() == h.shape[-1]:
            return self._decode_gemv(h, cache, kv, cos, sin, be)
        x = kernels.rms_norm(h, blocks[0].input_norm, eps, backend=be)
        for i, blk in enumerate(blocks):
            last = kv_last is not None and i + 1 == len(blocks)
            if blk.kind == LINEAR:
                x = (self._gdn_decode(blk.mixer, x, cache, i, be) if decode
                     else self._gdn_prefill_padded(blk.mixer, x, cache, i, be, padded, pad[1]) if pad is not None
                     else self._gdn_prefill(blk.mixer, x, cache, i, be, cut, form))
                x = x[:, -1:] if last else x
            elif last:
                x = self._attention_last(blk.mixer, x, cache, i, cos, sin, be, kv_last)
            else:
                x = self._attention(blk.mixer, x, cache, i, cos, sin, be, kv)
            if last:
                h = h[:, -1:]
            h, x = kernels.add_rms_norm(h, x, blk.post_norm, eps, backend=be)  # the residual add, then the norm
            x = self._mlp(blk, x, be)
            if i + 1 < len(blocks):
                h, x = kernels.add_rms_norm(h, x, blocks[i + 1].input_norm, eps, backend=be)
            else:
                h = h + x
        if isinstance(form, KeptCuts):
            form.walk_tails(self, be)  # the tails of the layers since the last TAIL_LAYERS
        return h

    def _decode_gemv(self, h, cache: Cache, kv: KVStep, cos, sin, be: kernels.Backend):
        """_layers' decode step for one row with the projections on gemv: each residual add and the norm after
        it are formed by the projection that takes the norm (kernels.gemv_add_rms_norm), the MLP's gate by its
        down projection (kernels.gemv_silu_mul), where that is faster than their own launches (the kernel's
        launcher decides per shape). The values of the unfused step bit for bit, up to three launches a layer
        fewer."""
        eps, y = self.config.rms_norm_eps, None  # y: the output the residual stream has yet to add
        for i, blk in enumerate(self.blocks):
            m = blk.mixer
            if blk.kind == LINEAR:
                w, scale = _rows(m.in_proj)
                h, p = kernels.gemv_add_rms_norm(h, y, blk.input_norm, eps, w, backend=be, scale=scale)
                y = self._gdn_decode_from(m, p, cache, i, be)
            else:
                w, scale = _rows(m.qkv)
                h, p = kernels.gemv_add_rms_norm(h, y, blk.input_norm, eps, w, backend=be, scale=scale)
                y = self._attention_from(m, p, cache, i, cos, sin, be, kv)
            w, scale = _rows(blk.gate_up)
            h, p = kernels.gemv_add_rms_norm(h, y, blk.post_norm, eps, w, backend=be, scale=scale)
            w, scale = _rows(blk.down)
            y = kernels.gemv_silu_mul(p, w, backend=be, scale=scale)
        return h + y

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, vocab] for the hidden state of one position per sequence [B, hidden]."""
        be = self.select_backend()
        h = kernels.rms_norm(h_last, self.final_norm, self.config.rms_norm_eps, backend=be)
        return self._proj(h, self.embed if self.lm_head is None else self.lm_head, be).float()

    def new_cache(self, batch: int, capacity: int) -> Cache:
        """An empty cache with room for `capacity` tokens (blocks of the model's K/V store); one sequence."""
        if batch != 1:
            raise ValueError(f"new_cache: the runtime runs one sequence per cache, got batch {batch}")
        n = self.config.num_hidden_layers
        cache = Cache([None] * n, [None] * n, self.kv)
        cache.reserve(capacity)
        return cache

    def start_states(self, cache: Cache) -> None:
        """Zero GDN states for a cache that has none yet (an empty one, new_cache): a decode step updates its
        states in place, where a prefill starts from None (zeros) and makes them."""
        c = self.config
        for i, blk in enumerate(self.blocks):
            if blk.kind == LINEAR and cache.conv[i] is None:
                cache.conv[i] = torch.zeros(1, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype,
                                            device=self.device)
            if blk.kind == LINEAR and cache.ssm[i] is None:
                cache.ssm[i] = torch.zeros(1, c.linear_num_value_heads, c.linear_key_head_dim,
                                           c.linear_value_head_dim, dtype=torch.float32, device=self.device)

    def _kv_step(self, cache: Cache, start: int, T: int) -> KVStep:
        """The K/V addressing of T new tokens after `start` cached ones (blocks reserved for them). With nothing
        cached: SDPA among the new tokens (its causal cuDNN kernel beats the paged one there,
        bench/results/paged-h200.json "cold_prefill"), the K/V stored after."""
        cache.reserve(start + T)
        store, dev = cache.store, self.device
        if start == 0:
            return KVStep(slots=store.slots(cache.seq, 0, T))
        return KVStep(table=store.table(cache.seq), lens=upload([start], torch.int32, dev),
                      cu_q=upload([0, T], torch.int32, dev), max_q=T)

    def _kv_last(self, cache: Cache, start: int, T: int, kv: KVStep) -> KVStep:
        """_attention_last's K/V addressing of T new tokens after `start` cached ones (kv: _kv_step's for them):
        the slots of all T and, with tokens cached before them, the paged attention's for the last token alone."""
        store, dev = cache.store, self.device
        if start == 0:
            return kv  # the cold step's: the T slots, no table
        return KVStep(slots=store.slots(cache.seq, start, start + T), table=kv.table,
                      lens=upload([start + T - 1], torch.int32, dev), cu_q=upload([0, 1], torch.int32, dev))

    def forward_prefill(self, ids: torch.Tensor, cache: Cache, vision=None, positions=None,
                        rope_delta: int | None = None) -> torch.Tensor:
        """Run prompt ids [1, T] into `cache` after the `cache.length` tokens it holds (0 for a new cache):
        the new tokens attend to the cached K/V and, causally, to each other; the GDN layers start from
        the cached states. Returns fp32 logits of the last position [1, vocab].

        vision: (index [n] long, features [n, hidden]): slots among these T tokens whose embedding is
        replaced by vision-tower output; positions: [3, T] rotary ids (default: text, the slot plus the
        cache's rope_delta; on the host, the deltas at cuts cost no synchronisation); rope_delta: stored in
        the cache for the tokens after this chunk (rope.py; None keeps the cache's).
        """
        return self._prefill(ids, cache, vision, positions, rope_delta, ())[0]

    def forward_prefill_kept(self, ids: torch.Tensor, cache: Cache, keep_at, vision=None, positions=None,
                             rope_delta: int | None = None) -> tuple[torch.Tensor, list["GDNState"]]:
        """forward_prefill that also returns the GDN states after the first k of the T tokens for each k of
        `keep_at` (increasing, 0 < k < T), from the same pass (only the recurrence is cut there): with the
        cache's first cache.length + k K/V entries each is the model state at that point (Cache.restart)."""
        keep_at = [int(k) for k in keep_at]
        T = ids.shape[1]
        if not keep_at or any(not 0 < k < T for k in keep_at) or keep_at != sorted(set(keep_at)):
            raise ValueError(f"forward_prefill_kept: keep_at {keep_at} must increase and lie inside the {T} tokens")
        return self._prefill(ids, cache, vision, positions, rope_delta, keep_at)

    @torch.inference_mode()
    def _prefill(self, ids, cache: Cache, vision, positions, rope_delta, keep_at):
        start, T = cache.length, ids.shape[1]
        if ids.shape[0] != 1 or T == 0:
            raise ValueError(f"forward_prefill: one sequence of at least one token per call, got ids of shape "
                             f"{list(ids.shape)}")
        n = len(cache.conv)
        kept = [(k, GDNState([None] * n, [None] * n, start + k, rope_delta_after(cache, positions, k)))
                for k in keep_at]
        cache.reserve(start + T)  # the whole prompt's blocks before any work: a shortage fails here, not midway
        if positions is not None:
            positions = upload(positions, device=self.device)
        x = embedding(ids, self.embed)
        if vision is not None:
            index, features = vision
            x[0].index_copy_(0, index, features.to(x.dtype))
        for lo in range(0, T, PREFILL_PIECE):
            hi = min(T, lo + PREFILL_PIECE)
            kv = self._kv_step(cache, start + lo, hi - lo)
            pos = None if positions is None else positions[:, lo:hi]
            cut = [(k - lo, s) for k, s in kept if lo < k < hi]
            h = self._layers(x[:, lo:hi], cache, False, kv, positions=pos, cut=cut,
                             kv_last=self._kv_last(cache, start + lo, hi - lo, kv))
            cache.length = start + hi
            for k, s in kept:
                if k == hi:  # a point at a piece's end: the cache's states there (the next piece replaces them)
                    s.conv[:], s.ssm[:] = list(cache.conv), list(cache.ssm)
            if hi < T:
                progress.report("prompt", hi, T)  # a caller's cancel lands here, between pieces
        if rope_delta is not None:
            cache.rope_delta = rope_delta
        return self.logits(h[:, -1]), [state for _, state in kept]

    @torch.inference_mode()
    def forward_prefill_padded(self, ids: torch.Tensor, cache: Cache, kv: KVStep, positions: torch.Tensor,
                               pad: Padding) -> tuple[torch.Tensor, "GDNState"]:
        """forward_prefill of the first pad.n of ids [1, T] (the rest is filler) with nothing read from the
        host, so that a CUDA graph can capture it for every n <= T (prefill_graph.py). The caller gives
        the paged attention's inputs (kv: lens = cache.length, cu_q = [0, T], a table with room for
        cache.length + T: the filler's K/V land after the prompt's, in the rest of its last block, where the
        next tokens' K/V are written before anything reads them, and in blocks the caller gives back after
        the pass) and the rotary positions [3, T]. The cache's GDN states become those after the n tokens;
        its length is left to the caller. Returns the fp32 logits of token n - 1 [1, vocab] and the GDN
        states after the first pad.cut tokens (a GDNState whose length and rope_delta the caller sets)."""
        n = len(cache.conv)
        kept = GDNState([None] * n, [None] * n, 0)
        h = self._layers(embedding(ids, self.embed), cache, False, kv, positions=positions, pad=(pad, kept))
        return self.logits(h[0].index_select(0, pad.n - 1)), kept

    @torch.inference_mode()
    def forward_decode(self, ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """One new token, ids [1]; appends to `cache`; returns fp32 logits [1, vocab]."""
        kv = self._kv_step(cache, cache.length, 1)
        if kv.slots is not None:  # an empty cache: nothing to attend to but the token itself
            kv = KVStep(table=cache.store.table(cache.seq), lens=torch.zeros(1, dtype=torch.int32, device=self.device),
                        cu_q=torch.tensor([0, 1], dtype=torch.int32, device=self.device))
            self.start_states(cache)
        h = self._layers(embedding(ids[:, None], self.embed), cache, True, kv)
        cache.length += 1
        return self.logits(h[:, 0])

    @torch.inference_mode()
    def forward_decode_at(self, ids: torch.Tensor, slot: "DecodeSlot", cache: Cache) -> torch.Tensor:
        """forward_decode with the position and block table on the device (slot) and no host-side shapes,
        so a CUDA graph can capture it; the caller fills slot's table and advances slot and cache.length."""
        kv = KVStep(table=slot.table, lens=slot.lens, cu_q=slot.cu_q)
        h = self._layers(embedding(ids[:, None], self.embed), cache, True, kv, slot=slot)
        return self.logits(h[:, 0])

    def size_bytes(self) -> int:
        """Weights (the vision tower's included), the K/V store's pool and the states of its prefix cache's
        snapshots, and the captured passes' buffers (the tower's graph among them)."""
        graphs = sum(getattr(g, "nbytes", 0) for g in self.graphs.values())
        graphs += self.vision.graph_bytes() if self.vision is not None else 0
        return self.weight_bytes() + self.kv_bytes() + graphs

    def weight_bytes(self) -> int:
        """The weights, the vision tower's included (what they take when loaded, also while let go)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def kv_bytes(self) -> int:
        """The K/V store's pool and the states of its prefix cache's snapshots."""
        return self._kv.nbytes + self._kv.pool.snapshot_bytes if self._kv is not None else 0
