"""The model's custom operators: the GDN ones (chunked prefill, one-token decode step, causal conv1d
prefill, its states at given points, and update), the two RMSNorms (plain, and the GDN output's gated
one), paged attention, the vision tower's rotary, attention and LayerNorms (plain, and fused with the residual add before it),
the decode step's one-row projections, int8 weight rows times their scales, and the sampled next token.

Each operator lives in its own folder with its CUDA source, its launcher and its PyTorch
reference. The functions below are the whole surface the runtime uses; `select_backend` decides
once, at model load, whether they run the CUDA kernels or the references.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops
from .gdn_prefill.reference import CHUNK as GDN_CHUNK
from .gdn_prefill.reference import MAX_KEEP as GDN_MAX_KEEP

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "torch")


@dataclass(frozen=True)
class Backend:
    """What runs the custom kernels (GDN, norms, gemv, attention, sampling): `name` is "cuda" or "torch";
    `reason` says why, for the user."""
    name: str
    reason: str

    @property
    def use_cuda(self) -> bool:
        return self.name == "cuda"


_warned: set[str] = set()


def card_unfit(device: torch.device) -> str:
    """Why the CUDA kernels cannot run on the CUDA `device` whatever is installed ("" where they may): checked
    before CuPy is imported, so that an AMD or an older card is told that rather than to install CuPy."""
    if not torch.cuda.is_available():
        return "CUDA kernels need a CUDA device, and torch sees none"
    if getattr(torch.version, "hip", None):  # ROCm: AMD GPUs are CUDA devices to PyTorch, NVRTC builds nothing for them
        return f"CUDA kernels need an NVIDIA GPU; this PyTorch runs AMD GPUs through ROCm {torch.version.hip}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 0):
        return (f"CUDA kernels need compute capability 8.0 or newer; {torch.cuda.get_device_name(index)} "
                f"(compute capability {major}.{minor}) is older")
    return ""


def select_backend(requested: str, device: torch.device | str, dtype: torch.dtype | None = None) -> Backend:
    """Pick the kernel backend for tensors of `dtype` on `device`. `requested` is "auto", "cuda" or "torch".

    "cuda" where the kernels cannot run raises; "auto" falls back to PyTorch and logs the reason once.
    """
    if requested not in BACKENDS:
        raise ValueError(f"kernel backend {requested!r} is not one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if requested == "torch":
        return Backend("torch", "PyTorch reference path (backend 'torch' requested)")
    if device.type != "cuda":
        if requested == "cuda":
            raise RuntimeError(f"kernel backend 'cuda' needs a CUDA device, the model is on {device}; "
                               "choose device 'cuda' or backend 'auto'/'torch'")
        return Backend("torch", f"PyTorch reference path (model on {device.type})")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        if requested == "cuda":
            raise RuntimeError(f"the CUDA kernels take bf16 or fp16, the model is {str(dtype).replace('torch.', '')}; "
                               "load it as bf16/fp16, or choose backend 'auto'/'torch'")
        return Backend("torch", f"PyTorch path: the CUDA kernels take bf16/fp16, the model is "
                                f"{str(dtype).replace('torch.', '')}")
    ok, reason = False, card_unfit(device)
    if not reason:
        try:
            from . import cuda_impl
            ok, reason = cuda_impl.cuda_status(device)
        except ImportError as e:  # CuPy (what else the kernels need is checked inside cuda_status)
            from .cuda_build import _older_cuda  # (a PyTorch for CUDA 11: install.py has no CuPy for it)
            reason = f"CuPy is not installed ({e}); " + (
                _older_cuda() or "run `python install.py` in the pack's folder with ComfyUI's Python (it installs "
                                 "the CuPy that matches this PyTorch's CUDA), then restart ComfyUI")
        except Exception as e:  # noqa: BLE001 - a CuPy that fails on import (built for another NumPy or CUDA)
            reason = (f"CuPy is installed but cannot be imported ({type(e).__name__}: {e}); reinstall the CuPy that "
                      "matches this PyTorch's CUDA (`python install.py` in the pack's folder, run with ComfyUI's "
                      "Python, names it and any other CuPy in the way), then restart ComfyUI")
    if ok:
        compile_ahead(device)
    if ok and dtype == torch.float16:  # (the paged attention kernel takes bf16; the op's reference runs fp16)
        note = ("fp16: attention over the K/V cache runs on the PyTorch path, slower in long contexts; "
                "load the model as bf16 to run it on the kernel")
        if note not in _warned:
            _warned.add(note)
            log.warning("Qwen3.5: %s", note)
        return Backend("cuda", f"{reason}; {note}")
    if ok:
        return Backend("cuda", reason)
    if requested == "cuda":
        raise RuntimeError(f"kernel backend 'cuda' chosen, but {reason}; choose kernel backend 'auto' or 'torch' "
                           "(the PyTorch path)")
    if reason not in _warned:
        _warned.add(reason)
        log.warning("Qwen3.5 GDN kernels fall back to PyTorch: %s", reason)
    return Backend("torch", f"PyTorch fallback: {reason}")


def hopper_card(device: torch.device | str) -> bool:
    """Whether `device` is an sm_90a card (H100 / H200), which runs the warpgroup-mma kernels; False where the
    kernels cannot describe the card (no CuPy or NVRTC, a card older than 8.0, ROCm): the model asks on every
    CUDA device, with the PyTorch backend too."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    try:
        from .cuda_build import card_of
        return card_of(device).wgmma
    except Exception:  # noqa: BLE001 - ImportError (CuPy), KernelBuildError (NVRTC, an old card), a driver error
        return False


def gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, initial_state: Optional[torch.Tensor] = None,
                      cu_seqlens: Optional[torch.Tensor] = None, backend: Backend | None = None,
                      keep: Optional[list] = None):
    """Gated delta rule over a prompt, gates, beta and q/k L2-norm fused.

    q, k: [B, T, Hk, D]; v: [B, T, Hv, Dv] (Hv a multiple of Hk); a, b: [B, T, Hv] raw projections;
    A_log, dt_bias: [Hv]; initial_state: [N, Hv, D, Dv] fp32 or None; cu_seqlens: int32 [N + 1]
    with B == 1 for packed sequences, else None (N = B).
    Returns o: [B, T, Hv, Dv] (v.dtype) and the final state [N, Hv, D, Dv] (fp32). keep (one sequence, B == 1, no
    cu_seqlens): token counts, multiples of 64 in 0 .. T - 1, at most 8: the states after each come third
    [len(keep), Hv, D, Dv] (fp32), from the same walk (the kernels store them as they pass; the reference cuts its
    walk there).
    """
    if keep is not None:
        if cu_seqlens is not None:
            raise ValueError("gdn_chunk_prefill: keep takes one sequence, not packed ones (cu_seqlens)")
        return ops.run(ops.gdn_chunk_prefill_keep_op, q, k, v, a, b, A_log, dt_bias, initial_state,
                       [int(c) for c in keep], bool(backend and backend.use_cuda))
    return ops.run(ops.gdn_chunk_prefill_op, q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens,
                                    bool(backend and backend.use_cuda))


def gdn_decode_step(q, k, v, a, b, A_log, dt_bias, state, backend: Backend | None = None):
    """One token for N sequences. q, k: [N, Hk, D]; v: [N, Hv, Dv]; a, b: [N, Hv];
    state: [N, Hv, D, Dv] fp32, updated in place. Returns o: [N, Hv, Dv]."""
    return ops.run(ops.gdn_decode_step_op, q, k, v, a, b, A_log, dt_bias, state, bool(backend and backend.use_cuda))


def causal_conv1d_prefill(x, weight, bias=None, initial_state=None, cu_seqlens=None,
                          backend: Backend | None = None):
    """silu(causal depthwise conv1d). x: [B, T, C]; weight: [C, W]; initial_state: [N, C, W-1] or None.
    Returns y: [B, T, C] and the conv state [N, C, W-1] (the last W-1 inputs)."""
    return ops.run(ops.causal_conv1d_prefill_op, x, weight, bias, initial_state, cu_seqlens,
                                        bool(backend and backend.use_cuda))


def causal_conv1d_states(x, initial_state, ends, width: int, backend: Backend | None = None):
    """The conv states after ends[s] tokens of x [1, T, C] (ends [S] on x's device, clamped to 0..T), from
    initial_state [1, C, W-1] (or zeros) where a point lies fewer than W-1 tokens in: [S, C, W-1], each what
    causal_conv1d_prefill over x[:, :ends[s]] would return as its state."""
    return ops.run(ops.causal_conv1d_states_op, x, initial_state, ends, width, bool(backend and backend.use_cuda))


def causal_conv1d_update(x, conv_state, weight, bias=None, backend: Backend | None = None):
    """One token. x: [N, C]; conv_state: [N, C, W-1] updated in place. Returns y: [N, C]."""
    return ops.run(ops.causal_conv1d_update_op, x, conv_state, weight, bias, bool(backend and backend.use_cuda))


