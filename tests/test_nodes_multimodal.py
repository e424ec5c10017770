"""Qwen3.5 Multimodal Prefill through its V3 `execute` (ComfyUI importable from COMFYUI_DIR; skipped otherwise).

Runs on the CPU with the demo's tiny checkpoint, whose folder carries a small vision tower.
"""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
from fractions import Fraction

import pytest
import torch
from test_nodes import _generate, comfy, interrupt_at, listed, loaded, memory_asked, models_dir, pack, releases_counted  # noqa: F401  (fixtures)

pytestmark = pytest.mark.comfyui


def _run(pack, model, **kw):
    args = dict(model=model, prompt="Describe this image.", images=None, video=None, frames=None, frame_rate=24.0,
                mode="all images in one prompt", system_prompt="", thinking=False, max_pixels=0)
    args.update(kw)
    return pack.Qwen35MultimodalPrefill.execute(**args)


def test_schema_and_registration(pack):
    schema = pack.Qwen35MultimodalPrefill.GET_SCHEMA()
    assert pack.Qwen35MultimodalPrefill in pack.NODES
    assert schema.display_name == "Qwen3.5 Multimodal Prefill"
    inputs = pack.Qwen35MultimodalPrefill.INPUT_TYPES()
    assert {"model", "prompt"} <= set(inputs["required"])
    assert {"images", "video", "frames"} <= set(inputs["optional"])


def test_caption_one_image_then_generate(pack, loaded):
    out = _run(pack, loaded, images=torch.rand(1, 96, 128, 3))
    prefills = out[0]
    assert isinstance(prefills, list) and len(prefills) == 1
    s = out.ui["qwen35_prefill"][0]
    assert s["vision_tokens"] > 0 and s["text_tokens"] > 0 and s["vision_ms"] > 0 and s["prefill_ms"] > 0
    assert s["vision_tokens"] == sum(1 for t in prefills[0].prefill.token_ids if t == 248056)
    a = _generate(pack, prefills[0], seed=1, sampling=False)
    b = _generate(pack, prefills[0], seed=1, sampling=False)
    assert a[0] == b[0] and a.ui["qwen35_generate"][0]["n_tokens"] >= 1


