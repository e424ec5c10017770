"""The kernels' operators as torch custom ops (namespace `qwen35_fast`): the four GDN operators and the
four RMSNorms (plain, gated, with the attention's rotary, after the residual add), the MLP's silu(g) * u, the
decode step's one-row projections (alone, after the residual add and norm, after the MLP's gate), paged
attention over the K/V block pool, and the vision tower's positions, rotary, attention and LayerNorms.

Registering them as custom ops with fake implementations lets a torch.compile'd function call them
as opaque nodes: no graph break inside our code, no tracing into CuPy. Each op runs the CUDA kernel
when `use_cuda` is true (the tensors are then on a GPU the kernels were built for) and the PyTorch
reference otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from .conv1d.reference import causal_conv1d_prefill_ref, causal_conv1d_states_ref, causal_conv1d_update_ref
from .dequant.reference import dequant_rows_ref
from .gdn_decode.reference import gdn_decode_step_ref
from .gdn_prefill.reference import gdn_prefill_chunked
from .gemv.reference import gemv_add_rms_norm_ref, gemv_ref, gemv_silu_mul_ref
from .paged_attention.reference import paged_attention_ref
from .rms_norm.reference import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref, rms_norm_rope_ref
from .silu_mul.reference import silu_mul_ref
from .vision.reference import (
    add_layer_norm_ref,
    layer_norm_ref,
    vision_attention_ref,
    vision_positions_ref,
    vision_rotary_ref,
)

NS = "qwen35_fast"


def _cuda():
    from . import cuda_impl  # imported only when a CUDA backend was selected
    return cuda_impl


def _num_seqs(B, cu_seqlens):
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _existing_op(name):
    """NS::name if an earlier import of this pack registered it, else None."""
    try:
        return getattr(getattr(torch.ops, NS), name).default
    except (AttributeError, RuntimeError):
        return None


def _register(name, fn, fake, mutates_args=()):
    """Register `fn` as NS::name; if an earlier import of this pack already did, reuse that op.

    The pack can be imported twice under two module names (pip and custom_nodes; or its `kernels/`
    folder as a top-level `kernels` when the repository root is on sys.path and transformers probes
    for the Hugging Face package of that name). A second registration attempt must not even start:
    the failed attempt's library fragment, torn down, leaves the first op dangling (a segfault at its
    next call), so look the op up first.
    """
    op = _existing_op(name)
    if op is None:
        op = torch.library.custom_op(f"{NS}::{name}", mutates_args=mutates_args)(fn)
        op.register_fake(fake)
    _EAGER[op] = fn
    return op


_EAGER: dict = {}  # registered op -> its Python implementation


def run(op, *args):
    """op(*args) while torch.compile traces (an opaque node of the graph); outside, the implementation
    itself: an eager call through the dispatcher's custom-op path costs ~0.1 ms of host time, ~40 ms over
    the 9B model's 379 operator calls of a short prefill (bench/ttft_profile.py), for nothing."""
    if torch.compiler.is_compiling():
        return op(*args)
    return _EAGER[op](*args)


def _prefill_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().gdn_chunk_prefill_cuda(q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens)
    return gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens)


def _prefill_fake(q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens, use_cuda):
    B, T, Hv, Dv = v.shape
    N = _num_seqs(B, cu_seqlens)
    return v.new_empty(B, T, Hv, Dv), v.new_empty(N, Hv, q.shape[-1], Dv, dtype=torch.float32)


def _prefill_keep_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: Optional[torch.Tensor],
                       keep: list[int], use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().gdn_chunk_prefill_cuda(q, k, v, a, b, A_log, dt_bias, initial_state, keep=keep)
    return gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, initial_state, keep=keep)


def _prefill_keep_fake(q, k, v, a, b, A_log, dt_bias, initial_state, keep, use_cuda):
    B, T, Hv, Dv = v.shape
    return (v.new_empty(B, T, Hv, Dv), v.new_empty(B, Hv, q.shape[-1], Dv, dtype=torch.float32),
            v.new_empty(len(keep), Hv, q.shape[-1], Dv, dtype=torch.float32))


def _decode_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
    return gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state).contiguous()


def _decode_fake(q, k, v, a, b, A_log, dt_bias, state, use_cuda):
    return v.new_empty(v.shape)


def _conv_prefill_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                       use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().causal_conv1d_prefill_cuda(x, weight, bias, initial_state, cu_seqlens)
    y, final = causal_conv1d_prefill_ref(x, weight, bias, initial_state, cu_seqlens)
    return y.contiguous(), final.contiguous()


