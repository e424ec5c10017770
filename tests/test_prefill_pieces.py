"""A prompt longer than PREFILL_PIECE tokens is read in pieces (runtime/model.py), and images and video of
more than TOWER_PASS_PATCHES patches go through the vision tower in passes (runtime/vision.py): the same
logits, K/V, GDN states, kept states and vision tokens as one pass (fp32, random weights), against
transformers with images and video cut by the pieces and passes, and the estimates count one piece's and one
pass's activations."""
import gc

import pytest
import torch
from test_vision_vs_transformers import SMALL, TOWERS, _check, _image, _make

from qwen35_fast.runtime import Qwen35Error, load_model, memory, prefill, prefill_ids, prefill_multimodal, progress
from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime import vision as vision_mod
from qwen35_fast.runtime.config import LINEAR
from qwen35_fast.runtime.media import preprocess_images, preprocess_video
from qwen35_fast.runtime.model import Cache
from qwen35_fast.runtime.vision import tower_passes

from _models import make_hf_model, rel

TOL = 1e-5  # fp32: pieces and one pass differ only in where the recurrence and the attention are cut


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pieces")
    make_hf_model(folder, seed=5, layers=4)
    return load_model(folder, dtype="fp32", device="cpu", backend="torch")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("pieces-mm"), TOWERS["d2w32h2"], seed=9)


def _ids(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pass_sizes(model, monkeypatch) -> list:
    """The token counts of the model's layer passes from here on."""
    sizes, layers = [], model._layers

    def spy(h, *a, **k):
        sizes.append(h.shape[1])
        return layers(h, *a, **k)
    monkeypatch.setattr(model, "_layers", spy)
    return sizes


def _prefill(model, ids, keep, piece, monkeypatch, prefix=()):
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", piece)
    cache = model.new_cache(1, len(prefix) + len(ids))
    if prefix:
        model.forward_prefill(torch.tensor([list(prefix)]), cache)
    if not keep:
        return model.forward_prefill(torch.tensor([ids]), cache), [], cache
    logits, kept = model.forward_prefill_kept(torch.tensor([ids]), cache, keep)
    return logits, kept, cache


def _states_close(a_conv, a_ssm, b_conv, b_ssm):
    for x, y in zip(a_conv + a_ssm, b_conv + b_ssm):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and rel(x, y) <= TOL, rel(x, y)


@pytest.mark.parametrize("piece", [1, 7, 64, 100, 299])
@pytest.mark.parametrize("prefix", [0, 45], ids=["fresh", "after-45"])
def test_pieces_equal_one_pass(text_model, monkeypatch, piece, prefix):
    ids, pre = _ids(300, piece), _ids(prefix, 1)
    keep = sorted({1, 64, 100, 128, 200, 299} - {0})  # at piece ends (64, 100, 128, 200) and inside pieces
    want_logits, want_kept, want = _prefill(text_model, ids, keep, 10_000, monkeypatch, pre)
    sizes = _pass_sizes(text_model, monkeypatch)
    logits, kept, cache = _prefill(text_model, ids, keep, piece, monkeypatch, pre)
    assert sizes[-(-(-300 // piece)):] == [min(piece, 300 - lo) for lo in range(0, 300, piece)]
    assert cache.length == want.length == prefix + 300 and rel(logits, want_logits) <= TOL
    for (k1, v1), (k2, v2) in zip(cache.gather_kv(), want.gather_kv()):
        assert rel(k1, k2) <= TOL and rel(v1, v2) <= TOL
    _states_close(cache.conv, cache.ssm, want.conv, want.ssm)
    assert [s.length for s in kept] == [s.length for s in want_kept] == [prefix + k for k in keep]
    for s, w in zip(kept, want_kept):
        assert s.rope_delta == w.rope_delta
        _states_close(s.conv, s.ssm, w.conv, w.ssm)
        gdn = [kind == LINEAR for kind in text_model.config.layer_types]  # a state for each GDN layer, no other
        assert [t is not None for t in s.ssm] == [t is not None for t in s.conv] == gdn and any(gdn)


def test_a_kept_state_at_a_piece_end_is_not_changed_by_the_next_piece(text_model, monkeypatch):
    ids = _ids(200, 3)
    _, kept, _ = _prefill(text_model, ids, [64], 64, monkeypatch)
    before = [t.clone() for t in kept[0].ssm + kept[0].conv if t is not None]
    restarted = _prefill(text_model, ids[:64], [], 10_000, monkeypatch)[2]  # the state after 64 tokens, alone
    _states_close(kept[0].conv, kept[0].ssm, restarted.conv, restarted.ssm)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in kept[0].ssm + kept[0].conv if t is not None]))


def test_the_default_piece_reads_a_long_prompt_in_pieces(text_model, monkeypatch):
    n = model_mod.PREFILL_PIECE + 500
    ids = _ids(n, 4)
    sizes = _pass_sizes(text_model, monkeypatch)
    pf = prefill_ids(text_model, ids, use_cache=False)
    assert sizes == [model_mod.PREFILL_PIECE, 500]
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 2 * n)
    whole = prefill_ids(text_model, ids, use_cache=False)
    assert sizes[2:] == [n] and rel(pf.logits, whole.logits) <= TOL


