"""The nodes run through their V3 `execute`, with ComfyUI importable from COMFYUI_DIR (skipped otherwise).

Runs in-process on the CPU with the demo's tiny checkpoint: what a ComfyUI run does to the nodes
(model management, progress bar, cancel, streamed text), without a server.
"""
import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui


def checkpoint_for_tests() -> Path:
    """QWEN35_TEST_CHECKPOINT (a checkpoint folder) when set, else the demo's tiny random checkpoint."""
    if os.environ.get("QWEN35_TEST_CHECKPOINT"):
        return Path(os.environ["QWEN35_TEST_CHECKPOINT"])
    from qwen35_fast.runtime import demo_checkpoint
    return Path(demo_checkpoint())


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI's modules, imported as its main.py would with --cpu (this machine may have no GPU)."""
    root = os.environ["COMFYUI_DIR"]
    if root not in sys.path:
        sys.path.insert(0, root)
    import comfy.cli_args
    import torch
    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    import comfy.model_management as mm
    import comfy.utils
    import folder_paths
    return type("Comfy", (), {"mm": mm, "utils": comfy.utils, "folder_paths": folder_paths})


@pytest.fixture(scope="module")
def pack(comfy):
    from qwen35_fast import nodes
    return nodes


@pytest.fixture(scope="module")
def models_dir(comfy, tmp_path_factory):
    """models/LLM with the demo checkpoint folder, models/text_encoders with its single-file form."""
    demo = checkpoint_for_tests()
    root = tmp_path_factory.mktemp("models")
    (root / "LLM").mkdir()
    (root / "text_encoders").mkdir()
    shutil.copytree(demo, root / "LLM" / "qwen35-demo")
    weights = sorted(demo.glob("*.safetensors"))
    if len(weights) == 1:
        shutil.copy(weights[0], root / "text_encoders" / "qwen35_demo_single.safetensors")
    fp = comfy.folder_paths
    fp.models_dir = str(root)  # models/LLM is root/LLM (the loader adds models/LLM to the folders it lists)
    fp.folder_names_and_paths.pop("LLM", None)
    fp.add_model_folder_path("LLM", str(root / "LLM"))
    fp.add_model_folder_path("text_encoders", str(root / "text_encoders"), is_default=True)
    fp.filename_list_cache.clear()
    return root


@pytest.fixture
def loaded(pack, models_dir, comfy):
    out = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                         keep_loaded=True)
    yield out[0]
    out[0].release()


@pytest.fixture
def memory_asked(comfy, monkeypatch):
    """The memory_required of every load_models_gpu call during the test (ComfyUI's own function still runs)."""
    asked = []
    real = comfy.mm.load_models_gpu

    def load_models_gpu(models, memory_required=0, **kw):
        asked.append(memory_required)
        return real(models, memory_required=memory_required, **kw)

    monkeypatch.setattr(comfy.mm, "load_models_gpu", load_models_gpu)
    return asked


def _prefill(pack, model, prompt="Name three colours.", thinking=False):
    return pack.Qwen35TextPrefill.execute(model=model, prompt=prompt, system_prompt="", thinking=thinking,
                                          use_chat_template=True)[0]


def listed(node, **inputs):
    """Runs a node that takes its inputs as lists (Generate: is_input_list) as ComfyUI calls it: a value from a
    widget or from a node that outputs one item comes as a list of one."""
    return node.execute(**{k: v if isinstance(v, list) else [v] for k, v in inputs.items()})


def _generate(pack, pf, seed=0, max_new_tokens=12, sampling=True):
    """Generate's output for one prefill: out[0] / out[1] are the lists of texts / thinking (one item each)."""
    return listed(pack.Qwen35Generate, prefill=pf, max_new_tokens=max_new_tokens, sampling=sampling,
                  temperature=0.9, top_k=50, top_p=0.95, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                  seed=seed)


def interrupt_at(comfy, monkeypatch, n) -> dict:
    """ComfyUI's interrupt set at the n-th check for it (counted from here; the real check then raises); returns
    the counter of checks."""
    checks = {"n": 0}
    real = comfy.mm.throw_exception_if_processing_interrupted

    def check():
        checks["n"] += 1
        if checks["n"] == n:
            comfy.mm.interrupt_current_processing(True)
        real()
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", check)
    return checks


def test_schemas_validate_and_list_models(pack, models_dir):
    for node in pack.NODES:
        node.GET_SCHEMA()  # what ComfyUI does when it registers the node
    inputs = pack.Qwen35ModelLoader.INPUT_TYPES()["required"]
    options = inputs["model"][1]["options"]
    assert "qwen35-demo" in options
    assert set(inputs) == {"model", "dtype", "device", "backend", "keep_loaded"}
    gen = pack.Qwen35Generate.INPUT_TYPES()["required"]
    assert set(gen) == {"prefill", "max_new_tokens", "sampling", "temperature", "top_k", "top_p", "min_p",
                        "repetition_penalty", "presence_penalty", "seed"}
    assert pack.Qwen35Generate.GET_SCHEMA().is_output_node
    # the panels of the loader and the prefills show again when ComfyUI takes their output from its cache
    for node in (pack.Qwen35ModelLoader, pack.Qwen35TextPrefill, pack.Qwen35MultimodalPrefill,
                 pack.Qwen35ContinuePrefill):
        schema = node.GET_SCHEMA()
        assert schema.has_intermediate_output and not schema.is_output_node, node


def test_llm_folder_created_and_registered_when_absent(pack, comfy, monkeypatch, tmp_path):
    fp = comfy.folder_paths
    monkeypatch.setattr(fp, "folder_names_and_paths", {k: v for k, v in fp.folder_names_and_paths.items()
                                                       if k != "LLM"})
    monkeypatch.setattr(fp, "models_dir", str(tmp_path / "models"))
    pack.models_folder.ensure_llm_folder()
    assert fp.get_folder_paths("LLM") == [str(tmp_path / "models" / "LLM")] and (tmp_path / "models" / "LLM").is_dir()


def test_single_file_in_text_encoders_loads(pack, models_dir):
    if not (models_dir / "text_encoders" / "qwen35_demo_single.safetensors").exists():
        pytest.skip("the demo checkpoint has more than one weight file")
    assert "qwen35_demo_single.safetensors" in pack.models_folder.available_models()
    out = pack.Qwen35ModelLoader.execute(model="qwen35_demo_single.safetensors", dtype="fp32", device="cpu",
                                         backend="torch", keep_loaded=False)
    out[0].release()
    assert out.ui["qwen35_model"][0]["backend"] == "torch"


