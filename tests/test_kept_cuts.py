"""The GDN states at a prefill's cuts in the kernels' two forms (runtime/model.py cut_form): kept (the prompt's own
walk keeps the state at each cut's chunk boundary, one packed call walks each cut's rest of its chunk from there
for several layers at once) and packed (one call walks the prompt and each prefix again), against the recurrence
run part by part: the conv states bit for bit, outputs and recurrent states within fp32 rounding; and whole
prefills that keep states, and prompts that reuse them, as with the parts. The forms run on the CUDA kernels;
here they are forced onto the CPU's references (the GPU tests run them on the kernels)."""
from types import SimpleNamespace

import pytest
import torch
from test_vision_vs_transformers import SMALL, TOWERS, _image, _make

from qwen35_fast import kernels
from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime import prefill, prefill_multimodal
from qwen35_fast.runtime.config import LINEAR
from qwen35_fast.runtime.media import preprocess_images
from qwen35_fast.runtime.model import PACKED_CUT_TOKENS, GDNState, KeptCuts, PackedCuts, cut_form

from _models import rel

TORCH = kernels.Backend("torch", "test")
CUDA = kernels.Backend("cuda", "test")
SYSTEM = "You describe pictures for a painter. Answer in one short sentence, naming colours and shapes."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("kept"), TOWERS["d2w32h2"], seed=11)[1]


def _gdn_layer(model):
    i = next(i for i, blk in enumerate(model.blocks) if blk.kind == LINEAR)
    return i, model.blocks[i].mixer


def _cache(model, warm: bool, seed: int):
    """A stand-in with the conv / recurrent state lists _gdn_prefill reads and writes: empty, or random
    states as a continued prompt has them."""
    n = len(model.blocks)
    cache = SimpleNamespace(conv=[None] * n, ssm=[None] * n)
    if warm:
        g = torch.Generator().manual_seed(seed)
        c = model.config
        i, m = _gdn_layer(model)
        cache.conv[i] = torch.randn(1, c.conv_dim, m.conv_w.shape[1] - 1, generator=g)
        cache.ssm[i] = torch.randn(1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                   generator=g) * 0.1
    return cache


FORMS = {"kept": lambda cuts, T: KeptCuts.plan(cuts, CUDA, "cpu"),
         "packed": lambda cuts, T: PackedCuts.build(cuts, T, "cpu")}


def _spy(monkeypatch, form: str) -> list:
    """Counts the form's runs (else a test would compare the parts with themselves)."""
    name = f"_gdn_prefill_{form}"
    calls, real = [], getattr(model_mod.Qwen35Model, name)
    monkeypatch.setattr(model_mod.Qwen35Model, name, lambda self, *a: calls.append(1) or real(self, *a))
    return calls


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("cuts", [(1,), (2, 3), (5, 64, 65, 100), (63,), (129,), (64, 128), (1, 2, 3, 4, 5, 6, 7, 129)])
@pytest.mark.parametrize("warm", [False, True])
def test_each_form_gives_the_states_of_the_parts(model, form, cuts, warm, monkeypatch):
    i, m = _gdn_layer(model)
    calls = _spy(monkeypatch, form)
    T, n = 130, len(model.blocks)
    x = torch.randn(1, T, model.config.hidden_size, generator=torch.Generator().manual_seed(len(cuts) + 7 * warm))
    parts, formed = _cache(model, warm, 3), _cache(model, warm, 3)
    cut_parts = [(c, GDNState([None] * n, [None] * n, c)) for c in cuts]
    cut_formed = [(c, GDNState([None] * n, [None] * n, c)) for c in cuts]
    with torch.inference_mode():
        want = model._gdn_prefill(m, x, parts, i, TORCH, cut_parts)
        assert not calls  # the parts, one by one
        f = FORMS[form](cuts, T)
        got = model._gdn_prefill(m, x, formed, i, TORCH, cut_formed, f)
        if isinstance(f, KeptCuts):
            f.walk_tails(model, TORCH)  # as _layers does after the last layer
    assert calls == [1], f"the {form} form did not run"
    assert got.shape == want.shape and rel(got, want) < 1e-5
    assert torch.equal(formed.conv[i], parts.conv[i]) and rel(formed.ssm[i], parts.ssm[i]) < 1e-5
    for (c, a), (_, b) in zip(cut_formed, cut_parts):
        assert a.conv[i].shape == b.conv[i].shape and torch.equal(a.conv[i], b.conv[i]), f"conv state at {c}"
        assert a.ssm[i].shape == b.ssm[i].shape and rel(a.ssm[i], b.ssm[i]) < 1e-5, f"recurrent state at {c}"


def test_the_form_is_packed_on_hopper_cards_within_the_budget_else_kept(monkeypatch):
    assert cut_form((10, 50), 100, TORCH, "cpu") is None  # the PyTorch path: the parts
    assert cut_form((), 100, CUDA, "cpu") is None
    assert isinstance(cut_form((10, 50), 100, CUDA, "cpu"), KeptCuts)  # not a Hopper card: kept
    monkeypatch.setattr(kernels, "hopper_card", lambda device: True)
    # the prompt and the prefixes walked again: at most PACKED_CUT_TOKENS in all
    assert isinstance(cut_form((10, 50), PACKED_CUT_TOKENS - 60, CUDA, "cpu"), PackedCuts)
    assert isinstance(cut_form((10, 50), PACKED_CUT_TOKENS - 59, CUDA, "cpu"), KeptCuts)
    assert cut_form(tuple(range(1, 10)), 6000, CUDA, "cpu") is None  # more cuts than the walk keeps: the parts
    p = cut_form((10, 50), 100, CUDA, "cpu")
    assert p.cuts == (10, 50) and p.cu_seqlens.tolist() == [0, 100, 110, 160]
    assert p.ends.tolist() == [10, 50]  # where the conv states are gathered


