"""Images and video through our runtime against transformers' Qwen3_5ForConditionalGeneration (fp32,
random weights): the vision tower, multimodal positions, prefill logits and 8 decode steps after it."""
import pytest
import torch

from qwen35_fast.runtime.generate import generate
from qwen35_fast.runtime.loader import load_model
from qwen35_fast.runtime.media import Preprocessing, VisionInput, preprocess_images, preprocess_video
from qwen35_fast.runtime.multimodal import IMAGE_PAD, VIDEO_PAD, prefill_multimodal
from qwen35_fast.runtime.sampling import SamplingParams
from qwen35_fast.runtime.vision import VisionTower, _targets, infer_vision_config, vision_config_from_hf

from _models import rel, tiny_config

TOL = 1e-4
# scaled-down towers in the real key layout (width / heads / depth small enough for a CPU)
TOWERS = {"d2w32h2": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2),
          "d3w48h4": dict(depth=3, hidden_size=48, intermediate_size=80, num_heads=4),
          "d1w64h4": dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4)}
# the released towers: 0.8B; 2B and 4B; 9B and 27B
REAL_TOWERS = {"12x768": dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12),
               "24x1024": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16),
               "27x1152": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)}
SMALL = Preprocessing(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 12, video_min_pixels=32 * 32,
                      video_max_pixels=32 * 32 * 40)