def test_the_loader_keeps_the_weights_in_8_bits_when_asked_or_when_they_do_not_fit(pack, models_dir, comfy,
                                                                                    monkeypatch):
    from qwen35_fast.runtime import Qwen35Error
    from qwen35_fast.runtime import loader as runtime_loader

    def load(weights):
        out = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                             keep_loaded=True, weights=weights)
        return out[0], out.ui["qwen35_model"][0]

    int8, info = load("int8")
    assert int8.model.int8 and info["weights"] == "int8"
    assert _generate(pack, _prefill(pack, int8), max_new_tokens=3).ui["qwen35_generate"][0]["n_tokens"] >= 1
    full, full_info = load("full")
    assert full.model is not int8.model and not full.model.int8 and full_info["weights"] == "full"
    assert info["size_mb"] < full_info["size_mb"]
    monkeypatch.setattr(runtime_loader, "free_bytes", lambda device: (1 << 20, 1 << 34))  # no room for full weights
    auto, auto_info = load("auto")
    assert auto.model.int8 and auto_info["weights"] == "int8"
    with pytest.raises(Qwen35Error, match="weights 'fp8' is not one of auto, full, int8"):
        load("fp8")
    for m in (int8, full, auto):
        m.release()


def test_loader_reports_backend_and_registers_with_model_management(loaded, comfy):
    assert any(m.model is loaded.managed for m in comfy.mm.current_loaded_models)
    assert loaded.model.backend.name == "torch"


def test_prefill_generate_text_ui_and_determinism(pack, loaded):
    pf = _prefill(pack, loaded)
    ids_before, logits_before = pf.prefill.token_ids, pf.prefill.logits.clone()
    a = _generate(pack, pf, seed=5)
    b = _generate(pack, pf, seed=5)
    assert len(a[0]) == len(a[1]) == 1 and isinstance(a[0][0], str) and isinstance(a[1][0], str)
    assert a[0] == b[0], "same prefill and seed must give the same text"
    assert a.ui["text"] == a[0] and a.ui["thinking"] == a[1]
    stats = a.ui["qwen35_generate"][0]
    assert stats["n_tokens"] >= 1 and stats["finish_reason"] in ("stop", "length")
    assert pf.prefill.token_ids == ids_before and (pf.prefill.logits == logits_before).all()


def test_prefill_ui_stats(pack, loaded):
    out = pack.Qwen35TextPrefill.execute(model=loaded, prompt="Hello", system_prompt="Be brief.", thinking=True,
                                         use_chat_template=True)
    s = out.ui["qwen35_prefill"][0]
    assert s["n_tokens"] > 1 and s["ms"] > 0 and s["tokens_per_s"] > 0 and s["backend"] == "torch"
    assert s["thinking"] is True


def test_progress_bar_and_stream_per_token(pack, loaded, comfy, monkeypatch):
    progress, events = [], []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, t, preview, node_id=None: progress.append((v, t)))
    monkeypatch.setattr(pack.text, "_send", lambda event, data: events.append((event, data)))
    out = _generate(pack, _prefill(pack, loaded), max_new_tokens=10)
    n = out.ui["qwen35_generate"][0]["n_tokens"]
    assert events[0][1]["n"] == 0 and all(e == pack.text.STREAM_EVENT for e, _ in events)
    assert [d["n"] for _, d in events[1:]] == list(range(1, n + 1))
    assert "".join(d["delta"] for _, d in events).strip() == out[0][0]
    assert progress[-1] == (10, 10)
    assert {d["item"] for _, d in events} == {0}


def test_each_answer_of_a_list_streams_with_its_place(pack, loaded, monkeypatch):
    """Generate takes a list of prefills (one prompt per image) in one call: each answer's events say which item it
    is, so that the page keeps the earlier answers while the next one streams."""
    events = []
    monkeypatch.setattr(pack.text, "_send", lambda event, data: events.append(data))
    pf = _prefill(pack, loaded)
    out = listed(pack.Qwen35Generate, prefill=[pf, pf, pf], max_new_tokens=2, sampling=True, temperature=0.9,
                 top_k=50, top_p=0.95, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, seed=[1, 2, 3])
    assert [d["item"] for d in events if d["n"] == 0] == [0, 1, 2] and len(out[0]) == 3
    item = None
    for d in events:  # every token event names the item its answer started with
        item = d["item"] if d["n"] == 0 else item
        assert d["item"] == item


def test_each_stream_event_says_whether_the_thinking_ended_before_it(pack, loaded, monkeypatch):
    """With thinking on, every token event carries `answering`: whether the thinking ended before its delta, so
    that a page reloaded mid-answer shows the rest as the answer, not as thinking (web/qwen35.js); the event of the
    token that ends it says `closes`. Both follow the runtime's </think> token (on_thinking_end), not the text:
    thinking that spells "</think>" out of other tokens is still thinking, as the node's outputs have it."""
    import types

    import qwen35_fast.runtime as runtime
    events = []
    monkeypatch.setattr(pack.text, "_send", lambda event, data: events.append(data))
    deltas = ["Hmm", " </thi", "nk>", " so", "</think>", "\n\nRed", "."]  # the fifth is the </think> token

    def scripted(model, pf, max_new_tokens, sampling, seed, on_token, on_thinking_end):
        for n, d in enumerate(deltas, 1):
            if n == 5 and pf.thinking:
                on_thinking_end()
            on_token(d, n, max_new_tokens)
        return types.SimpleNamespace(text="Red.", thinking="Hmm </think> so", token_ids=[], n_tokens=len(deltas),
                                     first_token_ms=1.0, decode_tokens_per_s=1.0, finish_reason="stop")
    monkeypatch.setattr(runtime, "generate", scripted)
    _generate(pack, _prefill(pack, loaded, thinking=True), max_new_tokens=20)
    tokens = [d for d in events if d["n"]]
    assert [d["answering"] for d in tokens] == [False] * 5 + [True] * 2
    assert [d["closes"] for d in tokens] == [False] * 4 + [True] + [False] * 2  # in every event (an older node: none)
    events.clear()
    _generate(pack, _prefill(pack, loaded, thinking=False), max_new_tokens=20)
    assert not any(d["answering"] or d["closes"] for d in events if d["n"])  # no thinking block: nothing ends


def test_stream_goes_to_the_prompt_s_client_only(pack, comfy, monkeypatch):
    """As ComfyUI's own node events: to the client that queued the prompt, and to nobody for a prompt queued
    without a client id (not to every open tab)."""
    import server
    sent = []
    fake = type("Server", (), {"client_id": None, "last_prompt_id": "p1",
                               "send_sync": lambda self, event, data, sid=None: sent.append((event, data, sid))})()
    monkeypatch.setattr(server.PromptServer, "instance", fake, raising=False)
    pack.text._send(pack.text.STREAM_EVENT, {"n": 0})
    assert sent == []
    fake.client_id = "tab-1"
    pack.text._send(pack.text.STREAM_EVENT, {"n": 0})
    assert sent == [(pack.text.STREAM_EVENT, {"n": 0, "prompt_id": "p1"}, "tab-1")]


