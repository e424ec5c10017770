"""The values that travel on this pack's links."""
from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Optional

import comfy.model_management as mm
import comfy.utils
from comfy_api.latest import io

from .memory import ModelHandle

log = logging.getLogger(__name__)

Qwen35Model = io.Custom("QWEN35_MODEL")
Qwen35Prefill = io.Custom("QWEN35_PREFILL")


class ModelPrefill:
    """A runtime Prefill and the model it belongs to. ComfyUI caches it and may hand it to many
    Generate nodes; the runtime never changes a Prefill, so each run starts from the same state.

    A prefill node's earlier output is let go when the node runs again (`made`): ComfyUI's cache can keep the
    outputs of earlier prompts (--cache-lru, older versions' default), and it cannot see that a prefill holds K/V
    blocks and GDN states in VRAM, so each edit of a prompt would keep the last one's there. An output let go
    keeps how to make it again (`remake`: the node's runtime call on the same inputs, given `reuse_at_most`), and
    `prefill` makes it again when ComfyUI hands it on once more (the prompt edited back): from the cached prefix
    the first read started from (its cached_tokens, not the longer one that read left), so its logits are the
    first read's bit for bit while the store keeps that snapshot, and the same seed gives the same answer."""

    def __init__(self, model: ModelHandle, prefill: Any, item: int = 0, items: int = 1,
                 remake: Optional[Callable[..., Any]] = None, node: Optional[str] = None,
                 workflow: Optional[str] = None):
        self.model = model
        # its place in a list of prefills one node run made (the one-prompt-per-image mode; a Continue after one
        # keeps its parent's): such a prefill's states wait off the GPU (ManagedModel.park)
        self.item, self.items = item, items
        self._run_per_item = False  # its place is one of a node's runs over a list input (listed)
        self.node = node  # the id of the node that made it (None outside a ComfyUI run)
        self.workflow = workflow  # the id of that node's workflow (workflow_id; None where the prompt has none)
        self.made_in = running()[0]  # the prompt it was made in (None outside a ComfyUI run)
        self.read_time_shown = False  # an answer showed the read's time in its first token's (Generate._answer)
        self._prefill, self._remake = prefill, remake
        self._cached = prefill.cached_tokens  # the cached prefix it was read from (made again from it)

    @property
    def prefill(self) -> Any:
        """The runtime Prefill, made again where this output was let go (its node ran since with other inputs)."""
        if self._prefill is None:
            log.info("Qwen3.5: reading a prefill of node %s again (its node has run with other inputs since; the "
                     "prefix cache holds what it can of it)", self.node)
            pf = self._remake(reuse_at_most=self._cached)
            self.model.track(pf)
            if self.items > 1:
                self.model.park(pf)
            self._prefill, self.made_in, self.read_time_shown = pf, running()[0], False
            made(self.node, [self], self.workflow)
        return self._prefill

    @property
    def let_go(self) -> bool:
        return self._prefill is None

    def listed(self, item: int, items: int) -> None:
        """One of a list its node made one run per item (a list input: ComfyUI runs the node once per item before
        any node after it): its place, where its node gave none, and its states off the GPU until its Generate
        (ManagedModel.park), as one prompt per image's."""
        if self.items == 1 or self._run_per_item:
            self.item, self.items, self._run_per_item = item, items, True
        if self._prefill is not None:
            self.model.park(self._prefill)

    def let_go_now(self) -> None:
        """Drops the runtime Prefill (its blocks go back to the K/V store, where the prefix cache's snapshots keep
        what they hold; its GDN states are freed) where it can be made again."""
        if self._remake is not None:
            self._prefill = None


# what each link type carries, and the nodes whose output it is
_SOURCES = {"model": ("a Qwen3.5 model", "a Qwen3.5 Model Loader"),
            "prefill": ("a Qwen3.5 prefill", "a Qwen3.5 Text Prefill, Multimodal Prefill or Continue node")}


def linked(value: Any, name: str) -> Any:
    """`value`, the `model` (a ModelHandle) or `prefill` (a ModelPrefill) input of a node; anything else is a
    Qwen35Error that names it: ComfyUI checks a link's type, but an output typed '*' (a switch or reroute node of
    another pack) passes any value, which would otherwise fail as an AttributeError deep in the node."""
    kind = ModelHandle if name == "model" else ModelPrefill
    if not isinstance(value, kind):
        from ..runtime import Qwen35Error
        what, source = _SOURCES[name]
        raise Qwen35Error(f"the {name} input got a {type(value).__name__}, not {what}; connect the {name} output "
                          f"of {source}")
    return value


