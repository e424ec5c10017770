"""The loaded Qwen3.5 model as ComfyUI's model management sees it.

ComfyUI frees VRAM by asking each entry of `comfy.model_management.current_loaded_models` to
unload (on "Unload models", POST /free, or when another model needs room). Those entries hold
ModelPatcher objects; `ManagedModel` answers the same questions for one runtime model, so ours goes
when ComfyUI needs the memory and comes back on the next run. It moves the whole model: the
runtime has no per-layer offload, so a partial unload frees everything.

Unloaded to system RAM, the weights would be anonymous memory that ComfyUI's RAM-pressure cache does not
see (it counts CPU tensors and ModelPatchers in node outputs, and this handle is neither). So where moving
them would leave less free RAM than ComfyUI keeps free, they are let go instead and read again from the
checkpoint on the next run; the K/V store and the prefills' states (small beside them) still move to RAM.

A loader node whose settings change loads another model, and ComfyUI's cache may keep the old one's output: its
RAM-pressure cache drops its own superseded models first, but counts this pack's handle as next to nothing, so it
would drop it last. So each loader node's model is recorded (`outputs_now`), and the one it output before is let
go as soon as no loader node outputs it any more (`ManagedModel.let_go`).
"""
from __future__ import annotations

import logging
import uuid
import weakref
from contextlib import contextmanager

import comfy.model_management as mm
import torch

log = logging.getLogger(__name__)