def test_cancel_lands_within_one_token(pack, loaded, comfy, monkeypatch):
    events = []
    monkeypatch.setattr(pack.text, "_send", lambda event, data: events.append(data))
    pf = _prefill(pack, loaded)
    real = comfy.mm.throw_exception_if_processing_interrupted
    calls = interrupt_at(comfy, monkeypatch, 3)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        _generate(pack, pf, max_new_tokens=200)
    assert calls["n"] == 3 and max(d["n"] for d in events) == 2  # token 3 never went out
    assert not comfy.mm.processing_interrupted()
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", real)
    assert isinstance(_generate(pack, pf, max_new_tokens=4)[0][0], str)  # the next run is normal


def test_a_long_prompt_shows_its_pieces_and_a_cancel_lands_between_them(pack, loaded, comfy, monkeypatch):
    """A prompt read in pieces (runtime PREFILL_PIECE, 8 here): the node's bar follows the pieces, Cancel stops
    the prefill between two of them, its blocks go back at once, and the next run reads the prompt as before."""
    import gc

    from qwen35_fast.runtime import model as model_mod
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 8)
    prompt = "Name three colours, three animals and three cities, in that order, please."
    progress = []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, t, preview, node_id=None: progress.append((v, t)))
    want = _prefill(pack, loaded, prompt)
    n = want.prefill.n_tokens
    assert progress[0] == (8, progress[0][1]) and progress[0][1] > 16  # the first piece's end, of the prompt's
    loaded.model.kv.pool.clear()
    real = comfy.mm.throw_exception_if_processing_interrupted
    gc.collect()
    free = loaded.model.kv.pool.num_free
    checks = interrupt_at(comfy, monkeypatch, 2)  # the second piece's
    with pytest.raises(comfy.mm.InterruptProcessingException):
        _prefill(pack, loaded, prompt)
    assert checks["n"] == 2 and loaded.model.kv.pool.num_free == free and not comfy.mm.processing_interrupted()
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", real)
    again = _prefill(pack, loaded, prompt)
    assert again.prefill.n_tokens == n and float((again.prefill.logits - want.prefill.logits).abs().max()) < 1e-5


def test_unload_models_frees_it_and_the_next_run_loads_it_again(pack, models_dir, comfy):
    # on the device ComfyUI manages (a GPU when there is one): "Unload models" frees that device only
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="auto", backend="torch",
                                           keep_loaded=True)[0]
    # a model on ComfyUI's GPU waits on ComfyUI's offload device, one on the CPU on the CPU (--gpu-only's offload
    # device is its GPU)
    managed = model.managed
    assert managed.offload_device == (managed.load_device if managed.load_device.type == "cpu"
                                      else comfy.mm.text_encoder_offload_device())
    pf = _prefill(pack, model)
    comfy.mm.unload_all_models()  # what "Unload models" and POST /free {"unload_models": true} do
    assert not any(m.model is model.managed for m in comfy.mm.current_loaded_models)
    assert model.managed.current_loaded_device() == model.managed.offload_device
    _generate(pack, pf, max_new_tokens=3)
    assert any(m.model is model.managed for m in comfy.mm.current_loaded_models)
    assert model.managed.current_loaded_device() == model.managed.load_device
    model.release()


def test_loading_a_loaded_model_again_moves_nothing(pack, models_dir, comfy, monkeypatch):
    """Every node run asks model management to load the model; for one already loaded ComfyUI takes its entry
    off the list (detach with unpatch_all off) and puts it back: the weights stay. An unload still moves them
    (an offload device other than the load device stands in for a GPU's; the move is recorded, not made)."""
    import torch
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                           keep_loaded=True)[0]
    moves = []
    monkeypatch.setattr(model.managed, "offload_device", torch.device("meta"))
    monkeypatch.setattr(model.model, "to", lambda device: moves.append(torch.device(device)) or model.model)
    for _ in range(3):
        model.load(memory_required=1 << 20)
        assert any(m.model is model.managed for m in comfy.mm.current_loaded_models)
    assert moves == []
    model.release()
    assert moves == [torch.device("meta")]


def test_changing_keep_loaded_does_not_read_the_checkpoint_again(pack, models_dir, comfy, monkeypatch):
    """ComfyUI runs the loader again when any input changes: keep_loaded takes the model in memory through the
    same ManagedModel (one entry in model management, one set of tracked prefills), each output with its own
    keep_loaded (ComfyUI's caches may hand a later run an earlier output); the other settings, or a model nothing
    holds any more, read it."""
    import gc

    import qwen35_fast.runtime as rt
    # a checkpoint folder of its own: a model another test left for the garbage collector is not shared here
    shutil.copytree(models_dir / "LLM" / "qwen35-demo", models_dir / "LLM" / "qwen35-demo-reloaded")
    comfy.folder_paths.filename_list_cache.clear()
    reads = []
    real = rt.load_model
    monkeypatch.setattr(rt, "load_model", lambda *a, **kw: reads.append(kw["dtype"]) or real(*a, **kw))
    load = lambda **kw: pack.Qwen35ModelLoader.execute(  # noqa: E731
        model="qwen35-demo-reloaded", device="cpu", backend="torch",
        **{"dtype": "fp32", "keep_loaded": True, **kw})[0]
    first = load()
    pf = _prefill(pack, first)
    second = load(keep_loaded=False)
    assert second.managed is first.managed and reads == ["fp32"]
    assert first.keep_loaded and not second.keep_loaded  # each output keeps its node's setting
    assert sum(m.model is first.managed for m in comfy.mm.current_loaded_models) == 1
    _generate(pack, pf, max_new_tokens=2)  # the earlier prefill still generates; its loader keeps the model
    assert any(m.model is first.managed for m in comfy.mm.current_loaded_models)
    _generate(pack, _prefill(pack, second), max_new_tokens=2)  # through the second output: released after
    assert not any(m.model is first.managed for m in comfy.mm.current_loaded_models)
    other_budget = load(cache_budget_mb=256)
    assert other_budget.model is not first.model and reads == ["fp32", "fp32"]
    assert not other_budget.model.kv.growable and first.model.kv.growable  # each its own store
    other_dtype = load(dtype="bf16")
    assert other_dtype.model is not first.model and reads == ["fp32", "fp32", "bf16"]
    for m in (first, other_budget, other_dtype):
        m.release()
    del first, second, other_budget, other_dtype, pf
    gc.collect()
    load().release()
    assert reads == ["fp32", "fp32", "bf16", "fp32"]


def test_keep_loaded_off_releases_after_generate(pack, models_dir, comfy):
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                           keep_loaded=False)[0]
    pf = _prefill(pack, model)
    assert any(m.model is model.managed for m in comfy.mm.current_loaded_models)
    _generate(pack, pf, max_new_tokens=3)
    assert not any(m.model is model.managed for m in comfy.mm.current_loaded_models)