def running() -> tuple[Optional[str], Optional[str]]:
    """(prompt id, node id) of the node ComfyUI is running; (None, None) outside a ComfyUI run (tests, scripts, a
    ComfyUI without comfy_execution.utils)."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None, None
    context = get_executing_context()
    return (context.prompt_id, context.node_id) if context is not None else (None, None)


def workflow_id(hidden: Any) -> Optional[str]:
    """The id of the workflow whose prompt runs the node, from its hidden extra_pnginfo (io.Hidden.extra_pnginfo:
    ComfyUI's page sends the workflow there, its id with it); None where there is none (a prompt sent to the API
    without it, a node called outside a ComfyUI run: hidden is None there). Node ids are per workflow: two tabs
    each have a node "5"."""
    pnginfo = getattr(hidden, "extra_pnginfo", None)
    workflow = pnginfo.get("workflow") if isinstance(pnginfo, dict) else None
    found = workflow.get("id") if isinstance(workflow, dict) else None
    return str(found) if found else None


# (workflow id, node id) -> (the prompt run that made or used them, that node's live outputs, weakly)
_LATEST: dict[tuple[Optional[str], str], tuple[Optional[str], list]] = {}


def made(node: Optional[str], outputs: list[ModelPrefill], workflow: Optional[str] = None) -> None:
    """Records `outputs` as what node's prefills are now (made by its run, or made again): the outputs of its
    runs in earlier prompts are let go (ModelPrefill). A node is its id in its workflow (workflow_id; the id
    alone where the prompt names no workflow), so that another tab's node of the same id keeps its own. A node
    that runs once per item of a list keeps every item's output of this prompt, and from its second run on each
    of them waits with its states off the GPU: made before any Generate runs, a list's states would otherwise sit
    in VRAM that ComfyUI does not count."""
    if node is None:
        return
    run, key = running()[0], (workflow, node)
    if key not in _LATEST:  # (nodes of every workflow run: those whose outputs are all gone leave the table)
        for gone in [k for k, (_, refs) in _LATEST.items() if all(ref() is None for ref in refs)]:
            del _LATEST[gone]
    was, refs = _LATEST.get(key, (None, []))
    if was != run:
        for ref in refs:
            old = ref()
            if old is not None and all(old is not o for o in outputs):
                old.let_go_now()
        refs = []
    earlier = [o for o in (ref() for ref in refs) if o is not None and all(o is not n for n in outputs)]
    mine = earlier + list(outputs)
    if earlier:
        for i, o in enumerate(mine):
            o.listed(i, len(mine))
    _LATEST[key] = (run, [weakref.ref(o) for o in mine])


def shown_again() -> dict:
    """Schema flags for a node whose panel shows its `ui` (the loader's and the prefills' stats): ComfyUI sends
    a node's `ui` again when its output comes from the cache (a new tab, a reloaded page, another workflow) only
    for output nodes and for nodes with has_intermediate_output, which ComfyUI has had since 2026-03; an older one
    takes the node without it (its panel then stays blank when the output is cached)."""
    fields = getattr(io.Schema, "__dataclass_fields__", {})
    return {"has_intermediate_output": True} if "has_intermediate_output" in fields else {}


@contextmanager
def cancellable(bar: bool = True):
    """Around a prefill or a model load: ComfyUI's Cancel lands between the pieces of a long prompt, the passes of
    the vision tower and the weights of a load (runtime.progress; nothing of the prefill or the model stays), and
    with `bar` the node's progress bar follows the prompt's pieces or the weights read (a node with a bar of its
    own, over a batch, passes False)."""
    from ..runtime import progress
    shown = None

    def hook(stage: str, done: int, total: int) -> None:
        nonlocal shown
        mm.throw_exception_if_processing_interrupted()
        if bar and stage in ("prompt", "load"):
            shown = shown or comfy.utils.ProgressBar(total)
            shown.update_absolute(done, total)
    with progress.reporting(hook):
        yield
