"""ComfyUI runs its nodes under torch.inference_mode, so the IMAGE and VIDEO tensors a node gets are inference
tensors (no version counter, no autograd views). The multimodal prefill, a follow-up with an image and a prompt
that reuses the image take them as any other tensor, with the same result."""
import pytest
import torch
from test_vision_vs_transformers import TOWERS, _image, _make

from qwen35_fast.runtime import continue_prefill, prefill_multimodal
from qwen35_fast.runtime.multimodal import VISION_END

from _models import rel


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("inference"), TOWERS["d2w32h2"], seed=5)[1]


def test_inference_mode_images_and_video(model):
    image, frames = _image(64, 96, 1), torch.rand(4, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        image_i, frames_i = image.clone(), frames.clone()
    assert image_i.is_inference() and frames_i.is_inference()
    model.setup_kv()
    want = prefill_multimodal(model, "What is it?", images=image, video=(frames, 2.0), system_prompt="Be brief.")
    model.setup_kv()
    got = prefill_multimodal(model, "What is it?", images=image_i, video=(frames_i, 2.0), system_prompt="Be brief.")
    assert got.token_ids == want.token_ids and rel(got.logits, want.logits) <= 1e-6
    with torch.inference_mode():  # as ComfyUI calls the nodes: the second question reuses the image
        again = prefill_multimodal(model, "And the colour?", images=image_i[0:1], video=(frames_i, 2.0),
                                   system_prompt="Be brief.")
        follow = continue_prefill(model, again, "Why?", images=image_i)
        cold = prefill_multimodal(model, "And the colour?", images=image_i[0:1], video=(frames_i, 2.0),
                                  system_prompt="Be brief.", use_cache=False)
        follow_cold = continue_prefill(model, again, "Why?", images=image_i, use_cache=False)
    # resumed after the image and the video (their last <|vision_end|>), not just after the system prompt: the
    # inference tensors (a new view of the image among them) keyed by their content as the first time
    ids = list(again.token_ids)
    assert again.cached_tokens == len(ids) - ids[::-1].index(VISION_END) and cold.cached_tokens == 0
    assert rel(again.logits, cold.logits) <= 1e-4
    assert follow.n_tokens > again.n_tokens and follow.vision.vision_tokens > 0
    assert follow.cached_tokens == again.turn.length and rel(follow.logits, follow_cold.logits) <= 1e-4
