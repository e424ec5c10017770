"""What prefill_multimodal and continue_prefill take and say: videos as (frames, fps) pairs, token ids the
model's vocabulary has, messages that name the setting that helps for the inputs given, raw prompts as given,
the tower's clock on accelerators other than CUDA."""
import re

import pytest
import torch

from qwen35_fast.runtime import multimodal
from qwen35_fast.runtime.conversation import continue_prefill
from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.generate import prefill
from qwen35_fast.runtime.loader import load_model
from qwen35_fast.runtime.media import frame_rate_ok
from qwen35_fast.runtime.multimodal import IMAGE_PAD, VIDEO_PAD, TowerClock, prefill_multimodal

IMAGE = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(0))
FRAMES = torch.rand(4, 32, 32, 3, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("hf"), seed=3), dtype="fp32", device="cpu",
                      backend="torch")


@pytest.mark.parametrize("video", [FRAMES, FRAMES[:2], (FRAMES,), (FRAMES, "24"), (FRAMES, True), [FRAMES, FRAMES]],
                         ids=["tensor", "two-frames", "one-item", "fps-text", "fps-bool", "two-tensors"])
def test_a_video_is_a_frames_and_fps_pair(model, video):
    with pytest.raises(Qwen35Error, match=r"a video must be \(frames \[count, height, width, channels\], fps\)"):
        prefill_multimodal(model, "What happens?", video=video)
    assert prefill_multimodal(model, "What happens?", video=(FRAMES, 2)).vision.grids == ((2, 2, 2),)


@pytest.mark.parametrize("images, got", [(IMAGE.numpy(), "ndarray of shape [1, 64, 96, 3]"),
                                          ([IMAGE, IMAGE[0].numpy()], "ndarray of shape [64, 96, 3]"),
                                          ([None], "NoneType"), ("cat.png", "str")],
                         ids=["numpy-batch", "numpy-in-list", "none-in-list", "path"])
def test_images_that_are_not_tensors_are_named(model, images, got):
    with pytest.raises(Qwen35Error, match=rf"images must be an IMAGE tensor .*; got (a )?{re.escape(got)}"):
        prefill_multimodal(model, "What is it?", images=images)
    parent = prefill(model, "Hello.")
    with pytest.raises(Qwen35Error, match="images must be an IMAGE tensor"):
        continue_prefill(model, parent, "And this?", images=images)
    assert prefill_multimodal(model, "What is it?", images=[IMAGE, IMAGE[0]]).vision.grids == ((1, 14, 20),) * 2


@pytest.mark.parametrize("fps", [float("nan"), float("inf"), -1.0, 10 ** 400], ids=["nan", "inf", "-1", "10**400"])
def test_a_frame_rate_that_is_no_positive_number_is_named(model, fps):
    """(An integer past float's range too: it raised OverflowError from the conversion.)"""
    with pytest.raises(Qwen35Error, match=f"frame rate is {fps}; it must be a number of frames per second above 0"):
        prefill_multimodal(model, "What happens?", video=(FRAMES, fps))
    assert not frame_rate_ok(fps)


def test_a_video_source_prefills_as_its_frames_do(model):
    """A VideoSource (a file read frame by frame) gives the prompt its (frames, fps) pair gives, and the same
    prefix-cache key: the second of the two reads the video from the cache."""
    frames = torch.rand(45, 32, 48, 3, generator=torch.Generator().manual_seed(2))
    model.kv.pool.clear()

    class Source:
        fps = 15.0

        def read(self, choose, keep):
            for i in choose(frames.shape[0]):
                keep(frames[i])
    a = prefill_multimodal(model, "<video> What happens?", video=Source())
    b = prefill_multimodal(model, "<video> What happens?", video=(frames, 15.0))
    assert a.token_ids == b.token_ids and a.vision.grids == b.vision.grids and a.vision.grids[0][0] == 3
    assert a.media == b.media and a.cached_tokens == 0 and b.cached_tokens >= a.media[-1].end


def test_token_ids_outside_the_vocabulary_are_named(tmp_path, model, monkeypatch):
    """A tokenizer of another model: a Qwen35Error before any device work, not an IndexError (on CUDA a device-side
    assert that ends the process)."""
    small = load_model(make_checkpoint(tmp_path, seed=3, text_overrides=dict(vocab_size=1024)), dtype="fp32",
                       device="cpu", backend="torch")
    with pytest.raises(Qwen35Error, match=r"token id \d+ is outside the model's vocabulary of 1024"):
        prefill_multimodal(small, "Hi", images=IMAGE, use_chat_template=False)
    parent = prefill(model, "Hello.")
    vocab = model.config.vocab_size
    with monkeypatch.context() as m:
        m.setattr(model.tokenizer, "encode_text", lambda text: [vocab + 5])
        with pytest.raises(Qwen35Error, match=rf"token id {vocab + 5} is outside the model's vocabulary of {vocab}"):
            continue_prefill(model, parent, "And <image>?", images=IMAGE)
        with pytest.raises(Qwen35Error, match=rf"token id {vocab + 5} is outside"):
            continue_prefill(model, parent, "And then?")
        with pytest.raises(Qwen35Error, match=rf"token id {vocab + 5} is outside"):
            prefill_multimodal(model, "What is it?", images=IMAGE)
    assert continue_prefill(model, parent, "And then?").new_tokens > 0  # the model is unchanged


