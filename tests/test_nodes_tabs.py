"""Workflow tabs: node ids are per workflow, so a prefill node lets go of its earlier output (types.made) only
when the same node of the same workflow runs again, not when another tab's node of that id runs. The nodes run
through their V3 `execute` on a class ComfyUI's executor prepares (its hidden inputs from the prompt's extra
data), with ComfyUI importable from COMFYUI_DIR (skipped otherwise), on the CPU with the demo's tiny checkpoint."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import pytest
import torch
from test_nodes import _prefill, comfy, loaded, models_dir, pack  # noqa: F401  (fixtures)

pytestmark = pytest.mark.comfyui


def in_tab(node, workflow, prompt_id, node_id, **inputs):
    """`node`'s run as ComfyUI's executor makes it, node `node_id` of prompt `prompt_id`: its hidden inputs come
    from the prompt's extra data, where the page puts the workflow it queued (with its id); workflow None: a
    prompt sent to the API without one."""
    import execution
    from comfy_execution.utils import CurrentNodeContext

    extra = {} if workflow is None else {"extra_pnginfo": {"workflow": {"id": workflow, "nodes": [], "links": []}}}
    _, _, v3_data = execution.get_input_data({}, node, node_id, extra_data=extra)
    with CurrentNodeContext(prompt_id, node_id):
        return node.PREPARE_CLASS_CLONE(v3_data).execute(**inputs)


def text(pack, model, workflow, prompt_id, prompt):
    return in_tab(pack.Qwen35TextPrefill, workflow, prompt_id, "5", model=model, prompt=prompt, system_prompt="",
                  thinking=False, use_chat_template=True)[0]


def test_two_tabs_keep_each_others_prefill_and_a_tab_lets_its_own_earlier_one_go(pack, loaded):
    a = text(pack, loaded, "tab-a", "p1", "Name three colours.")
    b = text(pack, loaded, "tab-b", "p2", "Name three animals.")
    assert not a.let_go and not b.let_go  # tab B's node "5" is another node than tab A's
    held = b.prefill
    a_again = text(pack, loaded, "tab-a", "p3", "Name three rivers.")  # tab A's prompt edited: its old one goes
    assert a.let_go and not a_again.let_go and not b.let_go and b.prefill is held
    # prompts that name no workflow (the API, scripts) key the node by its id alone, as before the tabs
    api = text(pack, loaded, None, "p4", "Name three trees.")
    api_again = text(pack, loaded, None, "p5", "Name three birds.")
    assert api.let_go and not api_again.let_go and not a_again.let_go and not b.let_go
    # an output let go and handed on again (the prompt edited back) is made again under its own tab's node:
    # tab A's later run lets it go, tab B's does not
    assert a.prefill.n_tokens == len(a.prefill.token_ids) and not a.let_go
    text(pack, loaded, "tab-b", "p6", "Name three fish.")
    assert not a.let_go and b.let_go
    text(pack, loaded, "tab-a", "p7", "Name three lakes.")
    assert a.let_go


def test_a_node_whose_outputs_are_all_gone_leaves_the_table(pack, loaded):
    """A key per workflow's node: the table of nodes' outputs (types._LATEST) keeps the nodes whose outputs live."""
    import gc

    from qwen35_fast.nodes import types

    kept = text(pack, loaded, "tab-c", "p1", "Name three colours.")
    gone = text(pack, loaded, "tab-d", "p2", "Name three animals.")
    del gone
    gc.collect()
    text(pack, loaded, "tab-e", "p3", "Name three rivers.")
    assert ("tab-c", "5") in types._LATEST and ("tab-e", "5") in types._LATEST
    assert ("tab-d", "5") not in types._LATEST and not kept.let_go


@pytest.mark.parametrize("kind", ["multimodal", "continue"])
def test_the_other_prefill_nodes_key_their_outputs_by_tab_too(pack, loaded, kind):
    parent = _prefill(pack, loaded, "Name three colours.")  # (made outside a ComfyUI run: never let go)
    images = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))

    def run(workflow, prompt_id, prompt):
        if kind == "multimodal":
            return in_tab(pack.Qwen35MultimodalPrefill, workflow, prompt_id, "7", model=loaded, prompt=prompt,
                          images=images, video=None, frames=None, frame_rate=24.0, mode="all images in one prompt",
                          system_prompt="", thinking=False, max_pixels=0)[0][0]
        return in_tab(pack.Qwen35ContinuePrefill, workflow, prompt_id, "7", prefill=parent, prompt=prompt,
                      images=None, previous_answer=None, thinking=False, max_pixels=0)[0]
    a = run("tab-a", "p1", "Describe it.")
    b = run("tab-b", "p2", "Name its colours.")
    assert not a.let_go and not b.let_go
    a_again = run("tab-a", "p3", "Count its corners.")
    assert a.let_go and not b.let_go and not a_again.let_go and not parent.let_go


def test_the_workflow_input_leaves_comfyuis_cache_key_as_it_was(pack, monkeypatch):
    """The prefill nodes take the workflow as a hidden input, which ComfyUI leaves out of a node's cache key (its
    class, inputs and ancestors; its id only where it asks for UNIQUE_ID or is not idempotent): the same prefill
    under two node ids, in two tabs or in one, is still one entry of ComfyUI's cache, as before."""
    import asyncio

    import execution
    from comfy_execution.caching import CacheKeySetInputSignature, include_unique_id_in_input
    from comfy_execution.graph import DynamicPrompt

    names = ["Qwen35ModelLoader", "Qwen35TextPrefill", "Qwen35MultimodalPrefill", "Qwen35ContinuePrefill"]
    for name in names:
        monkeypatch.setitem(execution.nodes.NODE_CLASS_MAPPINGS, name, getattr(pack, name))  # (ComfyUI's nodes.py)
        assert not include_unique_id_in_input(name)
    loader = {"model": "qwen35-demo", "dtype": "fp32", "device": "cpu", "backend": "torch", "keep_loaded": True}
    prefill = {"model": ["1", 0], "prompt": "Hi.", "system_prompt": "", "thinking": False, "use_chat_template": True}
    images = {"model": ["1", 0], "prompt": "Describe it.", "frame_rate": 24.0, "mode": "all images in one prompt",
              "system_prompt": "", "thinking": False, "max_pixels": 0}
    prompt = {"1": {"class_type": "Qwen35ModelLoader", "inputs": loader}}
    prompt["5"] = prompt["15"] = {"class_type": "Qwen35TextPrefill", "inputs": prefill}
    prompt["6"] = {"class_type": "Qwen35ContinuePrefill", "inputs": {"prefill": ["5", 0], "prompt": "And?"}}
    prompt["16"] = {"class_type": "Qwen35ContinuePrefill", "inputs": {"prefill": ["15", 0], "prompt": "And?"}}
    prompt["7"] = prompt["17"] = {"class_type": "Qwen35MultimodalPrefill", "inputs": images}
    dynprompt = DynamicPrompt(prompt)
    keys = CacheKeySetInputSignature(dynprompt, list(prompt), execution.IsChangedCache("p1", dynprompt, None))
    asyncio.run(keys.add_keys(list(prompt)))
    for first, second in (("5", "15"), ("6", "16"), ("7", "17")):
        assert keys.get_data_key(first) == keys.get_data_key(second), prompt[first]["class_type"]