def test_a_list_joining_two_loaders_outputs_releases_by_each_loaders_keep_loaded(pack, models_dir, comfy,
                                                                                  monkeypatch):
    """A list of prefills made through two loaders of one checkpoint (one model in memory, two keep_loaded
    settings): Generate releases the model once, for the loader with keep_loaded off, whichever item it came
    from; a list all from the keep_loaded-on loader leaves it loaded."""
    load = lambda keep: pack.Qwen35ModelLoader.execute(  # noqa: E731
        model="qwen35-demo", dtype="fp32", device="cpu", backend="torch", keep_loaded=keep)[0]
    keep, drop = load(True), load(False)
    assert keep.managed is drop.managed
    released = []
    real = keep.managed.release
    monkeypatch.setattr(keep.managed, "release", lambda: released.append(1) or real())
    settings = dict(max_new_tokens=2, sampling=False, temperature=0.9, top_k=50, top_p=0.95, min_p=0.0,
                    repetition_penalty=1.0, presence_penalty=0.0, seed=0)
    a, b = _prefill(pack, keep), _prefill(pack, drop, prompt="Name a shape.")
    out = listed(pack.Qwen35Generate, prefill=[a, b, a], **settings)
    assert len(out[0]) == 3 and len(released) == 1
    assert not any(m.model is keep.managed for m in comfy.mm.current_loaded_models)
    listed(pack.Qwen35Generate, prefill=[a, a], **settings)
    assert len(released) == 1 and any(m.model is keep.managed for m in comfy.mm.current_loaded_models)
    keep.release()


def test_a_model_loaded_on_the_cpu_waits_there_where_comfyui_offloads_to_its_gpu(pack, models_dir, comfy,
                                                                                  monkeypatch):
    """With --gpu-only ComfyUI's text-encoder offload device is its GPU (here "meta" stands in for it). A model
    loaded on the cpu (device cpu, or auto on a GPU it does not run on) is not moved onto that GPU when it is
    released or unloaded: it stays where it runs, as do its prefills' states."""
    import torch
    monkeypatch.setattr(comfy.mm, "text_encoder_offload_device", lambda: torch.device("meta"))
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                           keep_loaded=False, cache_budget_mb=512)[0]
    assert model.managed.offload_device == torch.device("cpu")
    pf = _prefill(pack, model)
    assert all(t is None or t.device.type == "cpu" for t in pf.prefill.cache.ssm + pf.prefill.cache.conv)
    _generate(pack, pf, max_new_tokens=2)  # keep_loaded off: released after it
    assert model.model.device.type == "cpu" and model.model.kv.device.type == "cpu"
    assert isinstance(_generate(pack, pf, max_new_tokens=2)[0][0], str)


def test_managed_model_answers_model_management(pack, loaded):
    size = loaded.managed.model_size()
    assert size == loaded.model.size_bytes() > 0
    assert loaded.managed.loaded_size() == size  # on its load device (the CPU here)
    managed = loaded.managed
    assert managed.is_clone(managed) and not managed.is_dynamic() and managed.model_patches_models() == []


def test_errors_reach_comfyui_with_the_runtime_message(pack, loaded, models_dir):
    from qwen35_fast.runtime import Qwen35Error
    with pytest.raises(Qwen35Error, match="empty"):
        _prefill(pack, loaded, prompt="   ")
    with pytest.raises(Qwen35Error, match="models/LLM"):
        pack.Qwen35ModelLoader.execute(model="no-such-model", dtype="auto", device="cpu", backend="auto",
                                       keep_loaded=True)
    with pytest.raises(Qwen35Error, match="max_new_tokens"):
        _generate(pack, _prefill(pack, loaded), max_new_tokens=0)


@pytest.mark.gpu
def test_vram_comes_back_on_release_and_unload_and_returns_on_the_next_run(pack, models_dir, comfy):
    import torch
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="bf16", device="cuda", backend="auto",
                                           keep_loaded=True)[0]
    size = model.managed.model_size()
    assert torch.cuda.memory_allocated() - base >= size
    pf = _prefill(pack, model)
    comfy.mm.unload_all_models()  # "Unload models" / POST /free
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    assert held <= 4 * 2**20, f"{held} bytes still on the GPU after unload (weights: {size}): {_cuda_tensors()}"
    state = pf.prefill.cache  # its GDN states parked in RAM, its K/V in the store, which left with the weights
    assert all(t is None or t.device.type == "cpu" for t in state.ssm + state.conv)
    assert model.model.kv.device.type == "cpu" and model.model.kv.nbytes <= size
    _generate(pack, pf, max_new_tokens=4)  # loads the weights back by itself
    assert torch.cuda.memory_allocated() - base >= size
    model.keep_loaded = False
    _generate(pack, pf, max_new_tokens=4)  # keep_loaded off: weights leave after the run
    assert model.managed.current_loaded_device().type == "cpu"
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base  # weights, parked prefill state, graph pools, cuBLAS workspaces
    assert held <= 4 * 2**20, f"{held} bytes still on the GPU after a run with keep_loaded off: {_cuda_tensors()}"


def test_ram_short_by_keeps_comfyuis_headroom(pack, comfy, monkeypatch):
    """How far below the free RAM ComfyUI keeps an unload to RAM would leave the system: its RAM cache's
    headroom while a prompt runs, else its default (10% of the RAM, 2 to 10 GiB)."""
    import comfy.memory_management as cmm
    import psutil
    gib = 1 << 30
    vm = type("VM", (), {"total": 32 * gib, "available": 12 * gib})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm)
    monkeypatch.setattr(cmm, "RAM_CACHE_HEADROOM", 0)
    short = pack.memory.ram_short_by
    assert short(6 * gib) == 32 * gib // 10 - 6 * gib < 0  # 6 GiB free after, 3.2 kept: room
    assert short(10 * gib) == 32 * gib // 10 - 2 * gib > 0
    monkeypatch.setattr(cmm, "RAM_CACHE_HEADROOM", 8 * gib)  # a prompt running with --cache-ram 8
    assert short(6 * gib) == 2 * gib
    monkeypatch.setattr(psutil, "virtual_memory", lambda: (_ for _ in ()).throw(OSError("no /proc")))
    assert short(100 * gib) == 0  # no answer: kept in RAM as before