def _conv_prefill_fake(x, weight, bias, initial_state, cu_seqlens, use_cuda):
    B, T, C = x.shape
    return x.new_empty(B, T, C), x.new_empty(_num_seqs(B, cu_seqlens), C, weight.shape[-1] - 1)  # [C, W] or [C, 1, W]


def _conv_states_impl(x: torch.Tensor, initial_state: Optional[torch.Tensor], ends: torch.Tensor, width: int,
                      use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().causal_conv1d_states_cuda(x, initial_state, ends, width)
    return causal_conv1d_states_ref(x, initial_state, ends, width)


def _conv_states_fake(x, initial_state, ends, width, use_cuda):
    return x.new_empty(ends.shape[0], x.shape[2], width - 1)


def _conv_update_impl(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor], use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().causal_conv1d_update_cuda(x, conv_state, weight, bias)
    return causal_conv1d_update_ref(x, conv_state, weight, bias).contiguous()


def _conv_update_fake(x, conv_state, weight, bias, use_cuda):
    return x.new_empty(x.shape)


def _norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().rms_norm_cuda(x, weight, eps)
    return rms_norm_ref(x, weight, eps).contiguous()


def _norm_fake(x, weight, eps, use_cuda):
    return x.new_empty(x.shape)


def _norm_rope_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().rms_norm_rope_cuda(x, weight, eps, cos, sin)
    return rms_norm_rope_ref(x, weight, eps, cos, sin).to(x.dtype, memory_format=torch.contiguous_format)  # as the fake


def _norm_rope_fake(x, weight, eps, cos, sin, use_cuda):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_norm_impl(res: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().add_rms_norm_cuda(res, x, weight, eps)
    return tuple(t.contiguous() for t in add_rms_norm_ref(res, x, weight, eps))  # as the fake says


def _add_norm_fake(res, x, weight, eps, use_cuda):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _silu_mul_impl(gu: torch.Tensor, use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().silu_mul_cuda(gu)
    return silu_mul_ref(gu).contiguous()


def _silu_mul_fake(gu, use_cuda):
    return gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2)


def _dequant_rows_impl(q: torch.Tensor, scale: torch.Tensor, use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().dequant_rows_cuda(q, scale)
    return dequant_rows_ref(q, scale)


def _dequant_rows_fake(q, scale, use_cuda):
    return q.new_empty(q.shape, dtype=scale.dtype)


def _gemv_impl(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor], use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().gemv_cuda(x, weight, scale=scale)
    return gemv_ref(x, weight, scale)


def _gemv_fake(x, weight, scale, use_cuda):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _gemv_add_norm_impl(res: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: torch.Tensor,
                        scale: Optional[torch.Tensor], use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().gemv_add_rms_norm_cuda(res, x, norm_w, eps, weight, scale=scale)
    return gemv_add_rms_norm_ref(res, x, norm_w, eps, weight, scale)


def _gemv_add_norm_fake(res, x, norm_w, eps, weight, scale, use_cuda):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),  # s = res + x in x.dtype, as add_rms_norm
            x.new_empty(*x.shape[:-1], weight.shape[0]))


def _gemv_norm_impl(res: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: torch.Tensor,
                    scale: Optional[torch.Tensor], use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().gemv_add_rms_norm_cuda(res, None, norm_w, eps, weight, scale=scale)[1]
    return gemv_add_rms_norm_ref(res, None, norm_w, eps, weight, scale)[1]


def _gemv_norm_fake(res, norm_w, eps, weight, scale, use_cuda):
    return res.new_empty(*res.shape[:-1], weight.shape[0])


def _gemv_silu_mul_impl(gu: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                        use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().gemv_silu_mul_cuda(gu, weight, scale=scale)
    return gemv_silu_mul_ref(gu, weight, scale)


def _gemv_silu_mul_fake(gu, weight, scale, use_cuda):
    return gu.new_empty(*gu.shape[:-1], weight.shape[0])


def _gated_norm_impl(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                     use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().gated_rms_norm_cuda(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps).contiguous()


def _gated_norm_fake(x, gate, weight, eps, use_cuda):
    return x.new_empty(x.shape)


def _paged_attention_impl(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                          cu_q: torch.Tensor, gate: Optional[torch.Tensor], max_q: int, scale: float,
                          write_kv: bool, use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        from .paged_attention.launch import paged_attention_cuda
        return paged_attention_cuda(q, k_new, v_new, k_pool, v_pool, block_table, cache_lens, cu_q, gate, max_q,
                                    scale, write_kv)
    return paged_attention_ref(q, k_new, v_new, k_pool, v_pool, block_table, cache_lens, cu_q, gate, scale, write_kv)


def _paged_attention_fake(q, k_new, v_new, k_pool, v_pool, block_table, cache_lens, cu_q, gate, max_q, scale,
                          write_kv, use_cuda):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _vision_positions_impl(x: torch.Tensor, pos_embed: torch.Tensor, table: torch.Tensor, grids: list[int],
                           inv_freq: torch.Tensor, merge: int,
                           use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().vision_positions_cuda(x, pos_embed, table, grids, inv_freq, merge)
    return tuple(t.contiguous() for t in vision_positions_ref(x, pos_embed, grids, inv_freq, merge))


def _vision_positions_fake(x, pos_embed, table, grids, inv_freq, merge, use_cuda):
    n, hd = x.shape[0], 4 * inv_freq.shape[0]
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(n, hd, dtype=torch.float32, device=x.device),
            torch.empty(n, hd, dtype=torch.float32, device=x.device))


def _vision_rotary_impl(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().vision_rotary_cuda(qkv, cos, sin)
    return vision_rotary_ref(qkv, cos, sin)


def _vision_rotary_fake(qkv, cos, sin, use_cuda):
    n, _, h, hd = qkv.shape
    return qkv.new_empty(2, n, h, hd)


def _vision_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                           use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().vision_attention_cuda(q, k, v, cu_seqlens, max_len)
    return vision_attention_ref(q, k, v, cu_seqlens)


def _vision_attention_fake(q, k, v, cu_seqlens, max_len, use_cuda):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _layer_norm_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     use_cuda: bool) -> torch.Tensor:
    if use_cuda:
        return _cuda().layer_norm_cuda(x, weight, bias, eps)
    return layer_norm_ref(x, weight, bias, eps)


def _layer_norm_fake(x, weight, bias, eps, use_cuda):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_layer_norm_impl(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                         use_cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_cuda:
        return _cuda().add_layer_norm_cuda(x, y, weight, bias, eps)
    return tuple(t.contiguous() for t in add_layer_norm_ref(x, y, weight, bias, eps))


def _add_layer_norm_fake(x, y, weight, bias, eps, use_cuda):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


gdn_chunk_prefill_op = _register("gdn_chunk_prefill", _prefill_impl, _prefill_fake)
gdn_chunk_prefill_keep_op = _register("gdn_chunk_prefill_keep", _prefill_keep_impl, _prefill_keep_fake)
gdn_decode_step_op = _register("gdn_decode_step", _decode_impl, _decode_fake, mutates_args=("state",))
causal_conv1d_prefill_op = _register("causal_conv1d_prefill", _conv_prefill_impl, _conv_prefill_fake)
causal_conv1d_states_op = _register("causal_conv1d_states", _conv_states_impl, _conv_states_fake)
causal_conv1d_update_op = _register("causal_conv1d_update", _conv_update_impl, _conv_update_fake,
                                    mutates_args=("conv_state",))
rms_norm_op = _register("rms_norm", _norm_impl, _norm_fake)
rms_norm_rope_op = _register("rms_norm_rope", _norm_rope_impl, _norm_rope_fake)
add_rms_norm_op = _register("add_rms_norm", _add_norm_impl, _add_norm_fake)
silu_mul_op = _register("silu_mul", _silu_mul_impl, _silu_mul_fake)
dequant_rows_op = _register("dequant_rows", _dequant_rows_impl, _dequant_rows_fake)
gemv_op = _register("gemv", _gemv_impl, _gemv_fake)
gemv_add_rms_norm_op = _register("gemv_add_rms_norm", _gemv_add_norm_impl, _gemv_add_norm_fake)
gemv_rms_norm_op = _register("gemv_rms_norm", _gemv_norm_impl, _gemv_norm_fake)
gemv_silu_mul_op = _register("gemv_silu_mul", _gemv_silu_mul_impl, _gemv_silu_mul_fake)
gated_rms_norm_op = _register("gated_rms_norm", _gated_norm_impl, _gated_norm_fake)
paged_attention_op = _register("paged_attention", _paged_attention_impl, _paged_attention_fake,
                               mutates_args=("k_pool", "v_pool"))
vision_positions_op = _register("vision_positions", _vision_positions_impl, _vision_positions_fake)
vision_rotary_op = _register("vision_rotary", _vision_rotary_impl, _vision_rotary_fake)
vision_attention_op = _register("vision_attention", _vision_attention_impl, _vision_attention_fake)
layer_norm_op = _register("layer_norm", _layer_norm_impl, _layer_norm_fake)
add_layer_norm_op = _register("add_layer_norm", _add_layer_norm_impl, _add_layer_norm_fake)