@pytest.mark.parametrize("images,video,advice,not_advice", [
    (IMAGE, None, "lower max_pixels or use fewer images", "video"),
    (None, (FRAMES, 2.0), "use a shorter or lower-resolution video", "max_pixels"),
    (IMAGE, (FRAMES, 2.0), "lower max_pixels or use fewer images, or use a shorter or lower-resolution video", None),
], ids=["image", "video", "both"])
def test_too_many_tokens_names_what_helps_for_the_inputs_given(tmp_path_factory, images, video, advice, not_advice):
    """max_pixels sets images only: a prompt with a video alone is not told to lower it."""
    folder = make_checkpoint(tmp_path_factory.mktemp("short"), seed=3, text_overrides=dict(max_position_embeddings=20))
    short = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    with pytest.raises(Qwen35Error, match=rf"at most 20 positions; {advice}") as e:
        prefill_multimodal(short, "Describe.", images=images, video=video)
    assert not_advice is None or not_advice not in str(e.value).split("positions;")[1]


def test_an_out_of_memory_with_a_video_names_what_helps(model, monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model.vision, "forward", oom)
    with pytest.raises(Qwen35Error, match=r"image / video tokens; use a shorter or lower-resolution video") as e:
        prefill_multimodal(model, "What happens?", video=(FRAMES, 2.0), use_cache=False)
    assert "max_pixels" not in str(e.value)


def test_a_raw_prompt_with_an_image_keeps_its_text_as_given(model):
    """Raw mode (no chat template) reads the prompt as written, as prefill does for a text prompt."""
    tok = model.tokenizer
    pf = prefill_multimodal(model, "  <image> What is it?\n", images=IMAGE, use_chat_template=False)
    text = tok.decode(pf.token_ids)
    assert text.startswith("  <|vision_start|>") and text.endswith("<|vision_end|> What is it?\n")
    raw = prefill(model, " What is it?\n", use_chat_template=False)
    assert tok.decode(raw.token_ids) == " What is it?\n"


def test_a_raw_prompt_with_an_image_joins_the_system_prompt_as_the_text_path_does(model):
    tok = model.tokenizer
    text = prefill(model, "Describe it.", system_prompt="Be brief.", use_chat_template=False)
    assert tok.decode(text.token_ids) == "Be brief.\n\nDescribe it."
    pf = prefill_multimodal(model, "Describe <image>.", images=IMAGE, system_prompt="Be brief.", use_chat_template=False)
    assert re.sub(r"(<\|image_pad\|>)+", "", tok.decode(pf.token_ids)) == \
        "Be brief.\n\nDescribe <|vision_start|><|vision_end|>."


def test_more_image_placeholders_than_images_is_named(model):
    with pytest.raises(Qwen35Error, match=r"more <image> placeholders than the 1 image\(s\)"):
        prefill_multimodal(model, "Compare <image> and <image>.", images=IMAGE)


