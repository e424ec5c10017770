"""Short prefills after a cached prefix, replayed from CUDA graphs.

A question after a reused system prompt and image is a few dozen tokens: its ~490 kernels take ~6 ms
on the GPU but ~30 ms to launch from Python (bench/ttft_profile.py before the graphs). Here such a prefill
runs as one graph launch. Its token count is padded up to a bucket (BUCKETS), one graph per bucket,
captured the first time the bucket is used and replayed for any prompt that fits it: the real count,
the cached length, the block table, the rotary positions and the incoming GDN states live in device
buffers the graph reads (Qwen35Model.forward_prefill_padded says why the filler changes nothing). The
filler's K/V need room up to the bucket's end, which the pass gives back once it has run. A graph reads
the weights' and the K/V store's addresses: a move of the model drops it, and so does the next lookup
after a new or resized store (Qwen35Model.graphs, KVStore.version).
"""
from __future__ import annotations

import logging
import os
import weakref

import numpy as np
import torch

from .decode_graph import capture_graph
from .kv_pool import PAD, SequenceBlocks
from .model import Cache, GDNState, KVStep, Padding, Qwen35Model, rope_delta_after, text_positions
from .packed import flat_view, pack, pack_views, views_like

log = logging.getLogger(__name__)
BUCKETS = (64, 256)  # new tokens: a question with its generation prompt, a longer follow-up turn
CAPTURE_FAILED = "capture failed"  # model.graphs' entry for a bucket whose capture failed: it runs eagerly
_warned = False


def bucket_for(n: int) -> int | None:
    """The smallest bucket that holds n new tokens, or None (the prefill runs eagerly)."""
    return next((b for b in BUCKETS if n <= b), None)


