"""The Qwen3.5 text model: weights and the forward pass (prefill over a prompt, one-token decode).

Projections that read the same input are fused into one matrix at load time (GDN's qkv/z/b/a,
attention's q+gate/k/v, the MLP's gate/up), so each layer runs three or four matmuls. The GDN math
(causal conv1d, gated delta rule) and the RMSNorms go through `kernels`, which runs CUDA kernels or the
PyTorch references according to the backend picked at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import rope
from .config import LINEAR, TextConfig
from .errors import Qwen35Error


class GDNLayer(nn.Module):
    def __init__(self, c: TextConfig, dtype, device):
        super().__init__()
        h, hv = c.hidden_size, c.linear_num_value_heads
        e = dict(dtype=dtype, device=device)
        self.in_proj = nn.Parameter(torch.empty(c.conv_dim + c.value_dim + 2 * hv, h, **e), requires_grad=False)
        self.conv_w = nn.Parameter(torch.empty(c.conv_dim, c.linear_conv_kernel_dim, **e), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hv, dtype=torch.float32, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=torch.float32, device=device), requires_grad=False)
        self.norm_w = nn.Parameter(torch.empty(c.linear_value_head_dim, **e), requires_grad=False)
        self.out_proj = nn.Parameter(torch.empty(h, c.value_dim, **e), requires_grad=False)


class AttentionLayer(nn.Module):
    def __init__(self, c: TextConfig, dtype, device):
        super().__init__()
        qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        e = dict(dtype=dtype, device=device)
        self.qkv = nn.Parameter(torch.empty(2 * qd + 2 * kd, c.hidden_size, **e), requires_grad=False)
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, qd, **e), requires_grad=False)
        self.q_norm = nn.Parameter(torch.empty(c.head_dim, dtype=torch.float32, device=device), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(c.head_dim, dtype=torch.float32, device=device), requires_grad=False)


class Block(nn.Module):
    """One decoder layer: a token mixer (GDN or attention) and the MLP, each behind a norm."""

    def __init__(self, c: TextConfig, kind: str, dtype, device):
        super().__init__()
        self.kind = kind
        h = c.hidden_size
        self.input_norm = nn.Parameter(torch.empty(h, dtype=torch.float32, device=device), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(h, dtype=torch.float32, device=device), requires_grad=False)
        self.mixer = GDNLayer(c, dtype, device) if kind == LINEAR else AttentionLayer(c, dtype, device)
        self.gate_up = nn.Parameter(torch.empty(2 * c.intermediate_size, h, dtype=dtype, device=device),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, c.intermediate_size, dtype=dtype, device=device),
                                 requires_grad=False)


@dataclass(eq=False)
class Cache:
    """Per-sequence state after some tokens: GDN conv and recurrent states, attention K/V.

    conv[i]: [B, conv_dim, W-1]; ssm[i]: [B, Hv, Dk, Dv] fp32 (GDN layers, None elsewhere);
    k[i], v[i]: [B, Hkv, capacity, head_dim] (attention layers, None elsewhere); `length` tokens are in it.
    rope_delta: what a token appended at slot `length` adds to its slot to get its rotary position
    (0 for text; negative after images, whose tokens share positions; see rope.py).
    """
    conv: list
    ssm: list
    k: list
    v: list
    length: int
    rope_delta: int = 0

    @property
    def capacity(self) -> int:
        return next(t.shape[2] for t in self.k if t is not None)

    def clone(self, capacity: int | None = None, device: torch.device | None = None) -> "Cache":
        """A deep copy on `device` (default: where it is) with room for `capacity` tokens (at least `length`)."""
        cap = max(capacity or self.capacity, self.length)

        def grow(t):
            if t is None:
                return None
            out = torch.zeros(t.shape[0], t.shape[1], cap, t.shape[3], dtype=t.dtype, device=device or t.device)
            out[:, :, :self.length] = t[:, :, :self.length]
            return out

        copy = lambda xs: [None if t is None else t.to(device or t.device, copy=True) for t in xs]  # noqa: E731
        return Cache(copy(self.conv), copy(self.ssm), [grow(t) for t in self.k], [grow(t) for t in self.v],
                     self.length, self.rope_delta)

    def to(self, device: torch.device | str) -> None:
        """Moves every tensor to `device`, in place; the contents stay the same (a cached prefill can wait
        in system RAM while its model is unloaded; generate copies it back to the model's device)."""
        for xs in (self.conv, self.ssm, self.k, self.v):
            xs[:] = [None if t is None else t.to(device) for t in xs]

    def restart(self, state: "GDNState", capacity: int, device: torch.device | None = None) -> "Cache":
        """A new cache at the point `state` was taken: this cache's first `state.length` K/V entries (the
        tokens this cache held then; they never change) and `state`'s GDN states, with room for `capacity`
        tokens, on `device` (default: where this cache is). Neither input changes."""
        n, dev = state.length, device
        if n > self.length:
            raise ValueError(f"Cache.restart: a state after {n} tokens does not fit a cache of {self.length}")
        cap = max(capacity, n)

        def kv(t):
            if t is None:
                return None
            out = torch.zeros(t.shape[0], t.shape[1], cap, t.shape[3], dtype=t.dtype, device=dev or t.device)
            out[:, :, :n] = t[:, :, :n]
            return out

        copy = lambda xs: [None if t is None else t.to(dev or t.device, copy=True) for t in xs]  # noqa: E731
        return Cache(copy(state.conv), copy(state.ssm), [kv(t) for t in self.k], [kv(t) for t in self.v], n,
                     state.rope_delta)


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
        """Moves the states to `device`, in place (like Cache.to)."""
        for xs in (self.conv, self.ssm):
            xs[:] = [None if t is None else t.to(device) for t in xs]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm if t is not None)


