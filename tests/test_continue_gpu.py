"""Follow-up turns on the GPU: continue_prefill on the CUDA kernels (GDN from the cached states, attention
over the cached K/V) against the whole conversation prefilled in one go."""

import pytest

from qwen35_fast.runtime import (
    SamplingParams,
    continue_prefill,
    generate,
    prefill,
    prefill_ids,
)

from _models import forced_logits, kernels_model, rel

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(do_sample=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return kernels_model(tmp_path_factory.mktemp("continue_gpu"), seed=6)


@pytest.mark.parametrize("thinking", [False, True])
def test_continued_prefill_equals_one_go_on_the_kernels(model, thinking):
    parent = prefill(model, "Write a short poem about the sea. " * 20, system_prompt="Be brief.", thinking=thinking)
    answer = generate(model, parent, max_new_tokens=40, sampling=GREEDY)
    child = continue_prefill(model, parent, "Now one about mountains.", previous_answer=answer.text,
                             thinking=thinking)
    assert child.cached_tokens == parent.turn.length and child.new_tokens < child.n_tokens
    # cold: the prefix cache holds the child's own turn-end snapshot, which would make this the child again
    one_go = prefill_ids(model, list(child.token_ids), thinking=thinking, use_cache=False)
    assert one_go.cached_tokens == 0
    err = rel(child.logits, one_go.logits)
    assert err < 2e-2, err
    # decoding from either reads the same cache contents: the same tokens give the same logits
    a = generate(model, child, max_new_tokens=16, sampling=GREEDY)
    tokens = list(a.token_ids) or [int(child.logits.argmax())]
    assert rel(forced_logits(model, child, tokens), forced_logits(model, one_go, tokens)) < 2e-2
    grandchild = continue_prefill(model, child, "And one about rivers.", previous_answer=a.text)
    again = prefill_ids(model, list(grandchild.token_ids), use_cache=False)
    assert rel(grandchild.logits, again.logits) < 2e-2
    tokens = list(generate(model, grandchild, max_new_tokens=16, sampling=GREEDY).token_ids) or [0]
    assert rel(forced_logits(model, grandchild, tokens), forced_logits(model, again, tokens)) < 2e-2


def test_kernels_and_pytorch_path_agree_on_a_follow_up(model):
    parent = prefill(model, "List five fruits.")
    child = continue_prefill(model, parent, "Which is the sweetest?", previous_answer="Apple, pear, fig, kiwi, plum.")
    model.set_backend("torch")
    try:
        # use_cache off: else the kernels' own snapshot of this turn serves it and the PyTorch path reads 7 tokens
        ref = continue_prefill(model, parent, "Which is the sweetest?", previous_answer="Apple, pear, fig, kiwi, plum.",
                               use_cache=False)
    finally:
        model.set_backend("cuda")
    assert ref.cached_tokens == parent.turn.length == child.cached_tokens
    assert child.token_ids == ref.token_ids and rel(child.logits, ref.logits) < 2e-2


def test_a_parent_parked_in_ram_continues_the_same(model):
    """ComfyUI parks cached prefills (and their turn state) in RAM when it unloads the model."""
    parent = prefill(model, "Name a colour.")
    on_gpu = continue_prefill(model, parent, "Another one?", previous_answer="Blue.")
    parent.cache.to("cpu")
    parent.turn.to("cpu")
    model.kv.pool.clear()  # else on_gpu's own turn-end snapshot serves it (another split of the same work)
    parked = continue_prefill(model, parent, "Another one?", previous_answer="Blue.")
    assert all(t.device.type == "cuda" for t in parked.cache.conv + parked.cache.ssm if t is not None)
    assert rel(parked.logits, on_gpu.logits) < 1e-3


def test_a_follow_up_with_an_image_on_the_kernels(model):
    """The tower's tokens in a follow-up, at rotary positions continuing the parent's: kernels vs PyTorch path,
    and the continued prefill vs the first turn read with the image in one go."""
    import torch

    from qwen35_fast.runtime import prefill_multimodal
    from qwen35_fast.runtime.media import Preprocessing, preprocess_images
    pp = Preprocessing(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 12)
    image = preprocess_images(torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(3)), pp, "cuda")
    parent = prefill(model, "I will show you a picture.")
    child = continue_prefill(model, parent, "Here: <image> What is it?", images=image, previous_answer="Go ahead.")
    assert child.vision.vision_tokens == image[0].n_tokens() and child.cache.rope_delta < 0
    model.set_backend("torch")
    try:
        ref = continue_prefill(model, parent, "Here: <image> What is it?", images=image, previous_answer="Go ahead.",
                               use_cache=False)  # (else the kernels' snapshot after the image serves it)
    finally:
        model.set_backend("cuda")
    assert ref.cached_tokens == parent.turn.length and ref.vision.vision_tokens == image[0].n_tokens()
    assert rel(child.logits, ref.logits) < 2e-2
    # an image in the first turn, then a text follow-up that reuses it (read once, by the first turn)
    first = prefill_multimodal(model, "What is it?", images=image)
    follow = continue_prefill(model, first, "And its colour?", previous_answer="A picture.")
    assert follow.cached_tokens == first.turn.length and follow.vision is None
    assert generate(model, follow, max_new_tokens=8, sampling=GREEDY).n_tokens >= 1
