"""A real ComfyUI, started headless on the CPU (on its GPU with COMFYUI_GPU=1) with this pack installed under
an odd folder name.

Needs COMFYUI_DIR (a ComfyUI checkout, outside this repository); every test here is marked
`comfyui` and skipped without it. ComfyUI runs on COMFYUI_PYTHON (default: this Python), which must
have ComfyUI's requirements and this pack's. Its base directory is a temporary folder: the pack is
symlinked into custom_nodes/, the test checkpoint into models/LLM/qwen35-demo/. COMFYUI_ARGS adds
arguments to ComfyUI's command line (e.g. `--front-end-root DIR` where the frontend package is not
installed: the tests use the HTTP API, the browser test needs the real frontend).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from comfyui_harness import (
    DEMO_MODEL,
    ON_GPU,
    OTHER_TEXT_ENCODER,
    PACK_FOLDER,
    ROOT,
    ComfyServer,
    checkpoint_for_tests,
    free_port,
)

START_TIMEOUT_S = 300
DEVICE_ARGS = ([] if ON_GPU else ["--cpu"]) + shlex.split(os.environ.get("COMFYUI_ARGS", ""))


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    comfy_dir = Path(os.environ["COMFYUI_DIR"]).resolve()
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    base = tmp_path_factory.mktemp("comfy-base")
    for d in ("custom_nodes", "models/LLM", "user", "input", "output", "temp"):
        (base / d).mkdir(parents=True, exist_ok=True)
    if (comfy_dir / "input" / "example.png").exists():  # the image the captioning workflows load
        shutil.copy(comfy_dir / "input" / "example.png", base / "input" / "example.png")
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(ROOT, target_is_directory=True)
    _other_models(base / "models")
    (base / "models" / "LLM" / DEMO_MODEL).symlink_to(checkpoint_for_tests(), target_is_directory=True)
    port = free_port()
    log = base / "comfyui.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [python, "main.py", *DEVICE_ARGS, "--listen", "127.0.0.1", "--port", str(port), "--base-directory",
             str(base), "--disable-auto-launch", "--verbose", "INFO"],
            cwd=comfy_dir, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ComfyServer(f"http://127.0.0.1:{port}", log, base)
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                server.get("/object_info/Qwen35Generate")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > end:
                    raise RuntimeError(f"ComfyUI did not answer in {START_TIMEOUT_S} s:\n{server.log_tail()}")
                time.sleep(1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def object_info(comfy_server):
    return comfy_server.get("/object_info")




def _other_models(models: Path) -> None:
    """What a real models folder also holds: another text encoder (Qwen3-style key names, tiny shapes)
    and an entry the listing cannot read (a symbolic link to itself, as a broken mount might leave).
    Neither may reach the loader's list, and neither may take the loader node off /object_info."""
    import torch
    from safetensors.torch import save_file

    enc = models / "text_encoders"
    enc.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
               "model.layers.0.self_attn.q_norm.weight": torch.zeros(8),
               "model.norm.weight": torch.zeros(8)}, str(enc / OTHER_TEXT_ENCODER))
    (models / "LLM" / "loop").symlink_to(models / "LLM" / "loop")