def test_one_prompt_per_image_gives_a_list(pack, loaded):
    images = torch.rand(3, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    out = _run(pack, loaded, images=images, mode="one prompt per image")
    prefills = out[0]
    assert len(prefills) == 3 and len(out.ui["qwen35_prefill"]) == 3
    one = _run(pack, loaded, images=images[1:2])[0][0]
    # image 2 alone, as a prompt of its own: the same prompt, read again from the prefix cache
    assert one.prefill.cached_tokens > 0
    loaded.model.kv.pool.clear()  # and read cold: what the list's second prompt must equal
    cold = _run(pack, loaded, images=images[1:2])[0][0]
    assert cold.prefill.cached_tokens == 0 and cold.prefill.token_ids == prefills[1].prefill.token_ids
    for b in (one.prefill.logits, cold.prefill.logits):
        a = prefills[1].prefill.logits
        assert float((a - b).norm() / b.norm()) < 1e-4
    assert not torch.equal(prefills[0].prefill.logits, prefills[1].prefill.logits)
    both = _run(pack, loaded, images=images)[0]
    assert len(both) == 1 and both[0].prefill.vision.vision_tokens == 3 * one.prefill.vision.vision_tokens


def test_a_cancel_lands_between_the_prompts_of_a_batch(pack, loaded, comfy, monkeypatch):
    """One prompt per image: Cancel stops before the next image's prefill (not after the whole batch); the
    progress bar counts the prompts."""
    from qwen35_fast import runtime
    images = torch.rand(4, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    progress, done = [], []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, t, preview, node_id=None: progress.append((v, t)))
    real = runtime.prefill_multimodal
    monkeypatch.setattr(runtime, "prefill_multimodal", lambda *a, **k: done.append(1) or real(*a, **k))

    def interrupt_after_two():  # (model management asks too, while loading)
        if len(done) == 2:
            raise comfy.mm.InterruptProcessingException()
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", interrupt_after_two)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        _run(pack, loaded, images=images, mode="one prompt per image")
    assert len(done) == 2 and progress[0] == (1, 4)  # (ComfyUI's bar sends the first update, then throttles)


def test_video_input_and_frames_input(pack, loaded):
    from comfy_api.latest import InputImpl, Types
    frames = torch.rand(12, 64, 80, 3, generator=torch.Generator().manual_seed(1))
    video = InputImpl.VideoFromComponents(Types.VideoComponents(images=frames, frame_rate=Fraction(6)))
    a = _run(pack, loaded, prompt="<video> What moves?", video=video)
    b = _run(pack, loaded, prompt="<video> What moves?", frames=frames, frame_rate=6.0)
    assert a[0][0].prefill.token_ids == b[0][0].prefill.token_ids
    text = loaded.model.tokenizer.decode(a[0][0].prefill.token_ids)
    # 2 s at 2 fps: frames 0, 4, 7, 11 of 12 (0, 0.67, 1.17, 1.83 s) in two pairs at 0.33 s and 1.5 s
    assert "user\n<0.3 seconds><|vision_start|>" in text and "<|vision_end|><1.5 seconds><|vision_start|>" in text
    assert text.count("<|vision_start|>") == 2


def test_bad_input_messages(pack, loaded, models_dir, comfy):
    from qwen35_fast.runtime import Qwen35Error
    from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
    with pytest.raises(Qwen35Error, match="0x64 pixels.*at least 1"):
        _run(pack, loaded, images=torch.rand(1, 64, 0, 3))
    with pytest.raises(Qwen35Error, match="empty"):
        _run(pack, loaded, images=torch.rand(0, 64, 64, 3))
    with pytest.raises(Qwen35Error, match="empty"):
        _run(pack, loaded, images=torch.rand(0, 64, 64, 3), mode="one prompt per image")
    with pytest.raises(Qwen35Error, match="0 frames"):
        _run(pack, loaded, frames=torch.rand(0, 64, 64, 3), frame_rate=24.0)
    limit = loaded.model.config.max_position_embeddings
    with pytest.raises(Qwen35Error, match=rf"prompt has \d+ tokens, (\d+) of them image / video tokens.*at most "
                                          rf"{limit} positions"):
        _run(pack, loaded, images=torch.rand(1, 2048, 2048, 3))
    # huge image: scaled to max_pixels, and the node says so
    out = _run(pack, loaded, images=torch.rand(1, 600, 900, 3), max_pixels=256 * 384)
    assert out[0][0].prefill.vision.grids == ((1, 16, 24),)
    assert "scaled down" in out.ui["qwen35_prefill"][0]["note"]
    # pixels in 0..255: read clamped (white), and the node says so beside the scaling; in 0..1 no note
    out = _run(pack, loaded, images=torch.rand(1, 600, 900, 3) * 255, max_pixels=256 * 384)
    note = out.ui["qwen35_prefill"][0]["note"]
    assert note.startswith("1 input(s) scaled down") and "; pixel values run from" in note
    assert "divide it by 255" in note
    assert _run(pack, loaded, images=torch.rand(1, 64, 64, 3)).ui["qwen35_prefill"][0]["note"] == ""
    # a max_pixels below the smallest image (one merged patch): the note says what the image was made, not 1 pixel
    out = _run(pack, loaded, images=torch.rand(1, 64, 96, 3), max_pixels=1)
    assert out[0][0].prefill.vision.grids == ((1, 2, 2),)
    assert "max_pixels 1 (an image is at least 32 x 32 = 1,024 pixels)" in out.ui["qwen35_prefill"][0]["note"]
    # a checkpoint without vision weights, given an image
    text_only = make_checkpoint(models_dir / "text_encoders", seed=2, single_file=True, include_vision=False)
    name = "qwen35_text_only.safetensors"
    text_only.rename(models_dir / "text_encoders" / name)
    comfy.folder_paths.filename_list_cache.clear()
    model = pack.Qwen35ModelLoader.execute(model=name, dtype="fp32", device="cpu", backend="torch",
                                           keep_loaded=False)[0]
    try:
        with pytest.raises(Qwen35Error, match="no usable vision tower.*text prompts still work"):
            _run(pack, model, images=torch.rand(1, 64, 64, 3))
        assert _run(pack, model, prompt="Hello")[0][0].prefill.n_tokens > 0
    finally:
        model.release()


def test_the_node_asks_model_management_for_the_run_memory(pack, loaded, memory_asked):
    from qwen35_fast.runtime.memory import prefill_bytes, vision_bytes
    out = _run(pack, loaded, images=torch.rand(1, 64, 96, 3))
    pf = out[0][0].prefill
    want = prefill_bytes(loaded.model, pf.n_tokens) + vision_bytes(loaded.model, pf.vision.grids)
    assert memory_asked[-1] == want > 0


def test_a_second_question_about_the_same_image_shows_its_reused_tokens(pack, loaded):
    image = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(5))
    first = _run(pack, loaded, images=image, prompt="What is it?", system_prompt="Be brief.")
    again = _run(pack, loaded, images=image, prompt="Which colour?", system_prompt="Be brief.")
    assert first.ui["qwen35_prefill"][0]["cached_tokens"] == 0
    assert again.ui["qwen35_prefill"][0]["cached_tokens"] == again[0][0].prefill.cached_tokens > 0