def test_a_reused_system_prompt_after_a_prompt_read_in_pieces(pair, monkeypatch):
    text_model = pair[1]
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 16)
    text_model.kv.pool.clear()
    system = "You write short captions. " * 6
    first = prefill(text_model, "A fox in the snow.", system_prompt=system)
    again = prefill(text_model, "A boat at dusk.", system_prompt=system)
    cold = prefill(text_model, "A boat at dusk.", system_prompt=system, use_cache=False)
    assert first.cached_tokens == 0 and again.cached_tokens > 16 and cold.cached_tokens == 0
    assert rel(again.logits, cold.logits) <= TOL


@pytest.mark.parametrize("piece", [5, 16])
def test_images_cut_by_pieces_equal_transformers(pair, monkeypatch, piece):
    hf, ours = pair
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", piece)
    ours.kv.pool.clear()
    sizes = _pass_sizes(ours, monkeypatch)
    imgs = preprocess_images(torch.cat([_image(64, 96, 2), _image(64, 96, 3)]), SMALL)
    err, pf = _check(hf, ours, "Compare <image> with <image 2>, briefly.", imgs)
    n = -(-pf.n_tokens // piece)
    assert sizes[:n] == [min(piece, pf.n_tokens - lo) for lo in range(0, pf.n_tokens, piece)] and err <= 1e-4, err
    assert sizes[n:] == [1] * 8  # the decode steps


def test_a_video_cut_by_pieces_equals_transformers(pair, monkeypatch):
    hf, ours = pair
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 11)
    ours.kv.pool.clear()
    video = preprocess_video(torch.rand(8, 64, 80, 3, generator=torch.Generator().manual_seed(6)), fps=2.0, pp=SMALL)
    err, _ = _check(hf, ours, "<video> What happens in this clip?", video=video)
    assert err <= 1e-4, err


def test_the_estimate_counts_one_pieces_activations(text_model):
    piece = model_mod.PREFILL_PIECE
    per_token = memory._activation_bytes_per_token(text_model)
    embedded = text_model.config.hidden_size * text_model.dtype.itemsize
    short, long_ = memory.prefill_bytes(text_model, piece), memory.prefill_bytes(text_model, 4 * piece)
    assert short - memory.prefill_bytes(text_model, piece - 1) >= per_token  # up to a piece: a token's activations
    # past it, only the embedded prompt (and a larger pool, here none: the growth is the store's own) grows
    grow = memory.growth_bytes(text_model, 4 * piece) - memory.growth_bytes(text_model, piece)
    attn = (memory.reference_attention_bytes(text_model, 4 * piece, piece)
            - memory.reference_attention_bytes(text_model, piece, piece))
    assert long_ - short == 3 * piece * embedded + grow + attn


def _patches(grids):
    return sum(t * h * w for t, h, w in grids)


def _slices(grids):
    return [(h, w) for t, h, w in grids for _ in range(t)]


def test_tower_passes_split_between_images_and_video_slices():
    assert tower_passes([(1, 64, 64)] * 4, 32768) == [((1, 64, 64),) * 4]  # four 1024 x 1024 images: one pass
    assert tower_passes([(16, 40, 72)], 32768) == [((8, 40, 72),), ((8, 40, 72),)]  # the video: two even halves
    assert tower_passes([(1, 256, 256), (2, 8, 8)], 32768) == [((1, 256, 256),), ((2, 8, 8),)]  # too big: alone
    # slices of 16, 16, 16, 32, 16, 16 patches under 40: the 32 cannot share, so four passes are the fewest
    assert tower_passes([(3, 4, 4), (1, 8, 4), (2, 4, 4)], 40) == [((2, 4, 4),), ((1, 4, 4),), ((1, 8, 4),),
                                                                     ((2, 4, 4),)]
    assert tower_passes([(3, 4, 4), (1, 4, 4), (2, 4, 4)], 40) == [((2, 4, 4),), ((1, 4, 4), (1, 4, 4)),
                                                                     ((2, 4, 4),)]  # an image joins a video's rest
    assert tower_passes([], 16) == [()]


