"""The example workflows against the node list of the real ComfyUI in COMFYUI_DIR (skipped otherwise): every node
they use is one ComfyUI (its core and comfy_extras nodes) or this pack defines today, and every link goes into an
input that node has. Running them is tests/integration's (test_example_workflow_runs_and_history_holds_the_text)."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import asyncio
import importlib
import json
from pathlib import Path

import pytest
from test_nodes import comfy, pack  # noqa: F401  (fixtures)

pytestmark = pytest.mark.comfyui

WORKFLOWS = Path(__file__).resolve().parents[1] / "example_workflows"


@pytest.fixture(scope="module")
def node_classes(comfy, pack):
    """Node type -> class, as a ComfyUI server that has loaded this pack knows them."""
    comfy_nodes = importlib.import_module("nodes")  # ComfyUI's nodes.py (COMFYUI_DIR is first on sys.path)
    asyncio.run(comfy_nodes.init_builtin_extra_nodes())  # (what fails to import there is logged, not raised)
    return {**comfy_nodes.NODE_CLASS_MAPPINGS, **{n.GET_SCHEMA().node_id: n for n in pack.NODES}}


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.json")), ids=lambda p: p.name)
def test_an_example_workflow_uses_current_nodes_and_their_inputs(node_classes, path):
    """None of its nodes is one ComfyUI marks deprecated (its page flags such a node and offers what replaced it:
    Batch Images, BatchImagesNode, for ImageBatch), and each link goes into an input of its node as ComfyUI reads
    the node's inputs for that link (a V3 node's dynamic inputs, as Batch Images' images.image0, image1, ...)."""
    from comfy_api.latest import _io
    from comfy_execution.graph import get_input_info

    for node in json.loads(path.read_text(encoding="utf-8"))["nodes"]:
        cls = node_classes.get(node["type"])
        assert cls is not None, f"node {node['id']}: ComfyUI has no node {node['type']!r}"
        assert not getattr(cls, "DEPRECATED", False), f"node {node['id']}: {node['type']} is deprecated in ComfyUI"
        linked = {slot["name"]: slot for slot in node.get("inputs", []) if slot.get("link") is not None}
        inputs = cls.INPUT_TYPES()
        if hasattr(cls, "GET_SCHEMA"):  # a V3 node: its inputs as ComfyUI expands them for these links
            inputs = _io.get_finalized_class_inputs(inputs, {name: ["0", 0] for name in linked})[0]
        for name, slot in linked.items():
            kind = get_input_info(cls, name, inputs)[0]
            assert kind is not None, f"node {node['id']} ({node['type']}) has no input {name!r}"
            assert "*" in (kind, slot["type"]) or kind == slot["type"], (node["id"], name, kind, slot["type"])
