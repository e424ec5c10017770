"""Lists of tensors laid back to back in one flat tensor, the list entries views of it (None entries kept): the GDN
states of a prefix snapshot or a parked prefill, so that one copy moves them all and a graphed prefill copies them
in at once (model.GDNState.packed)."""
from __future__ import annotations

import torch


def flat_view(xs: list) -> torch.Tensor | None:
    """One 1-D view over the tensors of xs (None skipped) when they lie back to back, in order, contiguous and
    of one dtype in one storage; else None."""
    ts = [t for t in xs if t is not None]
    if not ts:
        return None
    first = ts[0]
    base, off = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in ts:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != base
                or t.storage_offset() != off):
            return None
        off += t.numel()
    return first.as_strided((off - first.storage_offset(),), (1,), first.storage_offset())


def views_like(flat: torch.Tensor, like: list) -> list:
    """flat [sum of like's sizes] as consecutive views shaped like the tensors of `like` (None where it has
    None)."""
    parts = iter(flat.split([t.numel() for t in like if t is not None]))
    return [None if t is None else next(parts).view(t.shape) for t in like]


def pack(xs: list) -> torch.Tensor:
    """The tensors of xs (None skipped) end to end in one new flat tensor."""
    return torch.cat([t.reshape(-1) for t in xs if t is not None])


def pack_views(xs: list) -> list:
    """Copies of the tensors of xs as views of one new flat tensor (None kept); [] for []."""
    return views_like(pack(xs), xs) if any(t is not None for t in xs) else list(xs)


def apply_packed(xs: list, fn) -> None:
    """xs[:] = fn of each tensor of xs (a move, a cast; None kept), in place in the list: a packed list through one
    call of fn on its flat view, and packed still."""
    flat = flat_view(xs)
    xs[:] = views_like(fn(flat), xs) if flat is not None else [None if t is None else fn(t) for t in xs]