def test_an_unload_moves_or_lets_go_as_the_free_ram_says(pack, comfy, monkeypatch):
    """ManagedModel's choices with a stand-in runtime model on a GPU: an unload to the CPU moves the weights
    when RAM has room, lets them go when it is short (and the model came from a checkpoint), moves them when
    the offload device is not the CPU; a dropped model counts as unloaded and comes back by being read
    again, a moved one by being moved."""
    import torch

    class Stand:
        path = "stand-in"

        def __init__(self):
            self.device, self.dropped, self.calls, self.checkpoint = torch.device("cuda", 0), False, [], object()

        weights_dropped = property(lambda self: self.dropped)

        def weight_bytes(self):
            return 3 << 30

        def kv_bytes(self):
            return 1 << 30

        def size_bytes(self):
            return 4 << 30

        def to(self, device):
            self.calls.append(("to", torch.device(device).type))
            self.device = torch.device(device)

        def drop_weights(self, park):
            self.calls.append(("drop", torch.device(park).type))
            self.dropped = True

        def reload_weights(self, device):
            self.calls.append(("reload", torch.device(device).type))
            self.device, self.dropped = torch.device(device), False

    asked, short = [], {"by": -1}
    monkeypatch.setattr(pack.memory, "ram_short_by", lambda n: asked.append(n) or short["by"])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    m = pack.memory.ManagedModel(Stand(), cuda, cpu)
    m.detach()  # room in RAM: moved
    assert m.model.calls == [("to", "cpu")] and asked == [4 << 30] and m.current_loaded_device() == cpu
    assert m.partially_load(cuda) == 4 << 30 and m.model.calls[-1] == ("to", "cuda")
    short["by"] = 1
    m.detach()  # short: let go, counted as unloaded
    assert m.model.calls[-1] == ("drop", "cpu") and m.current_loaded_device() == cpu and m.loaded_size() == 0
    assert m.partially_unload(cpu) == 0  # nothing more to free
    assert m.partially_load(cuda) == 4 << 30 and m.model.calls[-1] == ("reload", "cuda")
    assert m.current_loaded_device() == cuda and m.loaded_size() == 4 << 30
    m.model.checkpoint = None  # not read from a checkpoint: moved even when short
    m.detach()
    assert m.model.calls[-1] == ("to", "cpu")
    other = pack.memory.ManagedModel(Stand(), cuda, torch.device("cuda", 1))
    asked.clear()
    other.detach()  # an offload device that is not the CPU: RAM is not asked
    assert other.model.calls == [("to", "cuda")] and asked == []
    half = Stand()
    half.device = cpu
    moves = half.to

    def fails_on_the_gpu(device):  # the weights moved, then the K/V store ran out of memory
        moves(device)
        if torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory.")
    half.to = fails_on_the_gpu
    m = pack.memory.ManagedModel(half, cuda, cpu)
    with pytest.raises(torch.OutOfMemoryError):
        m.partially_load(cuda)
    assert half.calls == [("to", "cuda"), ("to", "cpu")] and m.current_loaded_device() == cpu
    assert m.loaded_size() == 0  # unloaded, not half loaded: the next load moves it again
    apple = Stand()
    apple.device = torch.device("mps", 0)  # where an Apple GPU's tensors are; ComfyUI's device is "mps"
    m = pack.memory.ManagedModel(apple, torch.device("mps"), cpu)
    assert m.current_loaded_device() == torch.device("mps") and m.loaded_size() == 4 << 30  # loaded: == holds
    assert m.partially_load(torch.device("mps")) == 0 and apple.calls == []


def test_a_checkpoint_replaced_on_disk_runs_the_loader_again(pack, models_dir, comfy):
    """The loader's fingerprint is its files' sizes and times: ComfyUI runs it again (and it reads the new
    file) when a checkpoint is replaced under the same name, not when nothing changed."""
    import os
    import shutil
    shutil.copy(models_dir / "text_encoders" / "qwen35_demo_single.safetensors",
                models_dir / "text_encoders" / "qwen35_demo_replaced.safetensors")
    comfy.folder_paths.filename_list_cache.clear()
    fp = lambda: pack.Qwen35ModelLoader.fingerprint_inputs(  # noqa: E731
        model="qwen35_demo_replaced.safetensors", dtype="fp32", device="cpu", backend="torch")
    first = fp()
    assert fp() == first
    f = models_dir / "text_encoders" / "qwen35_demo_replaced.safetensors"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fp() != first
    assert pack.Qwen35ModelLoader.fingerprint_inputs(model="no-such-model") == "no-such-model"
    (models_dir / "text_encoders" / "alone").mkdir()  # a single file whose folder gets a tokenizer.json
    shutil.move(f, models_dir / "text_encoders" / "alone" / f.name)
    comfy.folder_paths.filename_list_cache.clear()
    fp = lambda: pack.Qwen35ModelLoader.fingerprint_inputs(  # noqa: E731
        model=f"alone/{f.name}", dtype="fp32", device="cpu", backend="torch")
    first = fp()
    (models_dir / "text_encoders" / "alone" / "tokenizer.json").write_text("{}")
    assert fp() != first
    folder = models_dir / "LLM" / "qwen35-demo"  # a folder: the files the runtime reads, not a file manager's
    fp = lambda: pack.Qwen35ModelLoader.fingerprint_inputs(  # noqa: E731
        model="qwen35-demo", dtype="fp32", device="cpu", backend="torch")
    first = fp()
    for name in (".DS_Store", "README.md", "preview.png"):
        (folder / name).write_bytes(b"x")
    assert fp() == first
    config = folder / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fp() != first
    for name in (".DS_Store", "README.md", "preview.png"):
        (folder / name).unlink()


@pytest.mark.gpu
def test_an_unload_where_ram_is_short_lets_the_weights_go_and_reads_them_again(pack, models_dir, comfy,
                                                                                monkeypatch):
    """Unloaded where RAM is short, the weights are let go rather than put in RAM (which ComfyUI's RAM cache
    does not see); the next run reads them from the checkpoint onto the GPU, and the prefill made before the
    unload writes the same text."""
    import torch
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="bf16", device="cuda", backend="auto",
                                           keep_loaded=True)[0]
    pf = _prefill(pack, model)
    text = _generate(pack, pf, seed=7)[0][0]
    asked = []
    monkeypatch.setattr(pack.memory, "ram_short_by", lambda n: asked.append(n) or 1 << 30)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    comfy.mm.unload_all_models()
    assert asked == [model.model.weight_bytes() + model.model.kv_bytes()]
    assert model.model.weights_dropped and model.managed.current_loaded_device() == model.managed.offload_device
    assert all(p.is_meta for p in model.model.parameters())  # in neither VRAM nor RAM
    assert model.model.kv.device.type == "cpu"  # the K/V store (the prefill's blocks) waits in RAM
    assert torch.cuda.memory_allocated() <= base - model.model.weight_bytes()
    assert model.managed.loaded_size() == 0 and model.managed.model_size() > model.model.weight_bytes()
    assert _generate(pack, pf, seed=7)[0][0] == text  # read again onto the GPU by the run itself
    assert not model.model.weights_dropped and model.managed.current_loaded_device() == model.managed.load_device
    model.release()


def _cuda_tensors(top=8):
    """The largest live CUDA tensors by shape, for a failure message."""
    import gc

    import torch
    found = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.is_cuda:
                key = (tuple(obj.shape), str(obj.dtype))
                n, size = found.get(key, (0, 0))
                found[key] = (n + 1, size + obj.untyped_storage().nbytes())
        except Exception:  # noqa: BLE001 - objects that fail to answer are not what we look for
            pass
    return sorted(found.items(), key=lambda kv: -kv[1][1])[:top]