def rms_norm(x, weight, eps: float, backend: Backend | None = None):
    """Qwen3.5's zero-centred RMSNorm over the last dimension: x / rms(x) * (1 + weight), in fp32,
    returned in x.dtype. x: [..., D]; weight: [D]."""
    return ops.run(ops.rms_norm_op, x, weight, float(eps), bool(backend and backend.use_cuda))


def rms_norm_rope(x, weight, eps: float, cos, sin, backend: Backend | None = None):
    """An attention layer's q or k: rms_norm, rounded to x.dtype, then the rotary (half-split) on the first
    cos.shape[-1] features, each product and the sum in x.dtype. x: [B, T, H, hd]; weight: [hd]; cos, sin:
    [T, rotary_dim] in x.dtype. Returns a contiguous [B, T, H, hd]."""
    return ops.run(ops.rms_norm_rope_op, x, weight, float(eps), cos, sin, bool(backend and backend.use_cuda))


def add_rms_norm(res, x, weight, eps: float, backend: Backend | None = None):
    """The residual stream's add and the norm after it in one pass: returns (s, rms_norm(s)), s = res + x in
    x.dtype (the new residual). res, x: [..., D]; weight: [D]."""
    return ops.run(ops.add_rms_norm_op, res, x, weight, float(eps), bool(backend and backend.use_cuda))


def silu_mul(gu, backend: Backend | None = None):
    """The MLP's gate: silu(g) * u for gu = [..., 2 I] (g its first half, u its second), in gu.dtype."""
    return ops.run(ops.silu_mul_op, gu, bool(backend and backend.use_cuda))


def dequant_rows(q, scale, backend: Backend | None = None):
    """An int8 matrix q [R, C] times its rows' scales [R], in scale.dtype (each product rounded once): what a
    prompt's matmul with int8 weights multiplies by. The CUDA kernel reads each byte once (what it takes:
    dequant.launch.takes; 16-bit scales, C a multiple of 16, 16-byte aligned rows); else the PyTorch expression,
    bit for bit the same."""
    return ops.run(ops.dequant_rows_op, q, scale, bool(backend and backend.use_cuda))


def gemv(x, weight, backend: Backend | None = None, scale=None):
    """One row's projection, x @ weight^T (x [..., K] holding one row, weight [N, K]) -> [..., N] in x.dtype:
    the CUDA kernel streams the weight once (16-bit types, K a multiple of 8); else F.linear. scale [N] (x's
    dtype): weight is int8 with one scale a row, the product (weight x) * scale rounded once (the kernel takes
    K a multiple of 16; else the reference, in fp32). The fused forms below take `scale` alike."""
    return ops.run(ops.gemv_op, x, weight, scale, bool(backend and backend.use_cuda))


def gemv_add_rms_norm(res, x, norm_w, eps: float, weight, backend: Backend | None = None, scale=None):
    """The residual add, the RMSNorm after it and the one-row projection that takes it, in one launch on the
    CUDA backend where that is faster (gemv.launch.fuses): returns (s, rms_norm(s, norm_w) @ weight^T) with
    s = res + x in x.dtype, the values of add_rms_norm then gemv bit for bit. x None: (res, rms_norm(res,
    norm_w) @ weight^T). res, x: [..., K] holding one row; norm_w: [K]; weight: [N, K]."""
    use_cuda = bool(backend and backend.use_cuda)
    if x is None:
        return res, ops.run(ops.gemv_rms_norm_op, res, norm_w, float(eps), weight, scale, use_cuda)
    return ops.run(ops.gemv_add_rms_norm_op, res, x, norm_w, float(eps), weight, scale, use_cuda)


def gemv_silu_mul(gu, weight, backend: Backend | None = None, scale=None):
    """The MLP's down projection of silu(g) * u (gu = [..., 2 K] holding one row, g its first half; weight
    [N, K]), in one launch on the CUDA backend where that is faster (gemv.launch.fuses): the values of
    silu_mul then gemv bit for bit."""
    return ops.run(ops.gemv_silu_mul_op, gu, weight, scale, bool(backend and backend.use_cuda))


def gemv_preferred(device: torch.device | str) -> bool:
    """Whether the decode step's projections take gemv rather than cuBLAS on `device`: on the cards where it
    was measured faster (bench/gemv.py: Hopper); elsewhere cuBLAS, unmeasured against it."""
    return hopper_card(device)


def gated_rms_norm(x, gate, weight, eps: float, backend: Backend | None = None):
    """The GDN output norm: weight * (x / rms(x)) * silu(gate) over the last dimension. x, gate: [..., D];
    weight: [D]."""
    return ops.run(ops.gated_rms_norm_op, x, gate, weight, float(eps), bool(backend and backend.use_cuda))