def test_a_long_image_prompt_shows_its_pieces_and_a_cancel_lands_between_passes_and_pieces(pack, loaded, comfy,
                                                                                           monkeypatch):
    """The prompt in pieces (8 tokens here) and the tower in passes (16 patches): one bar, over the prompt's
    tokens (not the tower's patches), and Cancel lands between the tower's passes and between the pieces; the
    stopped prefill leaves its blocks, and the next run gives the first run's logits."""
    import gc

    from qwen35_fast.runtime import model as model_mod
    from qwen35_fast.runtime import vision as vision_mod
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 8)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 16)
    images = torch.rand(2, 64, 96, 3, generator=torch.Generator().manual_seed(3))
    progress, bars = [], []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, t, preview, node_id=None: progress.append((v, t)))
    real_bar = comfy.utils.ProgressBar
    monkeypatch.setattr(comfy.utils, "ProgressBar", lambda *a, **k: bars.append(a) or real_bar(*a, **k))
    loaded.model.kv.pool.clear()
    want = _run(pack, loaded, images=images)[0][0].prefill
    assert len(bars) == 1 and progress and all(t == bars[0][0] for _, t in progress)
    assert progress[0][0] == 8 and bars[0][0] <= want.n_tokens  # tokens of the prompt's pass, not patches
    for at in (1, 2, 4):  # 1: before the prefill; 2: between the tower's passes; 4: between the prompt's pieces
        loaded.model.kv.pool.clear()
        gc.collect()
        free = loaded.model.kv.pool.num_free
        checks = interrupt_at(comfy, monkeypatch, at)
        with pytest.raises(comfy.mm.InterruptProcessingException):
            _run(pack, loaded, images=images)
        assert checks["n"] == at and loaded.model.kv.pool.num_free == free, at
    monkeypatch.undo()
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 8)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 16)
    loaded.model.kv.pool.clear()
    again = _run(pack, loaded, images=images)[0][0].prefill
    assert float((again.logits - want.logits).abs().max()) < 1e-5


def test_one_prompt_per_image_keeps_its_batch_bar_with_pieces(pack, loaded, comfy, monkeypatch):
    from qwen35_fast.runtime import model as model_mod
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 8)
    progress = []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, t, preview, node_id=None: progress.append((v, t)))
    _run(pack, loaded, images=torch.rand(3, 64, 64, 3), mode="one prompt per image")
    assert progress and all(t == 3 for _, t in progress)  # the batch's bar only, not a bar of pieces beside it