def test_the_kept_form_is_planned_on_the_kernels():
    assert KeptCuts.plan((10, 50), TORCH, "cpu") is None  # the PyTorch path: the parts (its keep would cut the walk)
    assert KeptCuts.plan((), CUDA, "cpu") is None
    assert KeptCuts.plan(tuple(range(1, 10)), CUDA, "cpu") is None  # more cuts than the walk keeps states: the parts
    p = KeptCuts.plan((10, 64, 200, 250), CUDA, "cpu")
    assert p.cuts == (10, 64, 200, 250) and p.bounds == (0, 64, 192, 192)
    assert p.tails == ((0, 10), (192, 200), (192, 250)) and p.cu_tails.tolist() == [0, 10, 18, 76]
    assert p.tailed.tolist() == [0, 2, 3]
    assert p.tail_rows.tolist() == [*range(0, 10), *range(192, 200), *range(192, 250)]
    assert p.ends.tolist() == [10, 64, 200, 250]  # where the conv states are gathered
    p = KeptCuts.plan((64, 128), CUDA, "cpu")
    assert p.tails == () and p.cu_tails is None and p.tailed is None and p.tail_rows is None  # the walk's alone


@pytest.mark.parametrize("form, tail_layers", [("kept", 1), ("kept", 2), ("kept", 8), ("packed", 8)])
def test_prefills_that_keep_states_and_reuse_them_as_with_the_parts(model, form, tail_layers, monkeypatch):
    """A system prompt, an image and two questions: the first prompt keeps its states through the form, the second
    reuses them; the logits and the kept states as when the parts run one by one. The kept form's tails of the
    model's three GDN layers walked a layer a call, two and then one, and all three in one call (layers as heads)."""
    monkeypatch.setattr(model_mod, "TAIL_LAYERS", tail_layers)
    image = preprocess_images(_image(64, 96, 7), SMALL)

    def run():
        model.setup_kv()  # a fresh store
        first = prefill_multimodal(model, "What colour is it?", images=image, system_prompt=SYSTEM)
        second = prefill_multimodal(model, "How many shapes are there?", images=image, system_prompt=SYSTEM)
        text = prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
        return first, second, text

    parts = run()
    monkeypatch.setattr(model_mod, "cut_form", lambda cuts, T, be, device: FORMS[form](cuts, T) if cuts else None)
    calls = _spy(monkeypatch, form)
    formed = run()
    assert calls, f"the {form} form did not run"
    for a, b in zip(formed, parts):
        assert a.token_ids == b.token_ids and a.cached_tokens == b.cached_tokens
        assert rel(a.logits, b.logits) <= 1e-5
        # the prefill (cached by ComfyUI) holds its own states, not views of the form's states of every cut
        ssm = [t for t in a.cache.ssm if t is not None]
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ssm}
        assert sum(held.values()) == sum(t.nbytes for t in ssm)
    assert formed[1].cached_tokens > 0  # the second question reused the first one's image


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["kept", "packed"])
def test_on_the_kernels_each_form_matches_the_parts(tmp_path_factory, monkeypatch, form):
    """The CUDA path (bf16; kept: the walk keeping states and the tails' packed call; packed: the prompt and each
    prefix in one call): the logits and every kept state as the parts give them (the first GDN layer's conv states
    bit for bit, as its input is the same; the rest within bf16 rounding, since the layers before differ by it;
    the same greedy token)."""
    from _models import kernels_model
    model = kernels_model(tmp_path_factory.mktemp(f"{form}_gpu"), seed=9)
    make = {"kept": lambda cuts, T, device: KeptCuts.plan(cuts, CUDA, device),
            "packed": lambda cuts, T, device: PackedCuts.build(cuts, T, device)}[form]
    g = torch.Generator().manual_seed(4)
    for T, cuts in ((300, [37, 200, 296]), (80, [1, 2, 79]), (1000, [64, 900]), (2000, [128, 1024, 1920]),
                    (5000, [200, 4935, 4995])):
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g).cuda()
        with monkeypatch.context() as m:
            m.setattr(model_mod, "cut_form", lambda cuts, T, be, device: None)  # the parts
            want, want_kept = model.forward_prefill_kept(ids, model.new_cache(1, T), cuts)
        with monkeypatch.context() as m:
            m.setattr(model_mod, "cut_form", lambda cuts, T, be, device: make(cuts, T, device))
            calls = _spy(m, form)
            got, got_kept = model.forward_prefill_kept(ids, model.new_cache(1, T), cuts)
        assert calls, f"the {form} form did not run"
        assert torch.isfinite(got).all() and rel(got, want) <= 2e-2 and got.argmax() == want.argmax()
        assert len(got_kept) == len(want_kept) == len(cuts)
        first = next(i for i, x in enumerate(want_kept[0].conv) if x is not None)
        for a, b in zip(got_kept, want_kept):
            assert a.length == b.length and torch.equal(a.conv[first], b.conv[first])
            for x, y in zip(a.conv, b.conv):
                assert (x is None and y is None) or rel(x, y) <= 2e-2
            for x, y in zip(a.ssm, b.ssm):
                assert (x is None and y is None) or rel(x, y) <= 2e-2