def _randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and p.dim() == 1:  # LayerNorms (w, b) and biases off their init values
                p.copy_((1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight")
                         or name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif "language_model" in name and "norm" in name and p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.uniform_(-2, 1, generator=g)
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def _make(folder, tower: dict, seed: int):
    from transformers import Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = tiny_config(vocab=248_320, tie=True, layers=4, vision=tower)
    hf = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    _randomise(hf, seed)
    hf.save_pretrained(folder)
    return hf, load_model(folder, dtype="fp32", device="cpu", backend="torch")


@pytest.fixture(scope="module", params=list(TOWERS), ids=list(TOWERS))
def pair(request, tmp_path_factory):
    return _make(tmp_path_factory.mktemp(request.param), TOWERS[request.param], seed=len(request.param))


def _image(h, w, seed, c=3):
    return torch.rand(1, h, w, c, generator=torch.Generator().manual_seed(seed))


def _hf_inputs(pf, ordered):
    ids = torch.tensor([pf.token_ids])
    types = torch.zeros_like(ids)
    types[ids == IMAGE_PAD] = 1
    types[ids == VIDEO_PAD] = 2
    kw = dict(input_ids=ids, mm_token_type_ids=types)
    imgs = [i for i in ordered if i.kind == "image"]
    vids = [i for i in ordered if i.kind == "video"]
    if imgs:
        kw.update(pixel_values=torch.cat([i.pixels for i in imgs]), image_grid_thw=torch.tensor([i.grid for i in imgs]))
    if vids:
        kw.update(pixel_values_videos=torch.cat([i.pixels for i in vids]),
                  video_grid_thw=torch.tensor([i.grid for i in vids]))
    return kw


def _hf_logits(hf, pf, images=()):
    """transformers' logits of the last position of prefill `pf` (its images in prompt order)."""
    with torch.no_grad():
        return hf(**_hf_inputs(pf, list(images)), logits_to_keep=1).logits[0, -1]


def _check(hf, ours, prompt, images=(), video=None, order=None, steps=8):
    """Prefill + `steps` decode steps; returns the largest relative error of the logits."""
    pf = prefill_multimodal(ours, prompt, images=list(images) or None, video=video)
    ordered = list(images) + ([video] if video is not None else []) if order is None else order
    with torch.no_grad():
        out = hf(**_hf_inputs(pf, ordered), use_cache=True, logits_to_keep=1)
    errs = [rel(pf.logits, out.logits[0, -1])]
    cache = pf.cache.clone(pf.n_tokens + steps)
    past = out.past_key_values
    g = torch.Generator().manual_seed(pf.n_tokens)
    for _ in range(steps):
        tok = torch.randint(0, 248_000, (1,), generator=g)
        mine = ours.forward_decode(tok, cache)[0]
        with torch.no_grad():
            out = hf(input_ids=tok[None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        errs.append(rel(mine, out.logits[0, -1]))
    return max(errs), pf


def test_one_image(pair):
    hf, ours = pair
    img = preprocess_images(_image(70, 100, 1), SMALL)
    err, pf = _check(hf, ours, "Describe the image.", img)
    assert pf.vision.vision_tokens == img[0].n_tokens() and err <= TOL, err


def test_the_towers_features_equal_transformers(pair):
    """The merged image and video features themselves (in the logits above a wrong rotary frequency in the tower
    moves them by ~1e-5 of their size, the logits by less): a batch of two images and a video, as one call."""
    hf, ours = pair
    inputs = [*preprocess_images(_image(64, 128, 20), SMALL), *preprocess_images(_image(100, 60, 21), SMALL),
              preprocess_video(torch.rand(4, 64, 80, 3, generator=torch.Generator().manual_seed(22)), 2.0, SMALL)]
    pixels, grids = torch.cat([i.pixels for i in inputs]), [i.grid for i in inputs]
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = ours.vision(pixels, ours.vision.plan(grids))
    assert rel(got, want) <= 2e-6, rel(got, want)  # measured 0.9e-7 .. 1.8e-7 (a frequency off: 1.4e-5 and more)


def test_two_images_of_different_sizes(pair):
    hf, ours = pair
    a = preprocess_images(_image(64, 128, 2), SMALL)[0]
    b = preprocess_images(_image(100, 60, 3), SMALL)[0]
    assert a.grid != b.grid
    err, pf = _check(hf, ours, "Compare the two pictures.", [a, b])
    assert err <= TOL, err


def test_image_between_text_parts_and_named_order(pair):
    hf, ours = pair
    a = preprocess_images(_image(64, 96, 4), SMALL)[0]
    b = preprocess_images(_image(96, 64, 5), SMALL)[0]
    err, pf = _check(hf, ours, "First look at <image 2>, then compare it with <image 1> please.", [a, b],
                     order=[b, a])
    ids = list(pf.token_ids)
    first_pad = ids.index(IMAGE_PAD)
    assert ids[first_pad - 1] == 248053  # <|vision_start|>
    assert ours.tokenizer.decode(ids[:first_pad - 1]).endswith("user\nFirst look at ")
    assert ours.tokenizer.decode(ids[ids.index(248054):]).startswith("<|vision_end|>, then compare it with ")
    assert err <= TOL, err


def test_video_of_8_frames(pair):
    hf, ours = pair
    frames = torch.rand(8, 64, 80, 3, generator=torch.Generator().manual_seed(6))
    video = preprocess_video(frames, fps=2.0, pp=SMALL)
    assert video.grid == (4, 4, 4) and len(video.timestamps) == 4
    err, pf = _check(hf, ours, "<video> What happens in this clip?", video=video)
    assert err <= TOL, err


def test_image_and_video_together(pair):
    hf, ours = pair
    img = preprocess_images(_image(64, 64, 7), SMALL)[0]
    video = preprocess_video(torch.rand(5, 64, 64, 3, generator=torch.Generator().manual_seed(8)), 4.0, SMALL)
    err, _ = _check(hf, ours, "Is the picture <image> a frame of <video>?", [img], video)
    assert err <= TOL, err


def test_a_video_before_an_image(pair):
    """The image's patches come after all of the video's frames' patches in the tower's input."""
    hf, ours = pair
    video = preprocess_video(torch.rand(4, 64, 64, 3, generator=torch.Generator().manual_seed(9)), 4.0, SMALL)
    img = preprocess_images(_image(64, 96, 10), SMALL)[0]
    assert video.grid[0] > 1
    err, pf = _check(hf, ours, "Does <video> end on the picture <image>?", [img], video, order=[video, img], steps=2)
    assert pf.token_ids.index(VIDEO_PAD) < pf.token_ids.index(IMAGE_PAD) and err <= TOL, err


def test_transformers_pixel_values_give_the_same_logits():
    """Fed with the pixel_values of transformers' own image processor (PIL), ours equals transformers."""
    pytest.importorskip("PIL")
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    proc = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, min_pixels=SMALL.min_pixels, max_pixels=SMALL.max_pixels)
    u8 = (torch.rand(90, 70, 3, generator=torch.Generator().manual_seed(9)) * 255).round().to(torch.uint8)
    got = proc(images=[np.asarray(u8)], return_tensors="pt")
    theirs = VisionInput("image", got["pixel_values"], tuple(got["image_grid_thw"][0].tolist()), (90, 70))
    mine = preprocess_images(u8[None].float() / 255, SMALL)[0]
    assert mine.grid == theirs.grid
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        hf, ours = _make(d, TOWERS["d2w32h2"], seed=11)
        err, _ = _check(hf, ours, "What is this?", [theirs])
        assert err <= TOL, err
        # our fp32 resize differs from PIL's 8-bit one (mean 0.003 of the normalised range): logits within 0.2%
        pf_mine = prefill_multimodal(ours, "What is this?", images=[mine])
        pf_theirs = prefill_multimodal(ours, "What is this?", images=[theirs])
        assert rel(pf_mine.logits, pf_theirs.logits) < 2e-3  # measured 2.3e-4 .. 3.0e-4


def test_greedy_generation_equals_transformers_with_an_image(pair):
    hf, ours = pair
    img = preprocess_images(_image(80, 80, 12), SMALL)
    pf = prefill_multimodal(ours, "Caption this.", images=img)
    mine = generate(ours, pf, max_new_tokens=12, sampling=SamplingParams(do_sample=False))
    kw = _hf_inputs(pf, img)
    with torch.no_grad():
        out = hf.generate(**kw, max_new_tokens=len(mine.token_ids), do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=len(mine.token_ids))
    theirs = out[0, len(pf.token_ids):].tolist()
    # transformers is asked for as many tokens as we gave: ours must run to the budget (random weights never end
    # the turn here), else an answer stopped early would be compared on its own length only
    assert mine.n_tokens == 12 and list(mine.token_ids) == theirs


@pytest.mark.parametrize("name", list(REAL_TOWERS))
def test_real_tower_shapes_load_and_run(tmp_path, name):
    """The three released tower shapes: a checkpoint config of each builds, loads and runs one small image."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    cfg = Qwen3_5VisionConfig(**REAL_TOWERS[name], out_hidden_size=64)
    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(cfg).float().eval()
    vc = vision_config_from_hf({"vision_config": cfg.to_dict()})
    assert vc.shape_name == name
    # a single file has no config: the sizes (heads from the width) come from the weights' shapes alone
    assert infer_vision_config({k: tuple(t.shape) for k, t in ref.state_dict().items()}, "file") == vc
    tower = VisionTower(vc, torch.float32, torch.device("cpu"))
    sd = ref.state_dict()
    with torch.no_grad():
        for k, p in _targets(tower).items():
            p.copy_(sd[k].reshape(p.shape))
    img = preprocess_images(_image(64, 64, 13), Preprocessing(min_pixels=64 * 64, max_pixels=64 * 64))[0]
    with torch.no_grad():
        want = ref(img.pixels, grid_thw=torch.tensor([img.grid])).pooler_output
    got = tower(img.pixels, tower.plan([img.grid]))
    assert rel(got, want) <= TOL


def test_the_vision_rotarys_theta_is_the_configs():
    """A config's vision rope_theta (rope_parameters) sets the tower's rotary as it does transformers'."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    cfg = Qwen3_5VisionConfig(**TOWERS["d1w64h4"], out_hidden_size=64,
                              rope_parameters={"rope_type": "axial", "rope_theta": 50_000.0})
    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(cfg).float().eval()
    vc = vision_config_from_hf({"vision_config": cfg.to_dict()})
    assert vc.rope_theta == 50_000.0
    tower = VisionTower(vc, torch.float32, torch.device("cpu"))
    sd = ref.state_dict()
    with torch.no_grad():
        for k, p in _targets(tower).items():
            p.copy_(sd[k].reshape(p.shape))
    img = preprocess_images(_image(96, 64, 14), SMALL)[0]
    with torch.no_grad():
        want = ref(img.pixels, grid_thw=torch.tensor([img.grid])).pooler_output
    assert rel(tower(img.pixels, tower.plan([img.grid])), want) <= 2e-6