@pytest.mark.parametrize("seed", range(40))
def test_tower_passes_keep_the_patches_in_order_and_within_the_limit(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    grids = [(r(1, 9), 2 * r(1, 6), 2 * r(1, 6)) for _ in range(r(1, 7))]
    limit = r(4, 2 * _patches(grids))
    passes = tower_passes(grids, limit)
    assert _slices([gr for p in passes for gr in p]) == _slices(grids)
    assert all(_patches(p) <= limit or len(_slices(p)) == 1 for p in passes)
    assert len(passes) <= 2 * -(-_patches(grids) // limit)
    # a video's grid only between its slices, and only there: no input split but at a slice
    assert all(gr[0] >= 1 for p in passes for gr in p)


@pytest.mark.parametrize("as_list", [False, True], ids=["one-tensor", "per-input"])
@pytest.mark.parametrize("limit", [16, 40, 100])
def test_the_tower_in_passes_gives_the_tokens_of_one_pass(pair, monkeypatch, limit, as_list):
    _, ours = pair
    inputs = [*preprocess_images(_image(64, 128, 20), SMALL), *preprocess_images(_image(100, 60, 21), SMALL),
              preprocess_video(torch.rand(8, 64, 80, 3, generator=torch.Generator().manual_seed(22)), 2.0, SMALL)]
    grids = [i.grid for i in inputs]
    whole = ours.vision.run(torch.cat([i.pixels for i in inputs]), grids)
    pixels = [i.pixels for i in inputs] if as_list else torch.cat([i.pixels for i in inputs])
    assert torch.equal(ours.vision.run(pixels, grids), whole)  # one pass: the per-input tensors as the joined one
    with pytest.raises(Qwen35Error, match=r"vision input has \d+ patch rows, the grids .* need \d+"):
        ours.vision.run(torch.cat([i.pixels for i in inputs] + [inputs[0].pixels[:4]]), grids)
    calls, forward = [], type(ours.vision).forward

    def spy(tower, x, p, backend=None):
        calls.append(p.n_patches)
        return forward(tower, x, p, backend=backend)
    monkeypatch.setattr(type(ours.vision), "forward", spy)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", limit)
    got = ours.vision.run(pixels, grids)
    assert calls == [_patches(p) for p in tower_passes(grids, limit)] and len(calls) > 1
    assert got.shape == whole.shape and rel(got, whole) <= 1e-6, rel(got, whole)


def test_a_pass_inside_one_input_takes_its_rows_without_a_copy(pair):
    _, ours = pair  # fp32 on the CPU: the tower's device and dtype, so rows inside one tensor stay a view
    a, b = torch.rand(10, ours.vision.config.patch_dim), torch.rand(6, ours.vision.config.patch_dim)
    inside = ours.vision._rows([a, b], 2, 9)
    assert inside.data_ptr() == a[2].data_ptr() and torch.equal(inside, a[2:9])
    assert torch.equal(ours.vision._rows([a, b], 8, 13), torch.cat([a[8:], b[:3]]))
    assert ours.vision._rows([a, b], 10, 16).data_ptr() == b.data_ptr()  # a pass of one whole input: that input
    assert ours.vision._rows([a, b], 0, 10).data_ptr() == a.data_ptr()


def test_images_and_video_through_tower_passes_and_pieces_equal_transformers(pair, monkeypatch):
    hf, ours = pair
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 24)
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 13)
    ours.kv.pool.clear()
    img = preprocess_images(_image(64, 64, 7), SMALL)[0]
    video = preprocess_video(torch.rand(5, 64, 64, 3, generator=torch.Generator().manual_seed(8)), 4.0, SMALL)
    assert len(tower_passes([img.grid, video.grid], 24)) > 2
    err, _ = _check(hf, ours, "Is the picture <image> a frame of <video>?", [img], video)
    assert err <= 1e-4, err