def _mm_args(model, **kw):
    return dict(model=model, prompt="Describe this image.", images=None, video=None, frames=None, frame_rate=24.0,
                mode="all images in one prompt", system_prompt="", thinking=False, max_pixels=0, **kw)


def test_a_list_of_prefills_carries_its_places_through_continue(pack, loaded):
    """One prompt per image stamps each prefill with its place in the list (its states then wait off the GPU),
    and a Continue of each item keeps it; a single image's prefill is a list of one."""
    images = torch.rand(3, 64, 64, 3, generator=torch.Generator().manual_seed(5))
    prefills = pack.Qwen35MultimodalPrefill.execute(**{**_mm_args(loaded), "images": images,
                                                       "mode": "one prompt per image"})[0]
    assert [(p.item, p.items) for p in prefills] == [(0, 3), (1, 3), (2, 3)]
    follow = [pack.Qwen35ContinuePrefill.execute(prefill=pf, prompt="And the colours?", images=None,
                                                 previous_answer="A square.", thinking=False, max_pixels=0)[0]
              for pf in prefills]
    assert [(p.item, p.items) for p in follow] == [(0, 3), (1, 3), (2, 3)]
    one = pack.Qwen35MultimodalPrefill.execute(**{**_mm_args(loaded), "images": images[:1]})[0][0]
    assert (one.item, one.items) == (0, 1)


