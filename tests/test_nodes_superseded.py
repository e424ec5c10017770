"""A loader node whose settings change loads another model: the one it output before is let go at once (off
ComfyUI's list, its weights read again from the checkpoint only if an old output is used after all), unless another
loader node still outputs it. ComfyUI's RAM-pressure cache would have kept it last of all (this pack's handle counts
as next to nothing there). Nodes run through their V3 `execute` as ComfyUI's executor prepares them (test_nodes_tabs:
in_tab), with ComfyUI importable from COMFYUI_DIR (skipped otherwise), on the CPU with the demo's tiny checkpoint."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import pytest
from test_nodes import _generate, _prefill, comfy, models_dir, pack  # noqa: F401  (fixtures)
from test_nodes_tabs import in_tab

pytestmark = pytest.mark.comfyui


def load(pack, workflow, node_id, prompt_id, budget=0):
    return in_tab(pack.Qwen35ModelLoader, workflow, prompt_id, node_id, model="qwen35-demo", dtype="fp32",
                  device="cpu", backend="torch", keep_loaded=True, cache_budget_mb=budget)[0]


def listed_in_comfyui(comfy, handle) -> bool:
    return any(m.model is handle.managed for m in comfy.mm.current_loaded_models)


def test_a_loader_whose_settings_change_lets_its_former_model_go(pack, models_dir, comfy):
    a = load(pack, "wf-1", "1", "p1")
    text_a = _generate(pack, _prefill(pack, a), sampling=False)[0][0]
    b = load(pack, "wf-1", "1", "p2", budget=256)  # the same node, another cache budget: another model
    assert b.managed is not a.managed
    assert a.model.weights_dropped and not listed_in_comfyui(comfy, a)
    assert not b.model.weights_dropped and listed_in_comfyui(comfy, b)
    assert _generate(pack, _prefill(pack, b), sampling=False)[0][0] == text_a  # (the same weights)
    # an output of the former settings that ComfyUI kept and hands on (the settings changed back, --cache-lru):
    # its weights are read again, and the model of the settings the node has left goes in turn
    assert _generate(pack, _prefill(pack, a), sampling=False)[0][0] == text_a
    assert not a.model.weights_dropped and listed_in_comfyui(comfy, a)
    assert b.model.weights_dropped and not listed_in_comfyui(comfy, b)
    a.release()


def test_a_model_another_loader_node_still_outputs_stays(pack, models_dir, comfy):
    """Two loader nodes of one workflow with the same settings share one model: it goes only once neither
    outputs it; a node of another workflow (tab) with the same id is another node."""
    first, second = load(pack, "wf-2", "1", "p1"), load(pack, "wf-2", "2", "p1")
    other_tab = load(pack, "wf-3", "1", "p1")
    assert first.managed is second.managed is other_tab.managed
    load(pack, "wf-2", "1", "p2", budget=256)
    assert not first.model.weights_dropped and listed_in_comfyui(comfy, first)
    load(pack, "wf-2", "2", "p3", budget=256)
    assert not first.model.weights_dropped  # tab wf-3's node "1" still outputs it
    load(pack, "wf-3", "1", "p4", budget=256)
    assert first.model.weights_dropped and not listed_in_comfyui(comfy, first)
    load(pack, "wf-3", "1", "p5", budget=256).release()


def test_a_prompt_that_names_no_workflow_lets_nothing_go(pack, models_dir, comfy):
    """A prompt sent to the API without its workflow: node ids may be another workflow's, so nothing is let go
    (two such workflows run in turn would read their weights again at every switch)."""
    a = load(pack, None, "1", "p1")
    b = load(pack, None, "1", "p2", budget=256)
    assert not a.model.weights_dropped and not b.model.weights_dropped
    a.release()
    b.release()


def test_a_model_let_go_gives_back_its_k_v_growth_and_keeps_its_prefills(pack, models_dir, comfy):
    """The auto K/V store of a model let go keeps only the blocks prefills ComfyUI may still hold (snapshots past
    them go), and such a prefill still answers as before."""
    a = load(pack, "wf-4", "1", "p1")
    pf = _prefill(pack, a)
    want = _generate(pack, pf, sampling=False)[0][0]
    store = a.model.kv
    store.grow(store.num_blocks * 2)
    load(pack, "wf-4", "1", "p2", budget=256)
    assert a.model.weights_dropped
    assert a.model.kv.num_blocks == max(pf.prefill.cache.seq.blocks) + 1
    assert _generate(pack, pf, sampling=False)[0][0] == want
    a.release()