def test_weights_bytes_counts_numbers_not_file_bytes(pack, tmp_path):
    """The VRAM made room for before a load: the loaded model's numbers at the dtype asked for, so an FP8
    file (dequantized at load) counts twice its size and an fp32 one half of it at bf16."""
    import torch
    from safetensors.torch import save_file
    f8, f32 = tmp_path / "f8.safetensors", tmp_path / "f32.safetensors"
    save_file({"w": torch.zeros(64, 32, dtype=torch.float8_e4m3fn), "s": torch.ones(())}, str(f8))
    save_file({"w": torch.zeros(64, 32)}, str(f32))
    assert pack.models_folder.weights_bytes(f8) == 2 * (64 * 32 + 1)
    assert pack.models_folder.weights_bytes(f32) == 2 * 64 * 32
    assert pack.models_folder.weights_bytes(f32, 4) == 4 * 64 * 32
    assert pack.models_folder.weights_bytes(tmp_path) == 2 * (64 * 32 + 1) + 2 * 64 * 32  # a folder: every file
    # with int8 weights the text model's matrices take a byte a number, the vision tower and 1-D tensors the dtype
    mixed = tmp_path / "mixed" / "model.safetensors"
    mixed.parent.mkdir()
    save_file({"model.language_model.layers.0.mlp.down_proj.weight": torch.zeros(64, 32),
               "model.language_model.norm.weight": torch.zeros(64),
               "model.visual.blocks.0.attn.qkv.weight": torch.zeros(96, 32)}, str(mixed))
    assert pack.models_folder.weights_bytes(mixed, 2, int8=True) == 64 * 32 + 2 * 64 + 2 * 96 * 32
    # the multi-token-prediction layer some checkpoints carry is never loaded
    with_mtp = tmp_path / "mtp" / "model.safetensors"
    with_mtp.parent.mkdir()
    save_file({"model.language_model.norm.weight": torch.zeros(64), "mtp.fc.weight": torch.zeros(64, 128),
               "model.mtp.norm.weight": torch.zeros(64)}, str(with_mtp))
    assert pack.models_folder.weights_bytes(with_mtp) == 2 * 64
    (tmp_path / "bad.safetensors").write_bytes(b"\x00")
    assert pack.models_folder.weights_bytes(tmp_path / "bad.safetensors") == 0


def releases_counted(pack, monkeypatch):
    """The demo model loaded with keep_loaded off, and a list that grows by one at each release of it."""
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                           keep_loaded=False)[0]
    released = []
    real_release = model.release
    monkeypatch.setattr(model, "release", lambda: released.append(1) or real_release())
    return model, released


def test_a_cache_budget_that_does_not_fit_lets_the_new_model_go_before_emptying_the_cache(pack, models_dir, comfy,
                                                                                          monkeypatch):
    """A K/V budget the device cannot hold fails after the weights were read: the loader's error names the budget,
    and the new model is gone when it empties ComfyUI's cache (the error's traceback holds setup_kv's frame, whose
    `self` is the model), so its memory goes back with that call, not at a later garbage collection."""
    import gc
    import weakref

    import qwen35_fast.runtime.model as model_mod
    from qwen35_fast.runtime import Qwen35Error
    made, alive_at_release = [], []
    real_load = pack.loader._load

    def load(*args):
        runtime_model, note = real_load(*args)
        made.append(weakref.ref(runtime_model))
        return runtime_model, note

    def no_room(*args, **kwargs):  # what the CPU allocator raises for a pool larger than the RAM
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 824633720832 bytes")

    monkeypatch.setattr(pack.loader, "_load", load)
    monkeypatch.setattr(model_mod, "KVStore", no_room)
    monkeypatch.setattr(comfy.mm, "soft_empty_cache", lambda *a, **k: alive_at_release.append(made[0]() is not None))
    caught = None
    try:
        pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                       keep_loaded=True, cache_budget_mb=3 << 10)
    except Qwen35Error as e:
        caught = e
    assert caught is not None and "a K/V cache of 3072 MiB does not fit on cpu" in str(caught)
    assert len(made) == 1 and alive_at_release[:1] == [False]
    del caught
    gc.collect()
    assert made[0]() is None


def test_a_fixed_cache_budget_is_in_the_room_asked_before_the_weights(pack, models_dir, comfy, monkeypatch):
    """A fixed K/V budget is allocated right after the weights: ComfyUI is asked for room for both, so that other
    models it could unload (a diffusion model) go first, not the budget's allocation failing beside them."""
    import torch

    import qwen35_fast.runtime as runtime
    asked = []
    monkeypatch.setattr(comfy.mm, "free_memory", lambda need, device, *a, **k: asked.append(need))
    monkeypatch.setattr(comfy.mm, "minimum_inference_memory", lambda: 0)
    monkeypatch.setattr(runtime, "load_model", lambda *a, **k: "the model")  # (no GPU here: nothing is read)
    path = pack.loader.find_model("qwen35-demo")
    assert path is not None
    for budget in (3 << 30, 0):
        assert pack.loader._load(path, "fp32", "cuda", torch.device("cuda"), "torch", "full", budget) == \
            ("the model", "")
    assert len(asked) == 2 and asked[0] - asked[1] == 3 << 30


def test_keep_loaded_off_gives_the_memory_back_when_making_room_fails(pack, models_dir, monkeypatch):
    from qwen35_fast.runtime import Qwen35Error
    model, released = releases_counted(pack, monkeypatch)
    pf = _prefill(pack, model)

    def no_room(memory_required=0):
        raise Qwen35Error("not enough memory")

    monkeypatch.setattr(model, "load", no_room)
    with pytest.raises(Qwen35Error, match="not enough memory"):
        _generate(pack, pf, max_new_tokens=2)
    assert released == [1]


def test_keep_loaded_off_gives_the_memory_back_when_a_prefill_fails(pack, models_dir, monkeypatch):
    from qwen35_fast.runtime import Qwen35Error
    model, released = releases_counted(pack, monkeypatch)
    import dataclasses  # any prompt is too long for this config
    monkeypatch.setattr(model.model, "config", dataclasses.replace(model.model.config, max_position_embeddings=8))
    with pytest.raises(Qwen35Error, match="at most 8 positions"):
        _prefill(pack, model)
    assert released == [1]