class PaddedPrefill:
    """forward_prefill_padded over `bucket` tokens with every input in a fixed device buffer; captured in a
    CUDA graph on the first call when `capture` (else each call runs the pass: the same buffers, for the
    CPU and tests)."""

    def __init__(self, model: Qwen35Model, bucket: int, capture: bool):
        dev, store = model.device, model.kv
        # model.graphs keeps this pass: a weak reference back, so that dropping the model frees it at once (a
        # cycle would hold the weights and the K/V store until Python's next full collection)
        self._model = weakref.ref(model)
        self.bucket, self.store, self.version, self.capture = bucket, store, store.version, capture
        # Every per-call input in one device buffer, filled by one copy from a host buffer of the same layout
        # (int64: ids [bucket], positions [3, bucket], n, cut; int32: cache length, a pad, the block table).
        # The table has room for every block of the store: any sequence fits, the launch shape never changes.
        b, nb = bucket, store.num_blocks
        self._i64 = 4 * b + 2
        size = 8 * self._i64 + 4 * (2 + nb)
        self._dev = torch.zeros(size, dtype=torch.uint8, device=dev)
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self._host_np = self._host.numpy()  # written through numpy: a few hundred ns a field
        self._staged = None  # the event after the last copy from the host buffer (it may be refilled after it)
        d64, d32 = self._dev[:8 * self._i64].view(torch.long), self._dev[8 * self._i64:].view(torch.int32)
        self.ids, self.positions = d64[:b].view(1, b), d64[b:4 * b].view(3, b)
        self.n, self.cut = d64[4 * b:4 * b + 1], d64[4 * b + 1:4 * b + 2]
        d32[2:].fill_(PAD)
        self.kv = KVStep(table=d32[2:].view(1, nb), lens=d32[:1],
                         cu_q=torch.tensor([0, bucket], dtype=torch.int32, device=dev), max_q=bucket)
        self.conv = self.ssm = self.one_ssm = None  # the GDN states going in: shaped like the first caller's
        self.graph = None
        self.pool_bytes = 0  # device memory the captured graph keeps (its outputs and activations)

    @property
    def model(self) -> Qwen35Model:
        return self._model()

    @property
    def nbytes(self) -> int:
        """Device memory this pass holds: its input buffers and what its graph keeps (counted in the model's
        size, so that ComfyUI's memory management sees it)."""
        bufs = [self._dev, self.kv.cu_q, *(t for t in (self.conv or []) + (self.ssm or []) if t is not None)]
        return sum(t.numel() * t.element_size() for t in bufs) + self.pool_bytes

    def _pass(self):
        """The padded forward over the buffers; returns the logits and the four state lists (the cache's
        conv and ssm, the cut's), each packed into one flat tensor."""
        cache = Cache(list(self.conv), list(self.ssm), self.store, SequenceBlocks())
        logits, kept = self.model.forward_prefill_padded(self.ids, cache, self.kv, self.positions,
                                                         Padding(self.n, self.cut))
        return logits, *(pack(xs) for xs in (cache.conv, cache.ssm, kept.conv, kept.ssm))

    def _capture(self) -> None:
        # warmed up on this call's inputs, then captured
        self.graph, self.out, self.pool_bytes = capture_graph(self.model.device, self._pass)

    def _stage(self, ids, pos: torch.Tensor, n: int, cut: int, start: int, blocks) -> None:
        """This call's inputs into the host buffer, then one queued copy into the device buffer (the bytes up
        to the last block of the table that is used)."""
        if self._staged is not None:
            self._staged.synchronize()  # the previous call's copy has read the host buffer
        b = self.bucket
        h64 = self._host_np[:8 * self._i64].view(np.int64)
        h64[:n] = ids
        h64[n:b] = 0
        hp = h64[b:4 * b].reshape(3, b)
        hp[:, :n] = pos.numpy()
        hp[:, n:] = hp[:, n - 1:n] + np.arange(1, b - n + 1)  # the filler continues the positions
        h64[4 * b], h64[4 * b + 1] = n, cut
        h32 = self._host_np[8 * self._i64:].view(np.int32)
        h32[0] = start
        h32[2:2 + len(blocks)] = blocks
        used = 8 * self._i64 + 4 * (2 + len(blocks))
        cuda = self._dev.is_cuda
        self._dev[:used].copy_(self._host[:used], non_blocking=cuda)
        if cuda:
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(self._dev.device))  # the model's device's stream

    def _copy_states(self, cache: Cache) -> None:
        """The cache's GDN states into the pass's buffers: one copy each for a packed state (GDNState.packed, a
        snapshot), the recurrent one into both of its halves at once."""
        dst, src = flat_view(self.conv), flat_view(cache.conv)
        if dst is not None and src is not None and src.shape == dst.shape:
            dst.copy_(src)
        elif dst is not None:
            torch._foreach_copy_([t for t in self.conv if t is not None], [t for t in cache.conv if t is not None])
        layers = [t for t in cache.ssm if t is not None]
        dst, src = flat_view(self.ssm), flat_view(cache.ssm)
        if dst is not None and src is not None and dst.numel() == 2 * src.numel():
            n = len(layers)
            dst.view(n, 2, -1).copy_(src.view(n, 1, -1).expand(n, 2, -1))
        else:
            for d, t in zip((t for t in self.ssm if t is not None), layers):
                d.copy_(t.expand_as(d))

    def __call__(self, cache: Cache, ids, positions: torch.Tensor | None, rope_delta: int | None,
                 keep_at: list[int]) -> tuple[torch.Tensor, list[GDNState]]:
        """Model.forward_prefill_kept's contract for at most `bucket` ids (a list) and at most one keep_at:
        prefill them into `cache` after its cache.length tokens (positions [3, len(ids)]: their rotary
        ids, None for text). Returns the fp32 logits of the last token [1, vocab] and the GDN states
        after each keep_at. The cache needs room for the whole bucket during the pass (reserved here when
        it lacks it); afterwards it keeps only the blocks its tokens fill (KVPool.trim)."""
        n, start, dev = len(ids), cache.length, self.ids.device
        if not 0 < n <= self.bucket or len(keep_at) > 1:
            raise ValueError(f"PaddedPrefill: {n} tokens and cuts {keep_at} do not fit a bucket of {self.bucket}")
        cache.reserve(start + self.bucket)  # the filler's K/V go after the prompt's
        if self.store.version != self.version or cache.store is not self.store:
            raise RuntimeError("PaddedPrefill: the K/V store grew or changed since this pass was made; reserve "
                               "room for the bucket first and take the pass for the store as it is "
                               "(prefill_graph.padded_prefill)")
        pos = text_positions(cache, n, "cpu") if positions is None else positions.cpu()  # host positions: no sync
        cut = keep_at[0] if keep_at else n
        kept = GDNState([], [], start + cut, rope_delta_after(cache, positions, cut))
        self._stage(ids, pos, n, cut, start, cache.seq.blocks)
        if self.conv is None:  # each kind of state as views of one flat buffer
            self.conv = pack_views([None if t is None else torch.zeros_like(t, device=dev) for t in cache.conv])
            # the recurrent states twice over: one for each sequence of the padded pass, which reads them
            # where they lie (forward_prefill_padded)
            self.ssm = pack_views([None if t is None else t.new_zeros((2, *t.shape[1:]), device=dev)
                                   for t in cache.ssm])
            self.one_ssm = [None if t is None else t[:1] for t in self.ssm]  # one state's shape, to unpack into
        self._copy_states(cache)
        if self.capture and self.graph is None:
            try:
                self._capture()
            except torch.cuda.OutOfMemoryError:
                raise  # the caller names what was needed; the next call captures again
            except RuntimeError as e:  # any other capture failure leaves the pass itself, which always works
                self.capture = False
                _warn(e)
                self._forget()
        if self.graph is not None:
            self.graph.replay()
            logits, conv, ssm, cut_conv, cut_ssm = self.out
        else:
            logits, conv, ssm, cut_conv, cut_ssm = self._pass()
        cache.conv[:], cache.ssm[:] = _unpack(conv, self.conv), _unpack(ssm, self.one_ssm)
        cache.length = start + n
        if rope_delta is not None:
            cache.rope_delta = rope_delta
        if keep_at:
            kept.conv, kept.ssm = _unpack(cut_conv, self.conv), _unpack(cut_ssm, self.one_ssm)
        # the filler's blocks back to the pool: nothing reads them, and the stream writes any later use of them
        # after this pass
        self.store.pool.trim(cache.seq)
        return logits.clone(), [kept] if keep_at else []

    def _forget(self) -> None:
        """After a failed capture: this pass's entry in model.graphs becomes CAPTURE_FAILED, so that its buffers
        go once this call is done and padded_prefill answers None for the bucket."""
        graphs = self.model.graphs
        for key in [k for k, g in graphs.items() if g is self]:
            graphs[key] = CAPTURE_FAILED