def paged_attention_on_kernel(backend: Backend | None, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention runs the CUDA kernel (else the PyTorch form, which gathers the keys and values)."""
    return bool(backend and backend.use_cuda) and dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256


def paged_attention(q, k_new, v_new, k_pool, v_pool, block_table, cache_lens, cu_q, gate=None, *, max_q: int,
                    scale: float | None = None, write_kv: bool = True, backend: Backend | None = None):
    """Attention of new tokens over the paged K/V pool (format: runtime/kv_pool.py), their K/V stored in
    the pool in the same call, out *= sigmoid(gate) when a gate is given. q, gate: [T, H, D];
    k_new, v_new: [T, Hkv, D]; k_pool, v_pool: [num_blocks, block_size, Hkv, D] (updated in place);
    block_table int32 [N, max_blocks]; cache_lens int32 [N]; cu_q int32 [N + 1]; max_q: a host int at
        least the most new tokens of any sequence. Returns [T, H, D]. The CUDA kernel takes bf16 and head dims
    that are multiples of 32 up to 256 (every Qwen3.5 size: 256; its tiles fit an RTX card's shared memory up
    to there); the reference runs other dtypes and head dims. Given those, the kernel's launcher refuses
    (ValueError / TypeError, naming the input) what the format rules out: pools that are not contiguous
    bf16, a block size that is not a power of two, q / k / v / gate rows that are not 16-byte aligned."""
    use_cuda = paged_attention_on_kernel(backend, q.dtype, q.shape[-1])
    return ops.run(ops.paged_attention_op, q, k_new, v_new, k_pool, v_pool, block_table, cache_lens, cu_q, gate, int(max_q),
                                  float(q.shape[-1] ** -0.5 if scale is None else scale), bool(write_kv), use_cuda)


def vision_positions(x, pos_embed, table, grids, inv_freq, merge: int, backend: Backend | None = None):
    """The vision patches' positions from their grids alone: (x + the learned position grid bilinearly
    interpolated to each frame's size, cos, sin of the 2-D rotary's angles). x: [N, D] patch embeddings,
    patches in merge-block order per frame; pos_embed [side * side, D]; table: int32 [G, 4] on x's device,
    the grids' t, h, w and first patch (what the kernel reads); grids: the same (t, h, w) on the host (what
    the reference reads); inv_freq fp32 [hd / 4]; merge: the merger's block side. Returns x + pos in x.dtype
    and cos, sin fp32 [N, hd]. One kernel on the CUDA backend (bf16 / fp16, rows a multiple of 8)."""
    flat = [int(v) for g in grids for v in g]
    return ops.run(ops.vision_positions_op, x, pos_embed, table, flat, inv_freq, int(merge),
                   bool(backend and backend.use_cuda))


def vision_rotary(qkv, cos, sin, backend: Backend | None = None):
    """The vision tower's 2-D rotary (rotate-half over the whole head) on q and k, in fp32, rounded once.
    qkv: [N, 3, H, hd] (the qkv projection's output); cos, sin: fp32 [N, hd]. Returns [2, N, H, hd]
    (q, k) in qkv.dtype."""
    return ops.run(ops.vision_rotary_op, qkv, cos, sin, bool(backend and backend.use_cuda))


def vision_attention_takes(q, k, v, cu_seqlens, backend: Backend | None = None) -> bool:
    """Whether `vision_attention` runs its own kernel for these tensors on this backend (bf16, head dim 64 or 72,
    an sm_90a card: kernels/vision/attention.cu); where not, the tower takes SDPA."""
    if not (backend is not None and backend.use_cuda and q.is_cuda):
        return False
    from .vision.launch import attention_takes
    return attention_takes(q, k, v, cu_seqlens)


def vision_attention(q, k, v, cu_seqlens, max_len: int, backend: Backend | None = None):
    """The vision tower's attention: each token attends to the tokens of its own segment (one image, or one
    2-frame slice of a video) and to no other, no mask, scale 1 / sqrt(hd). q, k, v: [N, H, hd]; cu_seqlens int32
    [segments + 1] (the segments' starts and N); max_len: a host int at least the longest segment. Returns
    [N, H, hd] contiguous."""
    return ops.run(ops.vision_attention_op, q, k, v, cu_seqlens, int(max_len), bool(backend and backend.use_cuda))


def compile_ahead(device) -> int:
    """Starts compiling, on worker threads, the kernel modules earlier runs on this kind of GPU loaded whose
    cubins are missing (after an update of the pack or of NVRTC; cuda_build.compile_ahead), so that the first
    run waits for the slowest of them rather than for each in turn. Returns how many it started: 0 where
    there is nothing to do, the list was done before in this process, or the kernels cannot build here (the
    first kernel then says why)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    try:
        from . import cuda_build
        return cuda_build.compile_ahead(cuda_build.card_of(device).arch)
    except Exception:  # noqa: BLE001 - no CuPy, NVRTC or headers; an old card; a damaged list: only a head start
        return 0


def hash_words(words, seeds: tuple[int, int], backend: Backend | None = None):
    """The prefix cache's content hash lanes over int64 words [N]: int64 [2] on words' device, lane s the
    wrapping sum of mix(w_i ^ mix(i + seeds[s])) (content_hash/reference.py). One kernel on the CUDA backend
    (the same bits as the reference), else the torch expression. Not an operator: no compiled graph reads it.
    The kernel runs on the current device (the model's, which the backend was chosen for): words on another GPU
    (a source image left where ComfyUI made it) take the torch expression there, ordered on its own stream."""
    if backend is not None and backend.use_cuda and words.is_cuda and words.device.index == torch.cuda.current_device():
        from .content_hash.launch import hash_words_cuda
        return hash_words_cuda(words, seeds)
    from .content_hash.reference import hash_words_ref
    return hash_words_ref(words, seeds)


def penalty_marks(prompt_ids, vocab: int):
    """The marks `sample`'s penalties start from: uint8 [vocab] on prompt_ids' device (int64 ids), bit 0 on every
    id of the prompt."""
    from .sampling.reference import penalty_marks as marks
    return marks(prompt_ids, vocab)


def sample(logits, top_k: int, temperature: float, min_p: float, top_p: float, u: float,
           backend: Backend | None = None, penalties=None):
    """One token drawn from fp32 logits [V]: (id int64 [1], weights [C], ids int64 [C] or None for every id in
    order). penalties: (marks uint8 [V], repetition, presence) or None: bit 0 of an id's mark (prompt or answer)
    divides its logit by `repetition` where positive and multiplies it where not, bit 1 (answer) subtracts
    `presence`; the drawn id is marked with both (penalty_marks makes a start). The
    candidates are top_k's k highest logits (all where top_k is 0 or >= V), in order of logit and then of id;
    their weights the softmax of logits / temperature, zero where min_p or top_p drops one; the id the candidate
    where the weights' running sum first exceeds u * their total (sampling/reference.py). One kernel on the CUDA
    backend for fp32 logits and 0 < top_k <= 64, else the torch ops. Nothing is read back to the host. Not an
    operator: generate runs outside compiled graphs."""
    if backend is not None and backend.use_cuda and logits.is_cuda:
        from .sampling.launch import sample_cuda
        return sample_cuda(logits, top_k, temperature, min_p, top_p, u, penalties)
    from .sampling.reference import sample_ref
    return sample_ref(logits, top_k, temperature, min_p, top_p, u, penalties)


def layer_norm(x, weight, bias, eps: float, backend: Backend | None = None):
    """LayerNorm over the last dimension, fp32 statistics, returned in x.dtype. x: [..., D]; weight, bias: [D]."""
    return ops.run(ops.layer_norm_op, x, weight, bias, float(eps), bool(backend and backend.use_cuda))


def add_layer_norm(x, y, weight, bias, eps: float, backend: Backend | None = None):
    """The residual add and the LayerNorm after it in one pass: returns (s, LayerNorm(s)), s = x + y in
    x.dtype (the new residual). x, y: [..., D]; weight, bias: [D]."""
    return ops.run(ops.add_layer_norm_op, x, y, weight, bias, float(eps), bool(backend and backend.use_cuda))


__all__ = ["GDN_CHUNK", "GDN_MAX_KEEP",
           "Backend", "BACKENDS", "select_backend", "card_unfit", "gdn_chunk_prefill", "gdn_decode_step",
           "causal_conv1d_prefill", "causal_conv1d_states", "causal_conv1d_update", "rms_norm", "rms_norm_rope", "add_rms_norm", "silu_mul", "dequant_rows", "gemv",
           "gemv_add_rms_norm", "gemv_silu_mul", "gemv_preferred",
           "gated_rms_norm",
           "paged_attention",
           "vision_positions", "vision_rotary", "vision_attention", "vision_attention_takes", "layer_norm", "add_layer_norm", "hash_words", "penalty_marks", "sample"]