def test_keep_loaded_off_gives_the_memory_back_on_bad_input(pack, models_dir, monkeypatch):
    """The loader put the weights on the device: a node that refuses its input gives them back (keep_loaded
    off) as a failed run does, whichever check refuses it."""
    import torch

    from qwen35_fast.runtime import Qwen35Error
    model, released = releases_counted(pack, monkeypatch)
    pf = _prefill(pack, model)
    mm = dict(model=model, prompt="Describe this image.", images=None, video=None, frames=None, frame_rate=24.0,
              mode="all images in one prompt", system_prompt="", thinking=False, max_pixels=0)
    frames = torch.rand(2, 32, 32, 3)
    bad = [
        ("empty", lambda: _prefill(pack, model, prompt="  ")),
        ("both a video and frames", lambda: pack.Qwen35MultimodalPrefill.execute(
            **{**mm, "video": object(), "frames": frames})),
        ("needs images", lambda: pack.Qwen35MultimodalPrefill.execute(**{**mm, "mode": "one prompt per image"})),
        ("takes images only", lambda: pack.Qwen35ContinuePrefill.execute(
            prefill=pf, prompt="<video>?", images=frames[:1], previous_answer=None, thinking=False, max_pixels=0)),
        ("top_p 0.0", lambda: listed(
            pack.Qwen35Generate, prefill=pf, max_new_tokens=3, sampling=True, temperature=0.9, top_k=50, top_p=0.0, min_p=0.0,
            repetition_penalty=1.0, presence_penalty=0.0, seed=0)),
    ]
    for n, (message, run) in enumerate(bad, 1):
        with pytest.raises(Qwen35Error, match=message):
            run()
        assert len(released) == n, message


def test_an_answer_cut_off_while_thinking_says_so(pack, loaded):
    """Thinking on and max_new_tokens reached before </think>: the answer is empty, and the node's panel says
    why and what to change (not an empty box)."""
    out = _generate(pack, _prefill(pack, loaded, thinking=True), max_new_tokens=3, sampling=False)
    s = out.ui["qwen35_generate"][0]
    assert s["finish_reason"] == "length" and out[0] == [""] and out[1][0]
    assert "stopped while thinking, after 3 tokens: no answer yet; raise max_new_tokens" in s["note"]
    assert s["no_answer"] and not s["positions_ran_out"]  # (the flags the page's summary of a list counts)
    limit = loaded.model.config.max_position_embeddings  # the positions run out first: shorten the prompt
    pf = _prefill(pack, loaded, thinking=True)
    room = limit - pf.prefill.n_tokens
    s = _generate(pack, pf, max_new_tokens=room + 5, sampling=False).ui["qwen35_generate"][0]
    assert s["n_tokens"] == room and s["finish_reason"] == "length"
    assert f"after {room} tokens: no answer yet; the prompt and the answer filled the model's {limit:,} positions; " \
           "shorten the prompt" in s["note"]
    assert s["no_answer"] and s["positions_ran_out"]
    plain = _generate(pack, _prefill(pack, loaded), max_new_tokens=3, sampling=False).ui["qwen35_generate"][0]
    assert plain["finish_reason"] == "length" and "note" not in plain
    assert not plain["no_answer"] and not plain["positions_ran_out"]
    # thinking off, the positions run out before max_new_tokens: the answer is cut, and the panel says why
    pf = _prefill(pack, loaded)
    room = limit - pf.prefill.n_tokens
    s = _generate(pack, pf, max_new_tokens=room + 5, sampling=False).ui["qwen35_generate"][0]
    assert s["n_tokens"] == room and s["finish_reason"] == "length"
    assert s["note"] == (f"the answer stopped after {room} of max_new_tokens {room + 5}: the prompt and the answer "
                         f"filled the model's {limit:,} positions; shorten the prompt")
    assert not s["no_answer"] and s["positions_ran_out"]


def test_a_load_shows_its_progress_and_a_cancel_lands_between_its_weights(pack, models_dir, comfy, monkeypatch):
    """Reading a checkpoint (minutes for a 27B from a hard disk) moves the node's progress bar over its weights,
    and Cancel stops it between two of them: nothing of the model stays, and the next run loads it."""
    progress = []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, t, preview, node_id=None: progress.append((v, t)))
    load = lambda: pack.Qwen35ModelLoader.execute(  # noqa: E731  (a budget no other test loads with: read anew)
        model="qwen35-demo", dtype="fp32", device="cpu", backend="torch", keep_loaded=False, cache_budget_mb=7)
    calls = interrupt_at(comfy, monkeypatch, 5)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        load()
    assert calls["n"] == 5 and not comfy.mm.processing_interrupted()
    assert not any("qwen35-demo" in str(getattr(m.model, "model", None) and m.model.model.path)
                   for m in comfy.mm.current_loaded_models)
    total = progress[0][1]
    assert total > 5 and progress[0] == (1, total)
    progress.clear()
    model = load()[0]
    assert progress[-1] == (total, total) and model.model.path.name == "qwen35-demo"
    model.release()


def test_generate_hands_every_setting_to_the_runtime(pack, loaded, monkeypatch):
    import qwen35_fast.runtime as rt
    seen = {}
    real = rt.generate

    def spy(model, pf, max_new_tokens, sampling, seed, on_token, on_thinking_end):
        seen.update(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
        return real(model, pf, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, on_token=on_token,
                    on_thinking_end=on_thinking_end)
    monkeypatch.setattr(rt, "generate", spy)
    out = listed(pack.Qwen35Generate, prefill=_prefill(pack, loaded), max_new_tokens=5, sampling=True,
                 temperature=0.6, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
                 seed=99)
    want = rt.SamplingParams(do_sample=True, temperature=0.6, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                             presence_penalty=0.4)
    assert seen == dict(max_new_tokens=5, sampling=want, seed=99) and isinstance(out[0][0], str)


@pytest.mark.parametrize("template", [True, False])
def test_text_prefill_thinks_only_through_the_chat_template(pack, loaded, template):
    """Thinking opens <think> in the chat template's generation prompt; a raw prompt has none, so its whole answer
    is the answer (Generate would otherwise put it all under thinking)."""
    out = pack.Qwen35TextPrefill.execute(model=loaded, prompt="Hello", system_prompt="", thinking=True,
                                         use_chat_template=template)
    assert out[0].prefill.thinking is template
    assert loaded.model.tokenizer.decode(out[0].prefill.token_ids).endswith("<think>\n") is template


def test_the_nodes_show_what_the_runtime_did(pack, models_dir):
    """The numbers on the nodes are the runtime's: the loader's cache size and tokens, a prefill's reused tokens,
    why a generation ended."""
    out = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="torch",
                                         keep_loaded=True)
    managed = out[0]
    try:
        store, info = managed.model.kv, out.ui["qwen35_model"][0]
        assert info["cache_tokens"] == store.num_blocks * store.block_size
        assert info["cache_mb"] == round((store.nbytes + store.pool.snapshot_budget_bytes) / 2**20, 1)
        first = pack.Qwen35TextPrefill.execute(model=managed, prompt="Name a colour.", system_prompt="Be brief. " * 8,
                                               thinking=False, use_chat_template=True)
        again = pack.Qwen35TextPrefill.execute(model=managed, prompt="Name a fruit.", system_prompt="Be brief. " * 8,
                                               thinking=False, use_chat_template=True)
        assert first.ui["qwen35_prefill"][0]["cached_tokens"] == 0
        assert again.ui["qwen35_prefill"][0]["cached_tokens"] == again[0].prefill.cached_tokens > 0
        done = _generate(pack, again[0], max_new_tokens=1, sampling=False).ui["qwen35_generate"][0]
        assert done["n_tokens"] == 1 and done["finish_reason"] == "length"
    finally:
        managed.release()


