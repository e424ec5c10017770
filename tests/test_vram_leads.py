"""Memory that outlived its use: a loader node's model after the node loads another one (its settings changed;
ComfyUI's cache can keep the old output, and its RAM-pressure cache drops it last), and a prefill's estimate
made while the model waits off the device it runs on. The node tests run with ComfyUI importable from
COMFYUI_DIR (skipped otherwise), on the CPU with the demo's tiny checkpoint."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import pytest
import torch
from test_nodes import _generate, _prefill, comfy, models_dir, pack  # noqa: F401  (fixtures)
from test_nodes_tabs import in_tab

SETTINGS = {"model": "qwen35-demo", "dtype": "fp32", "device": "cpu", "backend": "torch", "keep_loaded": True}


def load(pack, workflow, prompt_id, node_id, **changed):
    """The loader's output as node `node_id` of `workflow` makes it in prompt `prompt_id`."""
    return in_tab(pack.Qwen35ModelLoader, workflow, prompt_id, node_id, **{**SETTINGS, **changed})[0]


def listed(comfy, managed) -> bool:
    return any(entry.model is managed for entry in comfy.mm.current_loaded_models)


def answer(pack, handle) -> str:
    return _generate(pack, _prefill(pack, handle), sampling=False)[0][0]


@pytest.mark.comfyui
def test_a_model_let_go_holds_no_weights_and_unload_and_later_runs_still_work(pack, models_dir, comfy):
    """(Beside test_nodes_superseded.) The weights of a model its loader node left are nowhere (not moved to RAM);
    ComfyUI's "Unload models" after that, and runs of both outputs, still work and answer the same. A loader run
    outside a ComfyUI prompt (a script) is no node: it lets nothing go."""
    first = load(pack, "wf", "p1", "1")
    text = answer(pack, first)
    old = first.managed
    second = load(pack, "wf", "p2", "1", cache_budget_mb=1)
    assert second.managed is not old and not listed(comfy, old)
    assert all(p.is_meta for p in old.model.parameters())
    comfy.mm.unload_all_models()
    assert answer(pack, second) == text and old.model.weights_dropped
    assert answer(pack, first) == text and second.managed.model.weights_dropped  # the node's model in turn
    direct = pack.Qwen35ModelLoader.execute(**SETTINGS, cache_budget_mb=3)[0]
    pack.Qwen35ModelLoader.execute(**SETTINGS, cache_budget_mb=4)[0].release()
    assert not direct.managed.model.weights_dropped
    for handle in (first, second, direct):
        handle.release()


def test_a_prefill_asks_for_the_device_the_model_runs_on_not_where_its_weights_wait(monkeypatch):
    """A model loaded on a GPU and unloaded waits on the cpu with its backend picked for the GPU: the estimate
    a node asks ComfyUI to make room for before moving it back is the GPU's (the PyTorch GDN path walks longer
    segments there; the vision tower runs its bucket graphs there), not the cpu's."""
    from qwen35_fast.kernels.gdn_prefill.reference import GPU_SEGMENT, SEGMENT, segment_bytes
    from qwen35_fast.runtime import demo_checkpoint, load_model, memory

    model = load_model(demo_checkpoint(), dtype="fp32", device="cpu", backend="torch")
    c = model.config
    grids = [(1, 8, 8)]  # 64 patches: a bucket graph of 128 on a GPU
    text, images = memory.prefill_bytes(model, 100), memory.vision_bytes(model, grids)
    assert memory.run_device(model) == torch.device("cpu")
    monkeypatch.setattr(model, "_backend_device", torch.device("cuda", 0))  # picked there, before the unload
    assert model.device == torch.device("cpu") and memory.run_device(model) == torch.device("cuda", 0)
    segment = lambda n: segment_bytes(c.linear_num_value_heads, c.linear_key_head_dim,  # noqa: E731
                                      c.linear_value_head_dim, n)
    assert memory.prefill_bytes(model, 100) - text == segment(GPU_SEGMENT) - segment(SEGMENT) > 0
    assert memory.vision_bytes(model, grids) > images