def test_the_vision_estimate_counts_one_passs_activations(pair, monkeypatch):
    _, ours = pair
    grids = [(16, 8, 8)]
    one = memory.vision_bytes(ours, grids)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 256)
    quarters = memory.vision_bytes(ours, grids)
    vc, b = ours.vision.config, ours.dtype.itemsize
    per_pass_patch = (b * (vc.patch_dim + 8 * vc.hidden_size + max(3 * vc.hidden_size, 2 * vc.intermediate_size))
                      + 8 * vc.hidden_size)
    assert len(tower_passes(grids, 256)) == 4 and one - quarters == (1024 - 256) * per_pass_patch
    assert memory.vision_bytes(ours, []) == 0 and quarters > memory.OVERHEAD
    # on a GPU one pass may be a bucket graph's capture: its bucket's patches (1,152 for 1,024), never passes
    monkeypatch.setattr(type(ours), "backend_device", property(lambda self: torch.device("cuda")))  # runs there
    assert memory.vision_bytes(ours, grids) == quarters
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 32768)
    assert memory.vision_bytes(ours, grids) - one == (vision_mod.graph_bucket(1024) - 1024) * per_pass_patch
    assert vision_mod.graph_bucket(1024) == 1152


def test_progress_is_reported_between_pieces_and_passes(pair, monkeypatch):
    _, ours = pair
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 16)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 24)
    ours.kv.pool.clear()
    seen = []
    video = preprocess_video(torch.rand(5, 64, 64, 3, generator=torch.Generator().manual_seed(8)), 4.0, SMALL)
    with progress.reporting(lambda stage, done, total: seen.append((stage, done, total))):
        pf = prefill_multimodal(ours, "<video> What happens?", video=video)
    patches = _patches([video.grid])
    passes = [_patches(p) for p in tower_passes([video.grid], 24)]
    want_vision = [("vision", sum(passes[:i]), patches) for i in range(1, len(passes))]
    # the prompt up to the turn end is one pass of prefill_reusing (the generation prompt runs after it)
    prompt = [s for s in seen if s[0] == "prompt"]
    total = prompt[0][2]
    assert seen[:len(want_vision)] == want_vision and len(want_vision) >= 1
    assert [d for _, d, _ in prompt] == list(range(16, total, 16)) and total <= pf.n_tokens
    seen.clear()
    with progress.reporting(lambda *a: seen.append(a)):
        prefill_ids(ours, _ids(16, 5), use_cache=False)  # one piece: no call
    assert seen == [] and progress.report("prompt", 1, 2) is None  # outside a block: nothing to call


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("stage", ["prompt", "vision"])
def test_a_cancel_between_pieces_stops_the_prefill_and_gives_its_blocks_back(pair, monkeypatch, stage):
    _, ours = pair
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 16)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 24)
    ours.kv.pool.clear()
    video = preprocess_video(torch.rand(5, 64, 64, 3, generator=torch.Generator().manual_seed(8)), 4.0, SMALL)
    gc.collect()  # earlier tests' prefills gone
    free, snaps = ours.kv.pool.num_free, len(ours.kv.pool.snapshots)

    def cancel(s, done, total):
        if s == stage and done >= 16:
            raise Cancelled(f"{s} {done}/{total}")
    with pytest.raises(Cancelled) as info:
        with progress.reporting(cancel):
            prefill_multimodal(ours, "<video> What happens?", video=video, system_prompt="Be brief.")
    assert info.value.__traceback__ is not None  # the traceback (and its frames) still held here
    assert ours.kv.pool.num_free == free and len(ours.kv.pool.snapshots) == snaps == 0
    after = prefill_multimodal(ours, "<video> What happens?", video=video, system_prompt="Be brief.")
    cold = prefill_multimodal(ours, "<video> What happens?", video=video, system_prompt="Be brief.", use_cache=False)
    assert after.cached_tokens == 0 and rel(after.logits, cold.logits) <= TOL


def test_an_empty_prompt_is_refused_by_name(text_model):
    with pytest.raises(ValueError, match=r"at least one token .* shape \[1, 0\]"):
        text_model.forward_prefill(torch.zeros(1, 0, dtype=torch.long), text_model.new_cache(1, 4))


def test_a_prompt_the_fixed_cache_cannot_hold_fails_before_any_piece(tmp_path, monkeypatch):
    make_hf_model(tmp_path, seed=6, layers=4)
    model = load_model(tmp_path, dtype="fp32", device="cpu", backend="torch")
    model.setup_kv(model.kv.nbytes // model.kv.num_blocks * 64 + (64 << 20))  # a fixed store of few blocks
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 16)
    sizes = _pass_sizes(model, monkeypatch)
    n = model.kv.num_blocks * model.kv.block_size + 1  # one position more than the whole pool
    with pytest.raises(Qwen35Error, match="K/V cache"):
        model.forward_prefill(torch.tensor([_ids(n, 7)]), Cache([None] * 4, [None] * 4, model.kv))
    assert sizes == []  # nothing ran: the whole prompt's blocks are asked for first


