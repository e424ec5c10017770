"""Talking to a ComfyUI server from the tests, and turning UI-format workflows into API prompts."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "example_workflows"
DEMO_MODEL = "qwen35-demo"
# ComfyUI-Manager names the folder as it likes; relative imports must not care. (No space: ComfyUI
# 0.29 lists web files under a folder with a space but answers 404 for them, for every pack.)
PACK_FOLDER = "Qwen3.5-Fast.odd_name"
ON_GPU = os.environ.get("COMFYUI_GPU") == "1"  # the server on its GPU (the H200 run), else with --cpu
OTHER_TEXT_ENCODER = "qwen3_4b_like.safetensors"  # a non-Qwen3.5 file the tests put in models/text_encoders


def checkpoint_for_tests() -> Path:
    """QWEN35_TEST_CHECKPOINT (a checkpoint folder) when set, else the demo's tiny random checkpoint."""
    if os.environ.get("QWEN35_TEST_CHECKPOINT"):
        return Path(os.environ["QWEN35_TEST_CHECKPOINT"])
    from qwen35_fast.runtime import demo_checkpoint
    return Path(demo_checkpoint())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, url: str, log: Path, base: Path):
        self.url, self.log, self.base = url, log, base

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.load(r)

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} -> {e.code}: {e.read().decode()[:2000]}") from None
        return json.loads(raw) if raw else None

    def queue(self, prompt: dict, client_id: str = "qwen35-tests") -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": client_id})["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        """The /history entry of a finished prompt."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry["status"].get("status_str") in ("success", "error"):
                return entry
            time.sleep(0.25)
        raise AssertionError(f"prompt {prompt_id} did not finish in {timeout} s; log tail:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def ws_url(self, client_id: str) -> str:
        return self.url.replace("http", "ws", 1) + f"/ws?clientId={client_id}"


# --- UI-format workflow (what the front end saves) -> API-format prompt (what /prompt takes) ---
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _is_widget(spec) -> bool:
    kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not opts.get("forceInput")


def to_api(workflow: dict, object_info: dict) -> dict:
    """Widget values are matched to inputs in the node definition's order, as the front end does;
    a seed's "control after generate" setting takes a slot of its own."""
    links = {link[0]: (str(link[1]), link[2]) for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node.get("mode", 0) != 0:
            continue
        info = object_info[node["type"]]
        specs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
        order = info["input_order"].get("required", []) + info["input_order"].get("optional", [])
        values = list(node.get("widgets_values") or [])
        inputs, i = {}, 0
        for name in order:
            spec = specs[name]
            if _is_widget(spec) and i < len(values):
                inputs[name] = values[i]
                i += 1
                if len(spec) > 1 and spec[1].get("control_after_generate"):
                    i += 1
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                inputs[slot["name"]] = list(links[slot["link"]])
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                   "_meta": {"title": node.get("title", info["display_name"])}}
    return prompt


def runnable_part(prompt: dict, object_info: dict) -> dict:
    """Drops nodes that name a model file this ComfyUI lacks (an image checkpoint in the enhancer
    workflow), and everything downstream of them."""
    def missing(node):
        specs = {**object_info[node["class_type"]]["input"].get("required", {}),
                 **object_info[node["class_type"]]["input"].get("optional", {})}
        return any(isinstance(specs[k][0], list) and not isinstance(v, list) and v not in specs[k][0]
                   for k, v in node["inputs"].items() if k in specs)

    dropped = {nid for nid, node in prompt.items() if missing(node)}
    changed = True
    while changed:
        changed = False
        for nid, node in prompt.items():
            if nid not in dropped and any(isinstance(v, list) and v[0] in dropped for v in node["inputs"].values()):
                dropped.add(nid)
                changed = True
    return {nid: node for nid, node in prompt.items() if nid not in dropped}


def load_workflow(name: str) -> dict:
    return json.loads((WORKFLOWS / name).read_text())


def pack_nodes(prompt: dict, class_type: str) -> list[str]:
    return [nid for nid, node in prompt.items() if node["class_type"] == class_type]


def for_tests(prompt: dict, max_new_tokens: int = 16, keep_loaded: bool | None = None) -> dict:
    """The demo checkpoint in every loader, and short answers (the tiny model writes noise anyway)."""
    for node in prompt.values():
        if node["class_type"] == "Qwen35ModelLoader":
            node["inputs"]["model"] = DEMO_MODEL
            if keep_loaded is not None:
                node["inputs"]["keep_loaded"] = keep_loaded
        if node["class_type"] == "Qwen35Generate":
            node["inputs"]["max_new_tokens"] = max_new_tokens
    return prompt


def simple_prompt(text="Name three colours.", max_new_tokens=8, seed=0, keep_loaded=True, thinking=False,
                  sampling=True) -> dict:
    return {
        "1": {"class_type": "Qwen35ModelLoader", "inputs": {
            "model": DEMO_MODEL, "dtype": "auto", "device": "auto", "backend": "auto", "keep_loaded": keep_loaded}},
        "2": {"class_type": "Qwen35TextPrefill", "inputs": {
            "model": ["1", 0], "prompt": text, "system_prompt": "", "thinking": thinking,
            "use_chat_template": True, "allow_special_tokens": False}},
        "3": {"class_type": "Qwen35Generate", "inputs": {
            "prefill": ["2", 0], "max_new_tokens": max_new_tokens, "sampling": sampling, "temperature": 0.9,
            "top_k": 50, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "seed": seed}},
    }


async def collect_ws(server: ComfyServer, client_id: str, until, timeout: float = 300, on_message=None):
    """Websocket messages (dicts) from ComfyUI for `client_id` until `until(msg)` is true."""
    import aiohttp
    messages = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(server.ws_url(client_id)) as ws:
            if on_message is not None:
                await on_message(None, messages)  # connected: the caller may queue now
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                msg = await ws.receive(timeout=max(0.1, end - time.monotonic()))
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                messages.append(data)
                if on_message is not None:
                    await on_message(data, messages)
                if until(data):
                    return messages
    raise AssertionError(f"websocket: condition not met in {timeout} s; last: {messages[-5:]}")


def run_ws(coro):
    return asyncio.run(coro)