class DecodeSlot:
    """Where the next decoded token goes, kept on the device: pos [1] and the attention mask over the
    cache's capacity (True up to and including pos)."""

    def __init__(self, capacity: int, device: torch.device):
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self._slots = torch.arange(capacity, device=device)
        self.mask = torch.zeros(1, 1, 1, capacity, dtype=torch.bool, device=device)

    def set(self, position: int) -> None:
        self.pos.fill_(position)
        self.advance(0)

    def advance(self, by: int = 1) -> None:
        self.pos.add_(by)
        torch.le(self._slots, self.pos, out=self.mask.view(-1))


class Qwen35Model(nn.Module):
    """Qwen3.5 dense text model. Weights only; `forward_*` are the prefill and decode passes."""

    def __init__(self, config: TextConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
                                  requires_grad=False)
        self.blocks = nn.ModuleList(Block(config, t, dtype, device) for t in config.layer_types)
        self.final_norm = nn.Parameter(torch.empty(config.hidden_size, dtype=torch.float32, device=device),
                                       requires_grad=False)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), requires_grad=False)
        rd = config.rotary_dim
        self.register_buffer("inv_freq", rope.inv_freq(rd, config.rope_theta, device), persistent=False)
        self.register_buffer("rope_section", rope.section_index(rd, config.mrope_section, device),
                             persistent=False)
        self.vision = None  # the vision tower (vision.VisionTower) when the checkpoint has one
        self.vision_note = "no vision tower loaded"  # why vision is None, or which tower it is
        self.requested_backend = "auto"
        self.backend = kernels.select_backend("torch", device)
        self._backend_device = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def select_backend(self) -> kernels.Backend:
        """Pick the GDN backend for the device the weights are on now (again after a move)."""
        if self._backend_device != self.device:
            try:
                self.backend = kernels.select_backend(self.requested_backend, self.device, self.dtype)
            except (RuntimeError, ValueError) as e:
                raise Qwen35Error(str(e)) from None
            self._backend_device = self.device
        return self.backend

    def set_backend(self, requested: str) -> kernels.Backend:
        """Choose the GDN backend again ("auto", "cuda" or "torch")."""
        self.requested_backend, self._backend_device = requested, None
        return self.select_backend()

    # --- rotary embedding -------------------------------------------------------------------
    def rope(self, positions: torch.Tensor):
        """cos, sin [T, rotary_dim] for position ids [3, T] (temporal, height, width; equal for text);
        the three are interleaved over the frequencies as rope.py describes."""
        return rope.cos_sin(positions, self.inv_freq, self.rope_section, self.dtype)

    @staticmethod
    def _apply_rope(x, cos, sin):
        """x: [B, T, H, hd]; rotates the first rotary_dim features (half-split convention)."""
        rd = cos.shape[-1]
        xr, xp = x[..., :rd], x[..., rd:]
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([-x2, x1], dim=-1)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([xr * cos + rot * sin, xp], dim=-1)

    # --- layers -----------------------------------------------------------------------------
    def _split_gdn(self, m: GDNLayer, x):
        c = self.config
        proj = F.linear(x, m.in_proj)
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
        return F.linear(o.flatten(-2), m.out_proj)

    def _gdn_prefill(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend, cut=None):
        # a cache that already holds tokens continues from its states (None in a fresh cache). With
        # cut = (c, snap) the recurrence runs in two parts, tokens [0, c) and [c, T), and the states
        # between them go to snap: the projections and norms still run once over all T tokens.
        mixed, z, b, a = self._split_gdn(m, x)
        T = x.shape[1]
        bounds = (0, T) if cut is None else (0, cut[0], T)
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if lo:
                cut[1].conv[i], cut[1].ssm[i] = cache.conv[i], cache.ssm[i]
            y, cache.conv[i] = kernels.causal_conv1d_prefill(mixed[:, lo:hi], m.conv_w, initial_state=cache.conv[i],
                                                             backend=be)
            q, k, v = self._qkv_heads(y)
            o, cache.ssm[i] = kernels.gdn_chunk_prefill(q, k, v, a[:, lo:hi], b[:, lo:hi], m.A_log, m.dt_bias,
                                                        initial_state=cache.ssm[i], backend=be)
            outs.append(o)
        return self._gdn_out(m, outs[0] if len(outs) == 1 else torch.cat(outs, dim=1), z, be)

    def _gdn_decode(self, m: GDNLayer, x, cache: Cache, i: int, be: kernels.Backend):
        mixed, z, b, a = self._split_gdn(m, x[:, 0])
        mixed = kernels.causal_conv1d_update(mixed, cache.conv[i], m.conv_w, backend=be)
        q, k, v = self._qkv_heads(mixed)
        o = kernels.gdn_decode_step(q, k, v, a, b, m.A_log, m.dt_bias, cache.ssm[i], backend=be)
        return self._gdn_out(m, o[:, None], z[:, None], be)

    def _attention(self, m: AttentionLayer, x, cache: Cache, i: int, cos, sin, start: int, be: kernels.Backend,
                   slot=None):
        c = self.config
        B, T, _ = x.shape
        H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg, k, v = F.linear(x, m.qkv).split([2 * H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, gate = qg.view(B, T, H, 2 * hd).chunk(2, dim=-1)
        q = self._apply_rope(kernels.rms_norm(q, m.q_norm, c.rms_norm_eps, backend=be), cos, sin)
        k = self._apply_rope(kernels.rms_norm(k.view(B, T, Hkv, hd), m.k_norm, c.rms_norm_eps, backend=be), cos, sin)
        v = v.view(B, T, Hkv, hd)
        if slot is not None:  # one token at a device-side position: attends over the whole buffer, masked
            cache.k[i].index_copy_(2, slot.pos, k.transpose(1, 2))
            cache.v[i].index_copy_(2, slot.pos, v.transpose(1, 2))
            keys, values, mask, causal = cache.k[i], cache.v[i], slot.mask, False
        else:
            end = start + T
            cache.k[i][:, :, start:end] = k.transpose(1, 2)
            cache.v[i][:, :, start:end] = v.transpose(1, 2)
            keys, values, mask, causal = cache.k[i][:, :, :end], cache.v[i][:, :, :end], None, T > 1 and start == 0
            if T > 1 and start > 0:  # new tokens see the whole prefix and, causally, each other
                mask = torch.ones(T, end, dtype=torch.bool, device=x.device).tril(start)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal,
                                             scale=hd ** -0.5, enable_gqa=H != Hkv)
        out = out.transpose(1, 2).reshape(B, T, H * hd) * torch.sigmoid(gate.reshape(B, T, H * hd))
        return F.linear(out, m.o_proj)

    def _mlp(self, blk: Block, x):
        g, u = F.linear(x, blk.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, blk.down)

    def _layers(self, h, cache: Cache, start: int, decode: bool, slot=None, positions=None, cut=None):
        c = self.config
        T = h.shape[1]
        if positions is None:  # text: the cache slot plus the offset images before it left
            pos = slot.pos if slot is not None else torch.arange(start, start + T, device=h.device)
            positions = (pos + cache.rope_delta if cache.rope_delta else pos).expand(3, T)
        cos, sin = self.rope(positions)
        be = self.select_backend()  # once per forward pass; every operator below takes it
        for i, blk in enumerate(self.blocks):
            x = kernels.rms_norm(h, blk.input_norm, c.rms_norm_eps, backend=be)
            if blk.kind == LINEAR:
                x = (self._gdn_decode(blk.mixer, x, cache, i, be) if decode
                     else self._gdn_prefill(blk.mixer, x, cache, i, be, cut))
            else:
                x = self._attention(blk.mixer, x, cache, i, cos, sin, start, be, slot)
            h = h + x
            h = h + self._mlp(blk, kernels.rms_norm(h, blk.post_norm, c.rms_norm_eps, backend=be))
        return h

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, vocab] for the hidden state of one position per sequence [B, hidden]."""
        h = kernels.rms_norm(h_last, self.final_norm, self.config.rms_norm_eps, backend=self.select_backend())
        return F.linear(h, self.embed if self.lm_head is None else self.lm_head).float()

    def new_cache(self, batch: int, capacity: int) -> Cache:
        c = self.config
        n = c.num_hidden_layers
        cache = Cache([None] * n, [None] * n, [None] * n, [None] * n, 0)
        for i, t in enumerate(c.layer_types):
            if t != LINEAR:
                shape = (batch, c.num_key_value_heads, capacity, c.head_dim)
                cache.k[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                cache.v[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return cache

    def forward_prefill(self, ids: torch.Tensor, cache: Cache, vision=None, positions=None,
                        rope_delta: int | None = None) -> torch.Tensor:
        """Run prompt ids [B, T] into `cache` after the `cache.length` tokens it holds (0 for a new cache):
        the new tokens attend to the cached K/V and, causally, to each other; the GDN layers start from
        the cached states. Returns fp32 logits of the last position [B, vocab].

        vision: (index [n] long, features [n, hidden]): slots among these T tokens of sequence 0 whose
        embedding is replaced by vision-tower output; positions: [3, T] rotary ids (default: text, the
        slot plus the cache's rope_delta); rope_delta: stored in the cache for the tokens after this
        chunk (rope.py; None keeps the cache's).
        """
        return self._prefill(ids, cache, vision, positions, rope_delta, None)[0]

    def forward_prefill_kept(self, ids: torch.Tensor, cache: Cache, keep_at: int, vision=None, positions=None,
                             rope_delta: int | None = None) -> tuple[torch.Tensor, "GDNState"]:
        """forward_prefill that also returns the GDN states after the first `keep_at` (0 < keep_at < T) of
        the T tokens, from the same pass (only the recurrence is cut there): with the cache's first
        cache.length + keep_at K/V entries it is the model state at that point (Cache.restart)."""
        if not 0 < keep_at < ids.shape[1]:
            raise ValueError(f"forward_prefill_kept: keep_at {keep_at} must lie inside the {ids.shape[1]} tokens")
        return self._prefill(ids, cache, vision, positions, rope_delta, keep_at)

    @torch.inference_mode()
    def _prefill(self, ids, cache: Cache, vision, positions, rope_delta, keep_at):
        start = cache.length
        if start + ids.shape[1] > cache.capacity:
            raise ValueError(f"forward_prefill: {ids.shape[1]} tokens after {start} do not fit a cache of "
                             f"{cache.capacity} positions")
        kept = None
        if keep_at is not None:
            n = len(cache.conv)
            delta = (cache.rope_delta if positions is None
                     else int(positions[:, :keep_at].max()) + 1 - (start + keep_at))
            kept = GDNState([None] * n, [None] * n, start + keep_at, delta)
        h = F.embedding(ids, self.embed)
        if vision is not None:
            index, features = vision
            h[0].index_copy_(0, index, features.to(h.dtype))
        h = self._layers(h, cache, start, decode=False, positions=positions,
                         cut=None if kept is None else (keep_at, kept))
        cache.length = start + ids.shape[1]
        if rope_delta is not None:
            cache.rope_delta = rope_delta
        return self.logits(h[:, -1]), kept

    @torch.inference_mode()
    def forward_decode(self, ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """One new token per sequence, ids [B]; appends to `cache`; returns fp32 logits [B, vocab]."""
        h = self._layers(F.embedding(ids[:, None], self.embed), cache, cache.length, decode=True)
        cache.length += 1
        return self.logits(h[:, 0])

    @torch.inference_mode()
    def forward_decode_at(self, ids: torch.Tensor, slot: "DecodeSlot", cache: Cache) -> torch.Tensor:
        """forward_decode with the position on the device (slot.pos) and no host-side shapes, so a
        CUDA graph can capture it; the caller advances slot.pos and cache.length."""
        h = self._layers(F.embedding(ids[:, None], self.embed), cache, 0, decode=True, slot=slot)
        return self.logits(h[:, 0])

    def size_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())  # the vision tower included