def test_a_prefill_nodes_next_run_lets_its_earlier_output_go_and_a_later_use_makes_it_again(pack, loaded):
    """ComfyUI's default cache keeps each earlier prompt's outputs until system RAM runs short, blind to the K/V
    blocks and GDN states a prefill holds: a prefill node's run in a later prompt lets its earlier output go (its
    runtime Prefill freed), and that output, handed on again (the prompt edited back), is made again and answers
    as it did. Runs over the items of a list within one prompt keep each other."""
    import gc
    import weakref

    import torch
    from comfy_execution.utils import CurrentNodeContext

    def at(prompt_id, node_id):
        return CurrentNodeContext(prompt_id, node_id)

    with at("p1", "5"):
        first = _prefill(pack, loaded, "Name three colours of a kingfisher.")
        listed_too = _prefill(pack, loaded, "Name three shapes.")  # the node's second list item in that prompt
    answer = _generate(pack, first, seed=3, sampling=False)[0]
    logits, cached = first.prefill.logits.clone(), first.prefill.cached_tokens
    held = weakref.ref(first.prefill)
    assert not first.let_go and not listed_too.let_go
    with at("p2", "5"):
        second = _prefill(pack, loaded, "Name three animals.")
    gc.collect()
    assert first.let_go and listed_too.let_go and not second.let_go and held() is None
    with at("p3", "9"):  # a Generate handed the first output again: made again, the second let go in its place
        assert _generate(pack, first, seed=3, sampling=False)[0] == answer
    assert not first.let_go and second.let_go and first.prefill.n_tokens == len(first.prefill.token_ids)
    # made again from the prefix the first read started from (not the turn end that read left in the prefix
    # cache, whose logits come out of another sum order): the same logits bit for bit
    assert first.prefill.cached_tokens == cached < first.prefill.n_tokens - 5
    assert torch.equal(first.prefill.logits, logits)
    # outside a ComfyUI run (scripts, the tests above) nothing is let go
    assert not _prefill(pack, loaded, "Name three trees.").let_go and not first.let_go


def test_a_prefill_node_run_once_per_item_of_a_list_parks_every_items_states(pack, loaded, monkeypatch):
    """A list into a prefill node (a list of prompts): ComfyUI runs the node once per item before any Generate,
    so from its second run in one prompt every item's GDN states wait on the offload device, as one prompt per
    image's do, each with its place in the list; a node's one run keeps them where the model runs."""
    import torch
    from comfy_execution.utils import CurrentNodeContext

    monkeypatch.setattr(loaded.managed, "offload_device", torch.device("meta"))  # (the CPU is the load device here)

    def where(out):
        return {t.device.type for t in out.prefill.cache.ssm + out.prefill.turn.ssm if t is not None}

    try:
        with CurrentNodeContext("p1", "5"):
            first = _prefill(pack, loaded, "Name three rivers.")
            assert where(first) == {"cpu"} and (first.item, first.items) == (0, 1)
            second = _prefill(pack, loaded, "Name three lakes.")
            third = _prefill(pack, loaded, "Name three seas.")
        assert [where(o) for o in (first, second, third)] == [{"meta"}] * 3
        assert [(o.item, o.items) for o in (first, second, third)] == [(0, 3), (1, 3), (2, 3)]
        with CurrentNodeContext("p2", "5"):
            alone = _prefill(pack, loaded, "Name three mountains.")
        assert where(alone) == {"cpu"} and (alone.item, alone.items) == (0, 1)
    finally:
        loaded.model.kv.pool.clear()  # (the snapshots of the parked turns were moved with them)


def test_a_continue_let_go_with_its_parent_is_made_again_after_it(pack, loaded):
    import torch
    from comfy_execution.utils import CurrentNodeContext

    def run(prompt_id, parent_prompt):
        with CurrentNodeContext(prompt_id, "5"):
            parent = _prefill(pack, loaded, parent_prompt)
        with CurrentNodeContext(prompt_id, "6"):
            return parent, pack.Qwen35ContinuePrefill.execute(prefill=parent, prompt="And three more?", images=None,
                                                              previous_answer="Red, green, blue.", thinking=False,
                                                              max_pixels=0)[0]
    parent, child = run("p1", "Name three colours of a jay.")
    answer = _generate(pack, child, seed=1, sampling=False)[0]
    logits, cached = child.prefill.logits.clone(), child.prefill.cached_tokens
    run("p2", "Name three animals.")
    assert parent.let_go and child.let_go
    with CurrentNodeContext("p3", "7"):
        assert _generate(pack, child, seed=1, sampling=False)[0] == answer
    assert not parent.let_go and not child.let_go
    # both made again from where they were first read (not from the turn ends those reads left): the same logits
    assert child.prefill.cached_tokens == cached and torch.equal(child.prefill.logits, logits)


def test_the_first_token_counts_the_prompts_time_only_in_the_run_that_read_it(pack, loaded):
    from comfy_execution.utils import CurrentNodeContext

    with CurrentNodeContext("p1", "5"):
        pf = _prefill(pack, loaded)
    runtime_pf = pf.prefill
    pf._prefill = type(runtime_pf)(**{**runtime_pf.__dict__, "ms": 5000.0})  # a prompt that took 5 s to read
    with CurrentNodeContext("p1", "9"):  # the same run: the wait for the first token was the prompt's and more
        assert _generate(pack, pf, max_new_tokens=2).ui["qwen35_generate"][0]["first_token_ms"] >= 5000.0
    with CurrentNodeContext("p1", "10"):  # a second Generate on it in that run: the prompt was read before it
        assert _generate(pack, pf, max_new_tokens=2).ui["qwen35_generate"][0]["first_token_ms"] < 5000.0
    with CurrentNodeContext("p2", "9"):  # a later run (a new seed): ComfyUI's cache gave the prefill, at no cost
        assert _generate(pack, pf, max_new_tokens=2, seed=1).ui["qwen35_generate"][0]["first_token_ms"] < 5000.0
    with CurrentNodeContext("p3", "5"):
        pf = _prefill(pack, loaded, prompt="Name a colour.")
    pf._prefill = type(pf.prefill)(**{**pf.prefill.__dict__, "ms": 5000.0})
    with CurrentNodeContext("p3", "9"):  # a list of seeds on it: the prompt was read once, before the first answer
        shown = _generate(pack, pf, max_new_tokens=2, seed=[1, 2]).ui["qwen35_generate"]
        assert shown[0]["first_token_ms"] >= 5000.0 > shown[1]["first_token_ms"]
