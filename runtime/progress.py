"""Progress of a long prefill or a model load, for a caller that shows it or cancels it.

The runtime calls the hook set by `reporting` between the pieces of a long prompt (model.py, PREFILL_PIECE),
between the passes of the vision tower (vision.py, TOWER_PASS_PATCHES) and after each weight load_model reads
(loader.py): hook(stage, done, total) with stage "prompt" (tokens of this pass read so far, of all), "vision"
(patches) or "load" (text-model tensors). An exception raised by the hook ends the prefill or the load there and
reaches the caller; nothing either made stays (a prefill's cache blocks go back to the pool with it, and no
snapshot is saved before the whole prompt is read; a load frees the model it was filling). Short prompts make no
call.

    with progress.reporting(lambda stage, done, total: print(stage, done, total)):
        pf = prefill(model, long_prompt)
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

Hook = Callable[[str, int, int], None]
_hook: ContextVar[Hook | None] = ContextVar("qwen35_progress_hook", default=None)


@contextmanager
def reporting(hook: Hook):
    """Calls to report() in this thread (and context) go to `hook` until the block ends."""
    token = _hook.set(hook)
    try:
        yield
    finally:
        _hook.reset(token)


def report(stage: str, done: int, total: int) -> None:
    """Tells the hook of the caller's `reporting` block, if any, that `done` of `total` are through."""
    hook = _hook.get()
    if hook is not None:
        hook(stage, done, total)


__all__ = ["reporting", "report"]