def test_the_multimodal_estimate_counts_every_input(pair):
    _, ours = pair
    imgs = preprocess_images(_image(64, 96, 2), SMALL) + preprocess_images(_image(64, 64, 3), SMALL)
    asked = []
    pf = prefill_multimodal(ours, "Compare <image> with <image 2>.", images=imgs, reserve=asked.append,
                            use_cache=False)
    grids = list(pf.vision.grids)
    assert len(grids) == 2 and asked == [memory.prefill_bytes(ours, pf.n_tokens) + memory.vision_bytes(ours, grids)]


def test_the_tower_takes_the_inputs_pixels_unjoined(pair, monkeypatch):
    _, ours = pair
    seen, run = [], type(ours.vision).run
    monkeypatch.setattr(type(ours.vision), "run", lambda tower, pixels, grids, backend=None:
                        seen.append(pixels) or run(tower, pixels, grids, backend=backend))
    imgs = preprocess_images(_image(64, 96, 2), SMALL) + preprocess_images(_image(64, 64, 3), SMALL)
    prefill_multimodal(ours, "Compare <image> with <image 2>.", images=imgs, use_cache=False)
    assert isinstance(seen[0], list) and [p.data_ptr() for p in seen[0]] == [i.pixels.data_ptr() for i in imgs]


def test_a_keyboard_interrupt_between_pieces_gives_the_blocks_back(pair, monkeypatch):
    _, ours = pair
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 8)
    gc.collect()
    free = ours.kv.pool.num_free

    def stop(stage, done, total):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with progress.reporting(stop):
            prefill_ids(ours, _ids(40, 8), use_cache=False)
    assert ours.kv.pool.num_free == free


def test_a_prompt_resumed_from_a_snapshot_that_the_fixed_cache_refuses_gives_its_blocks_back_at_once():
    """The fork of a snapshot's blocks made, then the room for the rest refused (a fixed store): the fork's copied
    block and its references go back at once, while the error's traceback still holds the frames (ComfyUI keeps
    it), so that the next prompt that needs the whole pool is not refused on their account."""
    import sys

    from qwen35_fast.runtime import demo_checkpoint
    model = load_model(demo_checkpoint(), dtype="fp32", device="cpu", backend="torch")
    model.setup_kv(model.kv.nbytes // model.kv.num_blocks * 30)
    pool, system = model.kv.pool, "You are a careful assistant that answers briefly and names things. " * 4
    prefill(model, "Hi.", system_prompt=system)
    assert pool.snapshots
    gc.collect()
    free, refs = pool.num_free, list(pool.refcount)
    gc.disable()
    try:
        try:
            prefill(model, "word " * 3000, system_prompt=system)  # resumes from the snapshot; longer than the pool
        except Qwen35Error:
            held = sys.exc_info()  # the traceback kept, as ComfyUI's execute() keeps it
        assert "K/V cache" in str(held[1]) and pool.num_free == free and pool.refcount == refs
        prefill_ids(model, list(range(100, 100 + pool.num_blocks * pool.block_size - 8)), use_cache=False)
    finally:
        gc.enable()


def test_a_run_in_passes_breaks_the_towers_calls_in_a_row(pair, monkeypatch):
    """The tower captures its graph at the second call in a row with the same grids (on a GPU; here the capture is
    a stand-in): a call in passes between two calls with the same grids is not "in a row", so none is captured, and
    the two calls after it are."""
    _, ours = pair
    tower = ours.vision
    captured = []

    class FakeGraph:
        def __init__(self, t, p, backend, pixels, key):
            captured.append(key)
            self.key, self.p = key, p

        def __call__(self, pixels):
            return tower(pixels, self.p)
    monkeypatch.setattr(vision_mod, "TowerGraph", FakeGraph)
    monkeypatch.setattr(type(tower), "_graphable", lambda self, x, p, backend, key: p.n_patches <= 24)
    monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", 24)
    monkeypatch.setattr(tower, "_graph", None)
    monkeypatch.setattr(tower, "_last", None)
    small = preprocess_images(_image(64, 64, 4), SMALL)[0]
    video = preprocess_video(torch.rand(5, 64, 64, 3, generator=torch.Generator().manual_seed(8)), 4.0, SMALL)
    assert len(tower_passes([video.grid], 24)) > 1 and small.n_patches <= 24
    tower.run(small.pixels, [small.grid])
    tower.run(video.pixels, [video.grid])  # in passes
    tower.run(small.pixels, [small.grid])
    assert captured == []
    got = tower.run(small.pixels, [small.grid])
    assert len(captured) == 1 and torch.equal(got, tower.run(small.pixels, [small.grid]))