def _unpack(flat: torch.Tensor, like: list) -> list:
    """A copy of pack(xs) as tensors shaped like `like` (None where it has None): views of one new
    tensor, so a call costs one copy, not one per layer (the next replay overwrites `flat`)."""
    return views_like(flat.clone(), like)


def _warn(e: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("Qwen3.5 short prefills run without CUDA graphs (capture failed: %s)", e)


def drop_stale(model: Qwen35Model) -> None:
    """Drops from model.graphs every pass made for another store or before the store was resized: it can never
    run again, and its buffers and graph memory would stay counted in the model's size."""
    store = model.kv
    for key in [k for k, g in model.graphs.items()
                if isinstance(g, PaddedPrefill) and (g.store is not store or g.version != store.version)]:
        del model.graphs[key]


def padded_prefill(model: Qwen35Model, cached: int, n: int) -> PaddedPrefill | None:
    """The graphed pass for n new tokens after `cached` ones (captured on its first call), or None: not
    on CUDA, QWEN35_CUDA_GRAPHS=0, more than the largest bucket, nothing cached before, or a capture of
    this bucket failed since the model last moved or its store was made. Drops the stale passes first."""
    drop_stale(model)
    b = bucket_for(n)
    if (b is None or cached == 0 or model.device.type != "cuda"
            or os.environ.get("QWEN35_CUDA_GRAPHS", "1") == "0"):
        return None
    key = ("prefill", b)
    g = model.graphs.get(key)
    if g is None:
        g = model.graphs[key] = PaddedPrefill(model, b, capture=True)
    return g if isinstance(g, PaddedPrefill) else None


__all__ = ["BUCKETS", "CAPTURE_FAILED", "bucket_for", "PaddedPrefill", "drop_stale", "padded_prefill"]