def ram_short_by(nbytes: int) -> int:
    """How many bytes short of the free RAM ComfyUI keeps (its RAM cache's headroom; without one, 10% of the
    RAM, 2 to 10 GiB, as its default) the system would be after `nbytes` more were taken (<= 0: not short; 0
    when psutil cannot say)."""
    try:
        import psutil
        vm = psutil.virtual_memory()
    except Exception:  # noqa: BLE001 - no psutil, or no answer from it: keep the weights as before
        return 0
    try:
        from comfy.memory_management import RAM_CACHE_HEADROOM as headroom  # set while a prompt runs
    except ImportError:  # a ComfyUI before the RAM-pressure cache
        headroom = 0
    keep = int(headroom or min(10 << 30, max(2 << 30, vm.total // 10)))
    return keep - (int(vm.available) - int(nbytes))


class ManagedModel:
    """A runtime `Model` plus where it runs and where it waits, in ModelPatcher's terms."""

    parent = None  # no clone chain: one handle per loaded model
    device_note = ""  # why the model runs on the cpu and not on the device asked for, when it does

    def __init__(self, model, load_device: torch.device, offload_device: torch.device):
        self.model = model
        self.load_device = torch.device(load_device)
        self.offload_device = torch.device(offload_device)
        self.clone_base_uuid = uuid.uuid4()
        self._prefill_caches = weakref.WeakSet()  # states of the prefills ComfyUI still caches

    def __repr__(self):
        return (f"ManagedModel({self.model.path}, on {self.current_loaded_device()}, "
                f"load {self.load_device}, offload {self.offload_device})")

    # --- what model management asks ---
    def model_size(self) -> int:
        return self.model.size_bytes()

    def current_loaded_device(self) -> torch.device:
        """Where the weights are, named as ComfyUI named the load or offload device when it is that one:
        ComfyUI compares devices with ==, and a model on "mps:0" is on its "mps"."""
        if self.model.weights_dropped:  # let go on an unload: as unloaded as the offload device
            return self.offload_device
        here = torch.device(self.model.device)
        return next((d for d in (self.load_device, self.offload_device) if _same(here, d)), here)

    def loaded_size(self) -> int:
        return self.model_size() if self._on(self.load_device) else 0

    def model_dtype(self):
        return self.model.dtype

    def partially_load(self, device, extra_memory=0, force_patch_weights=False) -> int:
        """Moves the model to `device`; returns the bytes that moved there. Weights let go come back read again,
        also where they were let go on `device` itself (a cpu model: let_go)."""
        if self._on(device) and not self.model.weights_dropped:
            return 0
        if self.model.weights_dropped:
            from .types import cancellable  # (types.py imports this module)
            log.info("Qwen3.5: reading %s onto %s again (%.0f MiB)", self.model.path, device,
                     self.model_size() / 2**20)
            with cancellable():  # a progress bar over the weights read, and Cancel between them (none stay)
                self.model.reload_weights(torch.device(device))
        else:
            log.info("Qwen3.5: moving %s to %s (%.0f MiB)", self.model.path, device, self.model_size() / 2**20)
            try:
                self.model.to(torch.device(device))
            except BaseException:  # out of memory part-way: all of it back where it waited, so that it counts as
                try:  # unloaded (not half on the GPU, where nothing would free it)
                    self.model.to(self.offload_device)
                except Exception as e:  # noqa: BLE001 - the first error is the one to report
                    log.warning("Qwen3.5: could not move %s back to %s after a failed load: %s", self.model.path,
                                self.offload_device, e)
                raise
        return self.model_size()

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        """Frees all of it: the runtime keeps a model on one device."""
        if not self._on(self.load_device) or self._on(device_to):
            return 0
        self.detach()
        return self.model_size()

    def detach(self, unpatch_all=True):
        """Unloads: the weights go to the offload device (a no-op when both are the CPU). unpatch_all off is
        ComfyUI taking the entry off its list to put it back (load_models_gpu does so for a model it is asked to
        load again): as for its own models, the weights stay where they are."""
        if not unpatch_all:
            return
        log.info("Qwen3.5: unloading %s from %s to %s", self.model.path, self.current_loaded_device(),
                 self.offload_device)
        if not self._on(self.offload_device):
            weights = self.model.weight_bytes()
            short = self.offload_device.type == "cpu" and ram_short_by(weights + self.model.kv_bytes())
            drop = short > 0 and getattr(self.model, "checkpoint", None) is not None
            if drop:
                log.info("Qwen3.5: letting the weights of %s go (%.0f MiB) instead of moving them to RAM, which "
                         "would leave %.0f MiB less free than ComfyUI keeps free; they are read again from the "
                         "checkpoint on the next run", self.model.path, weights / 2**20, short / 2**20)
            self._offload(drop)

    def _offload(self, drop: bool) -> None:
        """The weights to the offload device, or let go (drop: read again from the checkpoint on the next load);
        the K/V store and the prefills' states to the offload device (generate copies them back)."""
        left = self.current_loaded_device()
        if drop:
            self.model.drop_weights(self.offload_device)
        else:
            self.model.to(self.offload_device)
        for cache in list(self._prefill_caches):
            cache.to(self.offload_device)
        if left.type == "cuda":
            from ..runtime import free_gpu_workspaces
            free_gpu_workspaces()  # the matmul workspaces our runs left behind (32 MiB per stream)

    def model_patches_to(self, device_or_dtype):
        pass

    def model_patches_models(self):
        return []

    def get_nested_additional_models(self):
        return []

    def lowvram_patch_counter(self) -> int:
        return 0

    def is_dynamic(self) -> bool:
        return False

    def is_clone(self, other) -> bool:
        return other is self or getattr(other, "model", None) is self.model

    # --- what the nodes call ---
    def track(self, prefill) -> None:
        """Park this prefill's state with the weights whenever the model is unloaded."""
        self._prefill_caches.add(prefill.cache)
        if getattr(prefill, "turn", None) is not None:  # the state a follow-up turn restarts from
            self._prefill_caches.add(prefill.turn)

    def park(self, prefill) -> None:
        """Moves this prefill's GDN states to the offload device now (where it is not the load device): a list of
        prefills, made before any Generate runs, would otherwise hold their states in VRAM that ComfyUI does not
        count (~100 MiB a prefill on the 9B: its end and its turn's end); generate and continue_prefill copy
        them back to the model's device."""
        if _same(self.load_device, self.offload_device):
            return
        prefill.cache.to(self.offload_device)
        if getattr(prefill, "turn", None) is not None:
            prefill.turn.to(self.offload_device)

    def load(self, memory_required: int = 0):
        """Brings the weights to the load device, freeing other models' VRAM first so that the weights and
        `memory_required` more bytes (a run's estimate: runtime.memory) fit, as ComfyUI's own nodes ask."""
        mm.load_models_gpu([self], memory_required=int(memory_required))
        if self.model.weights_dropped:  # let go where they run (a cpu model, let_go), which ComfyUI took as loaded
            self.partially_load(self.load_device)

    def release(self):
        """Gives the VRAM back now (keep_loaded off): off ComfyUI's list and onto the offload device."""
        listed = [i for i, loaded in enumerate(mm.current_loaded_models) if loaded.model is self]
        for i in reversed(listed):
            mm.current_loaded_models.pop(i).model_unload()  # detaches
        if not listed:
            self.detach()
        mm.soft_empty_cache()

    def let_go(self):
        """No loader node outputs this model any more (each that did loads another now), though ComfyUI's cache
        may still hand an old output on: off ComfyUI's list and out of VRAM, its weights let go where the offload
        device is the CPU (not moved to RAM; read again from the checkpoint if an old output is used after all),
        the K/V store and the prefills' states moved to the CPU."""
        model = self.model
        if (self.offload_device.type == "cpu" and getattr(model, "checkpoint", None) is not None
                and not model.weights_dropped):
            log.info("Qwen3.5: letting %s go (%.0f MiB of weights): its loader node loads another model now",
                     model.path, model.weight_bytes() / 2**20)
            if model.kv_bytes():  # an auto store keeps only the blocks live prefills hold (snapshots past them go)
                model.kv.shrink_to(1)
            self._offload(drop=True)
        self.release()  # off ComfyUI's list (and onto the offload device where it was not let go)

    def _on(self, device) -> bool:
        return _same(self.current_loaded_device(), torch.device(device))


# each loader node's model: (workflow id, node id) -> the ManagedModel its output holds, weakly (a node is its id
# in its workflow, as for the prefills: types.made)
_NODE_MODELS: dict[tuple, weakref.ref] = {}


def outputs_now(node: tuple | None, managed: ManagedModel | None) -> None:
    """Records `managed` as the model loader node `node` outputs now (its run, or a use of one of its outputs that
    ComfyUI kept; None: none, as before a load), and lets go of the model it output before where no other loader
    node outputs that one (ManagedModel.let_go). node None: outside a ComfyUI run, not recorded."""
    if node is None:
        return
    for gone in [k for k, ref in _NODE_MODELS.items() if ref() is None]:
        del _NODE_MODELS[gone]
    ref = _NODE_MODELS.pop(node, None)
    before = ref() if ref is not None else None
    if managed is not None:
        _NODE_MODELS[node] = weakref.ref(managed)
    if before is not None and before is not managed and all(r() is not before for r in _NODE_MODELS.values()):
        before.let_go()


class ModelHandle:
    """What one loader node outputs: the ManagedModel it loaded or shares (one per model in memory: ComfyUI's
    model management holds that one) and this node's keep_loaded. ComfyUI's caches can hand a later run the
    output of an earlier one (--cache-lru keeps many): the keep_loaded the node showed then comes with it, not
    the one another run of a loader of the same model set last. node: (workflow id, node id) of that loader
    (outputs_now), None outside a ComfyUI run."""

    def __init__(self, managed: ManagedModel, keep_loaded: bool, node: tuple | None = None):
        self.managed = managed
        self.keep_loaded = bool(keep_loaded)
        self.node = node

    def __repr__(self):
        return f"ModelHandle({self.managed!r}, keep_loaded={self.keep_loaded})"

    @property
    def model(self):
        """The runtime model."""
        return self.managed.model

    def load(self, memory_required: int = 0):
        outputs_now(self.node, self.managed)  # an output ComfyUI kept, used again: its node's model again
        self.managed.load(memory_required)

    def track(self, prefill) -> None:
        self.managed.track(prefill)

    def park(self, prefill) -> None:
        self.managed.park(prefill)

    def release(self):
        self.managed.release()

    @contextmanager
    def released_on_error(self):
        """A node's work on this model: with keep_loaded off, an error (out of memory, a bad prompt, a cancel)
        gives the VRAM back as a finished Generate does, rather than leaving the weights there."""
        try:
            yield
        except BaseException:
            if not self.keep_loaded:
                self.release()
            raise


def _same(here: torch.device, there: torch.device) -> bool:
    """Whether a tensor on `here` is on `there` (a device without an index: its type's current one)."""
    return here.type == there.type and (there.index is None or here.index in (None, there.index))
