"""Images and video remembered by tensor (multimodal.InputMemo): a prompt with the same IMAGE tensor as an
earlier one skips the upload, the resize and the hash; anything that may change the patches (an in-place
edit, other settings, another view) preprocesses again; nothing outlives the tensor; and a prefill from a
remembered input gives the logits of a fresh one."""
import gc
from types import SimpleNamespace

import pytest
import torch
from test_vision_vs_transformers import TOWERS, _image, _make

from qwen35_fast import kernels
from qwen35_fast.runtime import multimodal, prefill_multimodal
from qwen35_fast.runtime.multimodal import InputMemo, _as_inputs
from qwen35_fast.runtime.prefix import content_hash

from _models import rel

TORCH = kernels.Backend("torch", "test")


@pytest.fixture
def counted(monkeypatch):
    """A fresh memo, and how often images / video were preprocessed."""
    calls = {"image": 0, "video": 0}
    real_i, real_v = multimodal.preprocess_images, multimodal.preprocess_video

    def images(*a, **k):
        calls["image"] += 1
        return real_i(*a, **k)

    def video(*a, **k):
        calls["video"] += 1
        return real_v(*a, **k)
    monkeypatch.setattr(multimodal, "preprocess_images", images)
    monkeypatch.setattr(multimodal, "preprocess_video", video)
    monkeypatch.setattr(multimodal, "INPUT_MEMO", InputMemo())
    return calls


def _stub():
    return SimpleNamespace(path=None, device=torch.device("cpu"), select_backend=lambda: TORCH)


def test_the_same_tensor_is_preprocessed_once(counted):
    model, batch = _stub(), torch.cat([_image(64, 96, 1), _image(64, 96, 2)])
    first, n = _as_inputs(model, batch, None, None)
    assert n == 2 and counted["image"] == 1
    assert [i.digest for i in first] == [content_hash(i.pixels, TORCH) for i in first]
    again, _ = _as_inputs(model, batch, None, None)
    assert counted["image"] == 1, "the second prompt preprocessed the same tensor again"
    assert all(i.pixels is None for i in again)
    assert [(i.digest, i.grid, i.source_size, i.n_patches) for i in again] == \
           [(i.digest, i.grid, i.source_size, i.pixels.shape[0]) for i in first]
    # the tower needs the patches: made once for the whole batch, equal to the first ones
    assert torch.equal(again[1].patches(), first[1].pixels) and torch.equal(again[0].patches(), first[0].pixels)
    assert counted["image"] == 2


def test_anything_that_may_change_the_patches_preprocesses_again(counted):
    model, batch = _stub(), torch.cat([_image(64, 96, 3), _image(64, 96, 4)])
    base, _ = _as_inputs(model, batch, None, None)
    _as_inputs(model, batch, None, 16_384)  # other settings (max_pixels)
    assert counted["image"] == 2
    _as_inputs(model, batch[1:], None, None)  # another view of the same tensor
    assert counted["image"] == 3
    _as_inputs(model, batch[1:], None, None)  # that view again (the per-image mode slices anew each run)
    assert counted["image"] == 3
    batch[0, 0, 0, 0] = 1 - batch[0, 0, 0, 0]  # an in-place edit
    edited, _ = _as_inputs(model, batch, None, None)
    assert counted["image"] == 4 and edited[0].pixels is not None and edited[0].digest != base[0].digest
    assert edited[1].digest == base[1].digest  # the image not edited keeps its content hash
    assert _as_inputs(model, batch.clone(), None, None)[0][0].pixels is not None  # a copy is another tensor
    assert counted["image"] == 5


def test_video_is_remembered_with_its_frame_rate(counted):
    model, frames = _stub(), torch.rand(6, 64, 64, 3, generator=torch.Generator().manual_seed(5))
    first = _as_inputs(model, None, (frames, 2.0), None)[0][0]
    again = _as_inputs(model, None, (frames, 2.0), None)[0][0]
    assert counted["video"] == 1 and again.pixels is None and again.digest == first.digest
    assert again.timestamps == first.timestamps and torch.equal(again.patches(), first.pixels)
    other = _as_inputs(model, None, (frames, 1.0), None)[0][0]
    assert counted["video"] == 3 and other.timestamps != first.timestamps


def test_nothing_is_kept_after_the_tensor(counted):
    model = _stub()
    image = _image(64, 64, 6)
    _as_inputs(model, image, None, None)
    assert len(multimodal.INPUT_MEMO) == 1
    del image
    gc.collect()
    assert len(multimodal.INPUT_MEMO) == 0


def test_a_prefill_from_a_remembered_image_gives_the_fresh_logits(tmp_path, counted):
    """The same image tensor under two system prompts: the second prompt's prefix differs before the image,
    so the tower runs on patches made again; its logits equal those of a fresh copy of the image."""
    model = _make(tmp_path, TOWERS["d2w32h2"], seed=3)[1]
    image = _image(64, 96, 7)
    prefill_multimodal(model, "What is it?", images=image, system_prompt="Answer briefly.")
    remembered = prefill_multimodal(model, "What is it?", images=image, system_prompt="Answer in detail.")
    assert counted["image"] == 2  # the first prompt, and the patches the tower needed for the second
    model.setup_kv()  # nothing cached: the copy's prompt is read cold
    fresh = prefill_multimodal(model, "What is it?", images=image.clone(), system_prompt="Answer in detail.")
    assert remembered.token_ids == fresh.token_ids and remembered.cached_tokens == fresh.cached_tokens == 0
    assert rel(remembered.logits, fresh.logits) <= 1e-6
    # the same prompt again: the image is inside the cached prefix, nothing is preprocessed
    again = prefill_multimodal(model, "Something else?", images=image, system_prompt="Answer in detail.")
    assert counted["image"] == 3 and again.cached_tokens > 0