def test_a_list_of_prefills_waits_with_its_states_off_the_gpu(pack, loaded, monkeypatch):
    """One prompt per image makes every prefill before any Generate runs: each one's GDN states (the prompt's
    end and its turn's end) go to the offload device at once, not kept in VRAM that ComfyUI does not count; a
    single prefill keeps them where the model runs."""
    images = torch.rand(2, 64, 64, 3, generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(loaded.managed, "offload_device", torch.device("meta"))  # (the CPU is the load device here)
    try:
        listed = pack.Qwen35MultimodalPrefill.execute(**{**_mm_args(loaded), "images": images,
                                                         "mode": "one prompt per image"})[0]
        single = pack.Qwen35MultimodalPrefill.execute(**{**_mm_args(loaded), "images": images[:1],
                                                         "prompt": "What colour dominates?"})[0][0]
        for pf in listed:
            states = [t for t in pf.prefill.cache.ssm + pf.prefill.cache.conv + pf.prefill.turn.ssm if t is not None]
            assert states and all(t.device.type == "meta" for t in states)
        assert all(t.device.type == "cpu" for t in single.prefill.cache.ssm + single.prefill.turn.ssm
                   if t is not None)
    finally:
        loaded.model.kv.pool.clear()  # (the snapshots of the listed turns were moved with them)


def test_generate_answers_a_list_of_prefills_in_one_run_and_gives_the_vram_back_once(pack, models_dir, monkeypatch):
    """A list of prefills (one prompt per image) comes to Generate in one call (is_input_list): each answer equals
    the prefill's answer alone, a shorter list of settings repeats its last value (as ComfyUI's run per item did),
    the page hears each answer's place in the list, and with keep_loaded off the model is released once, after the
    last answer (run per item, the node released it and loaded it again for every image)."""
    import qwen35_fast.nodes.text as text_node
    import qwen35_fast.runtime as rt
    model, released = releases_counted(pack, monkeypatch)
    images = torch.rand(3, 64, 64, 3, generator=torch.Generator().manual_seed(8))
    prefills = _run(pack, model, images=images, mode="one prompt per image")[0]
    alone = [_generate(pack, pf, seed=4, max_new_tokens=n, sampling=False)[0][0]
             for pf, n in zip(prefills, (3, 5, 5))]
    released.clear()
    asked, starts = [], []
    real = rt.generate
    monkeypatch.setattr(rt, "generate", lambda m, pf, max_new_tokens, **kw: asked.append(max_new_tokens)
                        or real(m, pf, max_new_tokens=max_new_tokens, **kw))
    monkeypatch.setattr(text_node, "_send", lambda event, data: data["n"] == 0 and starts.append(data["item"]))
    settings = dict(sampling=False, temperature=0.9, top_k=50, top_p=0.95, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, seed=4)
    out = listed(pack.Qwen35Generate, prefill=prefills, max_new_tokens=[3, 5], **settings)
    assert out[0] == alone and len(out[1]) == 3 and out.ui["text"] == alone
    assert len(out.ui["qwen35_generate"]) == 3 and asked == [3, 5, 5] and starts == [0, 1, 2]
    assert len(released) == 1
    # a bad setting for the third answer: named, and the VRAM given back once all the same
    from qwen35_fast.runtime import Qwen35Error
    released.clear()
    with pytest.raises(Qwen35Error, match=r"top_p 0.0 must be in \(0, 1\]"):
        listed(pack.Qwen35Generate, prefill=prefills, max_new_tokens=3, **{**settings, "top_p": [0.9, 0.9, 0.0]})
    assert len(released) == 1
    # nothing to answer (an empty list upstream): no answers, no error
    empty = listed(pack.Qwen35Generate, prefill=[], max_new_tokens=3, **settings)
    assert empty[0] == [] and empty.ui["qwen35_generate"] == []


def test_one_prompt_per_image_names_one_image_a_prompt(pack, loaded):
    from qwen35_fast.runtime import Qwen35Error
    images = torch.rand(2, 64, 64, 3)
    with pytest.raises(Qwen35Error, match=r"names <image 2>, but in mode 'one prompt per image' each prompt holds "
                                          r"one image.*write <image>"):
        _run(pack, loaded, images=images, mode="one prompt per image", prompt="Compare <image> and <image 2>.")
    for twice in ("Compare <image> and <image>.", "Compare <image 1> and <image>.", "<image> beside <image 1>"):
        with pytest.raises(Qwen35Error, match=r"the prompt places an image twice \(<image> or <image 1>\), but in mode "
                                              r"'one prompt per image' each prompt holds one image of the batch "
                                              r"\(2 prompts\); write <image> once"):
            _run(pack, loaded, images=images, mode="one prompt per image", prompt=twice)
    out = _run(pack, loaded, images=images, mode="one prompt per image", prompt="What is in <image 1>?")
    assert len(out[0]) == 2
    # one [H, W, C] image (the runtime takes it as one image) is one prompt, as in the other mode, not a prompt a row
    one = _run(pack, loaded, images=images[0], mode="one prompt per image", prompt="What is in <image>?")
    assert len(one[0]) == 1
    assert one[0][0].prefill.vision.grids == _run(pack, loaded, images=images[0], prompt="<image>")[0][0].prefill.vision.grids
    with pytest.raises(Qwen35Error, match=r"more <image> placeholders than the 0 image\(s\) connected; connect more "
                                          r"images or remove the extra <image>"):
        _run(pack, loaded, prompt="What is in <image>?")


def test_an_image_with_nan_values_is_named_before_the_model_runs(pack, loaded):
    from qwen35_fast.runtime import Qwen35Error
    image = torch.rand(1, 64, 64, 3)
    image[0, 3, 5, 1] = float("nan")
    image[0, 7, 9, 0] = float("inf")
    with pytest.raises(Qwen35Error, match=r"holds 2 NaN or infinite values of its 12,288; the node that made it "
                                          r"produced them"):
        _run(pack, loaded, images=image)
    frames = torch.rand(4, 64, 64, 3)
    frames[2, 0, 0, 0] = float("nan")
    with pytest.raises(Qwen35Error, match="NaN or infinite"):
        _run(pack, loaded, prompt="<video> What moves?", frames=frames, frame_rate=2.0)


def test_video_frames_outside_0_to_1_are_named_on_the_panel(pack, loaded):
    """Frames in 0..255 (the frames input, or a VIDEO held in memory) are clamped to white as images are: the panel
    says so, also when the prefix cache answers the video and the runtime does not read it; frames in 0..1 and
    a file's frames (decoded into 0..1) get no note."""
    from comfy_api.latest import InputImpl, Types
    frames = torch.rand(8, 64, 80, 3, generator=torch.Generator().manual_seed(5))
    for _ in range(2):  # (the second run reads the video from the prefix cache)
        note = _run(pack, loaded, prompt="<video> What?", frames=frames * 255, frame_rate=4.0).ui["qwen35_prefill"]
        assert note[0]["note"].startswith("the video's pixel values run from") and "divide it by 255" in note[0]["note"]
    video = InputImpl.VideoFromComponents(Types.VideoComponents(images=frames * 255, frame_rate=Fraction(4)))
    assert "divide it by 255" in _run(pack, loaded, prompt="<video> What?", video=video).ui["qwen35_prefill"][0]["note"]
    out = _run(pack, loaded, images=torch.rand(2, 64, 64, 3), frames=frames * 255, frame_rate=4.0,
               mode="one prompt per image")
    assert all("the video's pixel values" in s["note"] for s in out.ui["qwen35_prefill"])
    plain = _run(pack, loaded, prompt="<video> What?", frames=frames, frame_rate=4.0)
    assert plain.ui["qwen35_prefill"][0]["note"] == ""


def test_prefills_let_go_are_made_again_from_where_they_were_first_read(pack, loaded):
    """One prompt per image, let go when the node runs in a later prompt, made again when handed on: each from the
    cached prefix its first read started from (not the turn end that read left), so with the same logits."""
    from comfy_execution.utils import CurrentNodeContext
    images = torch.rand(2, 64, 64, 3, generator=torch.Generator().manual_seed(4))
    with CurrentNodeContext("p1", "5"):
        prefills = _run(pack, loaded, images=images, mode="one prompt per image", prompt="What is in <image>?")[0]
    first = [(p.prefill.logits.clone(), p.prefill.cached_tokens) for p in prefills]
    with CurrentNodeContext("p2", "5"):
        _run(pack, loaded, images=images[:1], prompt="Describe <image> briefly.")
    assert all(p.let_go for p in prefills)
    with CurrentNodeContext("p3", "9"):
        for p, (logits, cached) in zip(prefills, first):
            assert p.prefill.cached_tokens == cached and torch.equal(p.prefill.logits, logits)


def test_images_as_a_list_of_tensors_of_two_sizes(pack, loaded):
    """A list of IMAGE tensors (a node of any type between: a switch or reroute) reaches images; the runtime takes
    it (images of different sizes) and so do the nodes: all in one prompt, one prompt per image (each tensor's
    images, in order), and a Continue's turn. They raised AttributeError (the range check, the per-image split)
    after the prefill ran."""
    g = torch.Generator().manual_seed(5)
    imgs = [torch.rand(1, 32, 48, 3, generator=g), torch.rand(2, 40, 40, 3, generator=g)]
    out = _run(pack, loaded, prompt="Compare <image 1> and <image 2>.", images=imgs)
    assert out[0][0].prefill.vision.grids and len(out[0][0].prefill.vision.grids) == 3
    per = _run(pack, loaded, prompt="Describe.", images=imgs, mode="one prompt per image")
    assert len(per[0]) == 3 and len(per.ui["qwen35_prefill"]) == 3
    alone = _run(pack, loaded, prompt="Describe.", images=imgs[1][1:2])[0][0]
    assert alone.prefill.token_ids == per[0][2].prefill.token_ids
    turn = pack.Qwen35ContinuePrefill.execute(prefill=out[0][0], prompt="And <image 2>?", images=imgs)
    assert turn.ui["qwen35_prefill"][0]["vision_tokens"] > 0
    with pytest.raises(Exception, match="the images input holds a str, not an IMAGE"):
        _run(pack, loaded, prompt="Describe.", images=[imgs[0], "x"], mode="one prompt per image")