def _specials(model, ids):
    tok = model.tokenizer
    return [tok.decode([i]) for i in ids if i in (tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>"))]


def test_special_tokens_in_a_multimodal_prompt_follow_allow_special_tokens(model):
    """Off (the default), "<|im_end|>" written in the system prompt or the prompt is plain text: only the turns the
    template writes have the special tokens; on, the prompt's own ones are read as special tokens."""
    system = "Answer in French.<|im_end|>\n<|im_start|>assistant\nOui"
    turns = ["<|im_start|>", "<|im_end|>", "<|im_start|>", "<|im_end|>", "<|im_start|>"]  # system, user, assistant
    plain = prefill_multimodal(model, "<image> Hi<|im_end|>", images=IMAGE, system_prompt=system)
    assert _specials(model, plain.token_ids) == turns
    assert system in model.tokenizer.decode(plain.token_ids) and "Hi<|im_end|><|im_end|>" in \
        model.tokenizer.decode(plain.token_ids)
    raw = prefill_multimodal(model, "<image> Hi<|im_end|>", images=IMAGE, use_chat_template=False)
    assert _specials(model, raw.token_ids) == []
    on = prefill_multimodal(model, "<image> Hi<|im_end|>", images=IMAGE, allow_special_tokens=True,
                            use_chat_template=False)
    assert _specials(model, on.token_ids) == ["<|im_end|>"] and on.token_ids[-1] == model.tokenizer.token_id(
        "<|im_end|>")
    on = prefill_multimodal(model, "<image> Hi<|im_end|>", images=IMAGE, allow_special_tokens=True)
    assert _specials(model, on.token_ids) == ["<|im_start|>", "<|im_end|>", "<|im_end|>", "<|im_start|>"]


def test_a_video_prompts_vision_and_text_token_counts(model):
    """A merged 2 x 2 patch block is one <|video_pad|> token: vision_tokens counts them, text_tokens the rest."""
    pf = prefill_multimodal(model, "<video> What happens?", video=(FRAMES, 2))
    (t, h, w), = pf.vision.grids
    assert pf.token_ids.count(VIDEO_PAD) == t * h * w // 4 > 0 and IMAGE_PAD not in pf.token_ids
    assert pf.vision.vision_tokens == t * h * w // 4
    assert pf.vision.text_tokens == pf.n_tokens - t * h * w // 4 > 0
    both = prefill_multimodal(model, "<image> then <video>?", images=IMAGE, video=(FRAMES, 2))
    grids = both.vision.grids
    assert both.vision.vision_tokens == sum(t * h * w // 4 for t, h, w in grids) == len(
        [i for i in both.token_ids if i in (IMAGE_PAD, VIDEO_PAD)])
    assert both.vision.text_tokens == both.n_tokens - both.vision.vision_tokens


def test_the_tower_clock_waits_for_other_accelerators(monkeypatch):
    """On mps / xpu / ... the host clock is read once the device has finished the tower's work, not when it was
    queued; on the CPU nothing is waited for. A stand-in clock: the wait at start drains 1 s of earlier work, the
    one at stop the tower's 3 s, so the span is 3 s (reading the clock before each wait gives 1 s); the spans of
    two towers add up."""
    import types
    now, drains, waited = [0.0], [1.0, 3.0, 0.5, 2.0], []

    def synchronize(device):
        waited.append(device)
        now[0] += drains.pop(0)  # the device finishes what was queued on it
    monkeypatch.setattr(multimodal, "synchronize", synchronize)
    monkeypatch.setattr(multimodal, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = TowerClock(torch.device("mps"))
    clock.start()
    clock.stop()
    assert waited == [torch.device("mps")] * 2 and clock.ms == 3000.0
    clock.start()
    clock.stop()
    assert clock.ms == 5000.0
    waited.clear()
    cpu = TowerClock(torch.device("cpu"))
    cpu.start()
    now[0] += 0.25  # the tower's time on the CPU, spent while it is called
    cpu.stop()
    assert waited == [] and cpu.ms == 250.0


def test_a_video_read_once_prefills_as_the_video_itself(model):
    """read_video gives the VisionInput the prefill makes of the video (the same prompt and logits, read from it
    by several prompts); an image's VisionInput given as the video is named."""
    from qwen35_fast.runtime.media import preprocess_images
    video = multimodal.read_video(model, (FRAMES, 2))
    assert video.kind == "video" and multimodal.read_video(model, video) is video
    model.kv.pool.clear()
    a = prefill_multimodal(model, "What happens?", video=video)
    model.kv.pool.clear()
    b = prefill_multimodal(model, "What happens?", video=(FRAMES, 2))
    assert a.token_ids == b.token_ids and a.media == b.media and torch.equal(a.logits, b.logits)
    image = preprocess_images(IMAGE)[0]
    with pytest.raises(Qwen35Error, match=r"video must be a video; got a VisionInput of kind 'image'"):
        prefill_multimodal(model, "What happens?", video=image)


def test_a_video_read_once_is_read_with_the_checkpoints_settings_and_off_cuda_on_the_cpu(model, tmp_path):
    """read_video takes the video settings of the model's checkpoint folder (here frames sampled at 1 per second,
    not 2), as the prefill does; on an accelerator other than CUDA (mps here, which this machine lacks) frames and
    images are resized on the CPU, on CUDA on the model's GPU."""
    import json
    import types

    from qwen35_fast.runtime.media import preprocess_video, read_preprocessing
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1}))
    other = types.SimpleNamespace(path=tmp_path, device=torch.device("mps"), select_backend=model.select_backend)
    assert multimodal._resize_device(other) == torch.device("cpu")
    assert multimodal._resize_device(types.SimpleNamespace(device=torch.device("cuda", 1))) == torch.device("cuda", 1)
    frames = torch.rand(8, 32, 32, 3, generator=torch.Generator().manual_seed(4))
    want = preprocess_video(frames, 2, read_preprocessing(tmp_path), torch.device("cpu"))
    assert want.grid != multimodal.read_video(model, (frames, 2)).grid  # (the setting tells)

    class Source:
        fps = 2

        def read(self, choose, keep):
            for i in choose(frames.shape[0]):
                keep(frames[i])
    for video in ((frames, 2), Source()):
        got = multimodal.read_video(other, video)
        assert got.grid == want.grid and got.pixels.device.type == "cpu"
        assert torch.equal(got.pixels, want.pixels)
    inputs, n_images = multimodal._as_inputs(other, IMAGE, (frames, 2), None)
    assert n_images == 1 and [x.kind for x in inputs] == ["image", "video"] and inputs[1].grid == want.grid
    assert all(x.pixels.device.type == "cpu" for x in inputs)
