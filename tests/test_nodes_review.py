"""The node layer as a ComfyUI user meets it (V3 `execute`, ComfyUI importable from COMFYUI_DIR; skipped otherwise),
on the CPU with the demo's tiny checkpoint: every input explained, a follow-up image's pixel range on the panel,
and a value of the wrong kind on a link named rather than an AttributeError."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import pytest
import torch
from test_nodes import (  # noqa: F401  (fixtures)
    _generate,
    _prefill,
    comfy,
    interrupt_at,
    listed,
    loaded,
    models_dir,
    pack,
)

pytestmark = pytest.mark.comfyui


def test_every_input_of_every_node_has_a_tooltip(pack):
    """The front end shows an input's tooltip on hover: a socket without one (a model or prefill link) tells a
    user nothing about what to connect."""
    for node in pack.NODES:
        inputs = node.INPUT_TYPES()
        for group in ("required", "optional"):
            for name, spec in inputs.get(group, {}).items():
                assert (spec[1] if len(spec) > 1 else {}).get("tooltip"), f"{node.__name__}.{name} has no tooltip"


def test_a_follow_up_image_outside_0_to_1_is_named_on_the_panel(pack, loaded):
    """As on the Multimodal Prefill's panel: a Continue's image in 0..255 reads as white, and its panel says so
    (the runtime only warns in the log, and not at all when the prefix cache answers the image the second time)."""
    pf = _prefill(pack, loaded)
    image = torch.rand(1, 64, 64, 3)

    def note(images):
        out = pack.Qwen35ContinuePrefill.execute(prefill=pf, prompt="What is in <image>?", images=images,
                                                 previous_answer=None, thinking=False, max_pixels=0)
        return out.ui["qwen35_prefill"][0]["note"]

    assert note(image) == ""
    for _ in range(2):  # read, then answered by the prefix cache
        assert "pixel values run from" in note(image * 255) and "divide it by 255" in note(image * 255)
    small = pack.Qwen35ContinuePrefill.execute(prefill=pf, prompt="What is in <image>?", images=image * 255,
                                               previous_answer=None, thinking=False, max_pixels=256 * 256)
    s = small.ui["qwen35_prefill"][0]
    assert s["vision_tokens"] > 0 and "pixel values run from" in s["note"]


def test_a_value_of_another_kind_on_a_link_is_named(pack, loaded):
    """An output typed '*' (another pack's switch or reroute) passes any value past ComfyUI's type check: the node
    names what it got and what to connect, instead of failing with an AttributeError."""
    from qwen35_fast.runtime import Qwen35Error
    with pytest.raises(Qwen35Error, match=r"the model input got a str, not a Qwen3\.5 model; connect .*Model Loader"):
        pack.Qwen35TextPrefill.execute(model="qwen35-demo", prompt="Hi", system_prompt="", thinking=False,
                                       use_chat_template=True)
    with pytest.raises(Qwen35Error, match=r"the model input got a NoneType, not a Qwen3\.5 model"):
        pack.Qwen35MultimodalPrefill.execute(model=None, prompt="Hi")
    pf = _prefill(pack, loaded)
    with pytest.raises(Qwen35Error, match=r"the prefill input got a str, not a Qwen3\.5 prefill; connect .*Text "
                                          r"Prefill, Multimodal Prefill or Continue"):
        listed(pack.Qwen35Generate, prefill=[pf, "a caption"], max_new_tokens=2, sampling=False, temperature=0.7,
               top_k=20, top_p=0.8, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, seed=0)
    with pytest.raises(Qwen35Error, match=r"the prefill input got a ModelHandle, not a Qwen3\.5 prefill"):
        pack.Qwen35ContinuePrefill.execute(prefill=loaded, prompt="And then?")
    # the right kinds still run
    assert listed(pack.Qwen35Generate, prefill=pf, max_new_tokens=2, sampling=False, temperature=0.7, top_k=20,
                  top_p=0.8, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, seed=0)[0]


def test_a_reload_of_let_go_weights_shows_progress_and_cancels_cleanly(pack, loaded, comfy, monkeypatch):
    """Weights let go where RAM was short are read again by the next run's load: its Cancel lands between the
    weights (none stay half-read: the model counts as let go, and the run after it reads them all), and the
    node's progress bar follows the read."""
    pf = _prefill(pack, loaded)
    text = _generate(pack, pf, seed=3, sampling=False)[0][0]
    model, managed = loaded.model, loaded.managed
    import comfy.utils as cu
    bars = []

    class Bar(cu.ProgressBar):
        def update_absolute(self, value, total=None, preview=None):
            bars.append((value, total))
            super().update_absolute(value, total, preview)
    monkeypatch.setattr(cu, "ProgressBar", Bar)
    # (a model is let go only off its load device, where RAM is short: on this CPU-only machine the offload
    # device stands apart as "meta", so that the load to the CPU reads the weights again)
    monkeypatch.setattr(managed, "offload_device", torch.device("meta"))
    model.drop_weights("cpu")
    checks = interrupt_at(comfy, monkeypatch, 3)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        managed.partially_load(torch.device("cpu"))
    assert checks["n"] == 3 and model.weights_dropped and all(p.is_meta for p in model.parameters())
    assert not comfy.mm.processing_interrupted() and bars[-1][0] == 2  # two weights read before the third check
    bars.clear()
    managed.partially_load(torch.device("cpu"))
    assert not model.weights_dropped and bars and bars[-1][0] == bars[-1][1]
    assert _generate(pack, pf, seed=3, sampling=False)[0][0] == text
