"""The vision tower from both checkpoint forms, checkpoints without it, and prompts past the positions."""
import pytest
import torch

from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.generate import generate, prefill
from qwen35_fast.runtime.loader import load_model
from qwen35_fast.runtime.media import Preprocessing, preprocess_images
from qwen35_fast.runtime.multimodal import IMAGE_PAD, VISION_END, VISION_START, prefill_multimodal
from qwen35_fast.runtime.sampling import SamplingParams

ONE_HEAD = dict(num_heads=1)
IMAGE = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # one head of 64: what a single file of a width that is not a released one is read as
    return make_checkpoint(tmp_path_factory.mktemp("hf"), seed=3, vision_overrides=ONE_HEAD)


def test_folder_and_single_file_give_the_same_tower(folder, tmp_path):
    single = make_checkpoint(tmp_path, seed=3, single_file=True, include_vision=True, vision_overrides=ONE_HEAD)
    a = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    b = load_model(single, dtype="fp32", device="cpu", backend="torch")
    assert a.vision is not None and b.vision is not None
    assert a.vision.config == b.vision.config  # sizes inferred from shapes = config.json's
    for (name, pa), (_, pb) in zip(a.vision.named_parameters(), b.vision.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.vision.patch_w.dtype == torch.float32 and a.vision.patch_w.device.type == "cpu"
    pa = prefill_multimodal(a, "What is it?", images=IMAGE)
    pb = prefill_multimodal(b, "What is it?", images=IMAGE)
    assert pa.token_ids == pb.token_ids and torch.equal(pa.logits, pb.logits)


def test_checkpoint_without_vision_weights(tmp_path):
    single = make_checkpoint(tmp_path, seed=3, single_file=True, include_vision=False)
    model = load_model(single, dtype="fp32", device="cpu", backend="torch")
    assert model.vision is None
    with pytest.raises(Qwen35Error, match="no usable vision tower.*text prompts still work"):
        prefill_multimodal(model, "What is it?", images=IMAGE)
    assert prefill(model, "Hello").n_tokens > 0  # text still works
    assert prefill_multimodal(model, "Hello").n_tokens > 0  # and so does the multimodal path without images


def test_too_many_vision_tokens_names_both_numbers(tmp_path):
    folder = make_checkpoint(tmp_path, seed=3, text_overrides=dict(max_position_embeddings=300))
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    big = torch.rand(1, 512, 512, 3)  # 1,024 patches -> 256 tokens, plus the chat frame
    with pytest.raises(Qwen35Error, match=r"the prompt has 5\d\d tokens, 512 of them image.*at most 300 positions"):
        prefill_multimodal(model, "Describe.", images=torch.cat([big, big]))
    assert prefill_multimodal(model, "Describe.", images=big).vision.vision_tokens == 256


def test_token_layout_and_placeholders(folder):
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    imgs = torch.rand(2, 64, 64, 3)
    pp = Preprocessing(min_pixels=64 * 64, max_pixels=64 * 64)
    inputs = preprocess_images(imgs, pp)
    pf = prefill_multimodal(model, "Left <image 2> right", images=inputs)
    ids = list(pf.token_ids)
    # the unnamed image 1 goes before the text, image 2 where the prompt names it
    text = model.tokenizer.decode(ids)
    assert text.count("<|vision_start|>") == 2 and ids.count(IMAGE_PAD) == 8
    first, second = [i for i, t in enumerate(ids) if t == VISION_START]
    assert model.tokenizer.decode(ids[:first]).endswith("user\n")
    assert model.tokenizer.decode(ids[ids.index(VISION_END) + 1:second]) == "Left "
    # which image is where (both have 4 tokens): the spans' keys are their own pixels'
    from qwen35_fast.runtime.fingerprint import content_hash
    keys = [x.content_key(content_hash) for x in inputs]
    assert keys[0] != keys[1] and [m.content_hash for m in pf.media] == keys
    assert [m.start for m in pf.media] == [first + 1, second + 1]
    with pytest.raises(Qwen35Error, match="<image 3> but 2 image"):
        prefill_multimodal(model, "see <image 3>", images=inputs)
    with pytest.raises(Qwen35Error, match="places image 1 twice"):
        prefill_multimodal(model, "<image 1> and <image 1>", images=inputs)
    with pytest.raises(Qwen35Error, match="no video"):
        prefill_multimodal(model, "<video>", images=inputs)


def test_generation_after_an_image_is_deterministic(folder):
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    pf = prefill_multimodal(model, "Caption this.", images=IMAGE)
    a = generate(model, pf, max_new_tokens=6, sampling=SamplingParams(do_sample=False))
    b = generate(model, pf, max_new_tokens=6, sampling=SamplingParams(do_sample=False))
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    assert pf.cache.rope_delta < 0  # the image's tokens share positions


def test_tower_traces_as_one_graph_for_torch_compile():
    """No graph break in the tower (two image sizes, so two attention groups); aot_eager gives eager's output."""
    import torch._dynamo as dynamo

    from qwen35_fast.runtime.vision import VisionConfig, VisionTower
    vc = VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=32)
    tower = VisionTower(vc, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.1)
    plan = tower.plan([(1, 8, 12), (1, 4, 4)])
    x = torch.randn(plan.n_patches, vc.patch_dim)
    explained = dynamo.explain(tower.forward)(x, plan)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    dynamo.reset()
    assert torch.equal(torch.compile(tower.forward, backend="aot_eager")(x, plan), tower(x, plan))


def test_command_line_reads_an_image(tmp_path, capsys):
    pytest.importorskip("PIL")
    from PIL import Image

    from qwen35_fast.runtime.cli import main
    Image.new("RGB", (96, 64), (200, 30, 30)).save(tmp_path / "red.png")
    assert main(["demo", "--image", str(tmp_path / "red.png"), "--prompt", "Colour of <image>?",
                 "--max-new-tokens", "2", "--dtype", "fp32", "--device", "cpu"]) == 0
    from qwen35_fast.runtime.media import smart_resize
    h, w = smart_resize(64, 96)  # scaled up to min_pixels: 224 x 320
    assert f"vision         : {h * w // 32 ** 2} image tokens" in capsys.readouterr().out
    assert main(["demo", "--image", str(tmp_path / "missing.png")]) == 2


def test_command_line_reads_image_files_as_comfyui_loads_them(tmp_path, monkeypatch):
    """A 16-bit grey PNG over its whole range (RGB clipped it at 255: all white), a palette PNG's transparency
    kept (composited on white by the tower, as an RGBA one), a phone photo turned by its EXIF orientation, and a
    decompression bomb named (Pillow's error is no OSError)."""
    pytest.importorskip("PIL")
    import numpy as np
    from PIL import Image

    from qwen35_fast.runtime.cli import _read_image
    ramp = np.linspace(0, 65535, 16 * 256).astype(np.uint16).reshape(16, 256)
    Image.fromarray(ramp).save(tmp_path / "grey16.png")
    grey = _read_image(str(tmp_path / "grey16.png"))
    assert grey.shape == (1, 16, 256, 3) and torch.equal(grey[..., 0], grey[..., 2])
    assert grey.min() == 0 and grey.max() == 1 and 0.45 < float(grey.mean()) < 0.55

    logo = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    logo.paste((200, 30, 30, 255), (8, 8, 24, 24))
    logo.save(tmp_path / "rgba.png")
    logo.quantize(colors=4).save(tmp_path / "palette.png")
    rgba, palette = (_read_image(str(tmp_path / f)) for f in ("rgba.png", "palette.png"))
    assert rgba.shape == palette.shape == (1, 32, 32, 4)
    assert float(palette[0, 0, 0, 3]) == 0 and float(palette[0, 16, 16, 3]) == 1

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turned 90 degrees on its side, as a phone holds a portrait
    Image.new("RGB", (60, 40), (10, 200, 10)).save(tmp_path / "phone.jpg", exif=exif)
    assert _read_image(str(tmp_path / "phone.jpg")).shape == (1, 60, 40, 3)

    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # (a 200 MP scan, without writing one)
    with pytest.raises(Qwen35Error, match=r"--image .*big.png: Image size \(4096 pixels\) exceeds limit of 2000 "
                                          r"pixels, could be decompression bomb DOS attack; scale it down first"):
        _read_image(str(tmp_path / "big.png"))


def test_multimodal_prefill_reserves_its_memory_and_names_an_out_of_memory(folder, monkeypatch):
    from qwen35_fast.runtime.memory import prefill_bytes, vision_bytes

    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    asked = []
    before = prefill_multimodal(model, "Caption this.", images=IMAGE, reserve=asked.append)
    grids = before.vision.grids  # after the resize to the pixel limits
    assert asked == [prefill_bytes(model, before.n_tokens) + vision_bytes(model, grids)]
    assert vision_bytes(model, grids) > vision_bytes(model, []) == 0

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    want = prefill_multimodal(model, "Caption this.", images=IMAGE, use_cache=False).logits
    with monkeypatch.context() as m:
        m.setattr(model.vision, "forward", oom)
        with pytest.raises(Qwen35Error, match=rf"out of memory on cpu reading a prompt of {before.n_tokens} tokens "
                                              r"\(\d+ of them image / video tokens; lower max_pixels.*\): that needs "
                                              r"about \d+\.\d\d GiB"):
            prefill_multimodal(model, "Caption this.", images=IMAGE, use_cache=False)  # else the image is cached
        m.setattr(model, "_prefill", oom)
        with pytest.raises(Qwen35Error, match="out of memory on cpu"):
            prefill_multimodal(model, "Caption this.", images=IMAGE, use_cache=False)
    after = prefill_multimodal(model, "Caption this.", images=IMAGE, use_cache=False)
    assert torch.equal(after.logits, want)  # the model is unchanged


def test_a_follow_up_reserves_its_new_turn_and_images(folder):
    """continue_prefill asks for room for its own new tokens and this turn's images, before any device work."""
    from qwen35_fast.runtime import continue_prefill
    from qwen35_fast.runtime.memory import prefill_bytes, vision_bytes

    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    parent = prefill(model, "Hello.")
    asked = []
    child = continue_prefill(model, parent, "And <image>?", images=IMAGE, previous_answer="Hi.", reserve=asked.append)
    # the new tokens' activations, and where the attention runs in PyTorch what it gathers over the whole turn
    assert asked == [prefill_bytes(model, child.new_tokens, child.n_tokens) + vision_bytes(model, child.vision.grids)]
    asked.clear()
    text = continue_prefill(model, parent, "More.", reserve=asked.append)
    assert asked == [prefill_bytes(model, text.new_tokens, text.n_tokens)]


def test_the_tower_keeps_the_plans_of_its_last_grids(monkeypatch):
    """Images of one size get the plan made for the first (the same tensors); the least recently used of
    PLAN_CACHE goes; a plan above PLAN_CACHE_PATCHES is made every time; a move of the weights drops them,
    and a kept plan equals a fresh one."""
    from qwen35_fast.runtime import vision
    vc = vision.VisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=32)
    tower = vision.VisionTower(vc, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(vision, "PLAN_CACHE", 2)
    monkeypatch.setattr(vision, "PLAN_CACHE_PATCHES", 200)
    a = tower.plan([(1, 8, 12)])
    assert tower.plan([[1, 8, 12]]) is a  # lists or tuples, ints of any kind
    fresh = vision.plan(vc, [(1, 8, 12)], tower.device)
    assert all(torch.equal(getattr(a, f), getattr(fresh, f)) for f in ("table", "inv_freq", "cu_seqlens"))
    b = tower.plan([(1, 4, 4)])
    assert tower.plan([(1, 8, 12)]) is a  # a is now the most recent: b goes first
    tower.plan([(2, 4, 4)])
    assert tower.plan([(1, 8, 12)]) is a and tower.plan([(1, 4, 4)]) is not b
    big = tower.plan([(1, 16, 16)])  # 256 patches > 200
    assert tower.plan([(1, 16, 16)]) is not big
    tower.to(torch.float64)
    assert tower.plan([(1, 8, 12)]) is not a


def small_tower(depth: int = 1, seed: int = 0):
    """A 64-wide fp32 tower of `depth` blocks on the CPU, its weights random (scale 0.1) from `seed`."""
    from qwen35_fast.runtime import vision
    vc = vision.VisionConfig(depth=depth, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=32)
    tower = vision.VisionTower(vc, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tower


def test_the_tower_captures_on_the_second_call_in_a_row_and_replays_after(monkeypatch):
    """VisionTower.run's choice between eager, capture and replay (the CUDA graph stood in for by one that
    runs the tower eagerly; tests/test_vision_gpu.py runs the real one): one graph kept, the grids of the last
    call decide when to capture, a refused capture is not tried again, a move of the weights drops the graph;
    every call gives the eager output."""
    from qwen35_fast.runtime import vision
    tower = small_tower()
    vc = tower.config
    made, replayed = [], []

    class Graph:
        def __init__(self, t, p, backend, x, key):
            made.append(key[0])
            self.key, self.p, self.nbytes = key, p, 1

        def __call__(self, x):
            replayed.append(self.key[0])
            return tower(x, self.p)

    monkeypatch.setattr(vision, "TowerGraph", Graph)
    monkeypatch.setattr(vision.VisionTower, "_graphable", lambda self, x, p, backend, key: key not in self._no_graph)
    A, B = ((1, 4, 4),), ((1, 16, 8),)  # 16 and 128 patches: buckets 64 and 192 (no bucket graph between them)

    def call(grids):
        x = torch.randn(sum(t * h * w for t, h, w in grids), vc.patch_dim)
        assert torch.equal(tower.run(x, grids), tower(x, tower.plan(grids)))

    call(A)
    assert made == [] and replayed == []  # the first call with some grids: eager
    call(A)
    assert made == [A] and replayed == [A]  # the second in a row: captured, then replayed
    call(A)
    call(B)  # other grids: eager, A's graph kept
    call(A)
    assert made == [A] and replayed == [A, A, A] and tower.graph_bytes() == 1
    call(B)
    call(B)  # B twice in a row: B's graph replaces A's
    assert made == [A, B] and tower._graph.key[0] == B
    tower.to(torch.float64)
    assert tower._graph is None and tower.graph_bytes() == 0
    tower.to(torch.float32)

    def refuse(*a):
        made.append("refused")
        raise RuntimeError("capture refused")
    monkeypatch.setattr(vision, "TowerGraph", refuse)
    for _ in range(4):
        call(A)
    assert made == [A, B, "refused"] and tower._graph is None  # tried once, eager since


def test_the_tower_runs_in_the_dtype_its_weights_were_moved_to():
    """A .to(dtype) of the tower: its pixels go in the weights' new dtype (not the one it was made with), and
    whether a bucket graph may replay other layouts is decided for the new dtype (fp32 takes none)."""
    from qwen35_fast.runtime import vision
    tower = small_tower(depth=2, seed=3)
    grids = [(1, 4, 6), (2, 2, 2)]
    x = torch.randn(32, tower.config.patch_dim, generator=torch.Generator().manual_seed(4))
    tower.to(torch.float64)
    assert tower.dtype == torch.float64
    got = tower.run(x, grids)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, tower(x.double(), vision.plan(tower.config, grids, tower.device)))
    tower.to(torch.bfloat16)
    assert tower.dtype == torch.bfloat16 and tower.run(x, grids).dtype == torch.bfloat16
    tower.to(torch.float32)
    assert not tower._replays_other_layouts(None)  # (fp32: the positions kernel does not run)


def test_graph_buckets_pad_by_at_most_an_eighth():
    """graph_bucket: above n (the padding is a grid of its own), a multiple of 64 (whole 2 x 2 blocks), at most an
    eighth of n or 64 more; the sizes of ~1 megapixel images of the common aspect ratios share one bucket."""
    from qwen35_fast.runtime import vision
    for n in range(4, 40000, 4):
        b = vision.graph_bucket(n)
        assert n < b <= n + max(n // 8, 64) and b % 64 == 0, n
    assert {vision.graph_bucket(h * w) for h, w in ((52, 76), (56, 72), (48, 84), (60, 64), (40, 96))} == {4096}
    assert vision.pad_grids(((1, 4, 4), (2, 2, 6)), 64, 2) == ((1, 4, 4), (2, 2, 6), (1, 2, 12))
    for total in (40, 42):  # no padding left; a padding of no whole 2 x 2 blocks
        with pytest.raises(ValueError, match="cannot pad 40 patches"):
            vision.pad_grids(((1, 4, 4), (2, 2, 6)), total, 2)


@pytest.mark.parametrize("grids", [((1, 4, 4),), ((1, 6, 8), (1, 2, 2)), ((3, 4, 2),), ((1, 2, 2), (2, 4, 4))])
def test_a_padded_plan_gives_the_grids_own_tokens(grids):
    """The tower over a bucket's padded plan (the grids, then a grid of zero pixels of its own; the video's
    slices stay apart) gives the grids' tokens first, as their own plan does (fp32 on the CPU: the products of
    another number of rows round alike, attention never crosses into the padding)."""
    from qwen35_fast.runtime import vision
    tower = small_tower(depth=2, seed=11)
    vc, g = tower.config, torch.Generator().manual_seed(12)
    n = sum(t * h * w for t, h, w in grids)
    x = torch.randn(n, vc.patch_dim, generator=g)
    bucket = vision.graph_bucket(n)
    pp = vision.plan(vc, grids, torch.device("cpu"), pad_to=bucket)
    assert pp.padded and pp.n_patches == bucket and pp.max_len == bucket and pp.grids[:-1] == grids
    want = tower(x, vision.plan(vc, grids, torch.device("cpu")))
    got = tower(torch.cat([x, torch.zeros(bucket - n, vc.patch_dim)]), pp)
    assert got.shape == (bucket // 4, 32)
    torch.testing.assert_close(got[:n // 4], want, rtol=1e-5, atol=1e-6)


def test_other_grids_of_one_bucket_capture_one_padded_graph_and_replay_it(monkeypatch):
    """VisionTower.run with grids of one layout in one bucket (the graph stood in for by one that runs the tower
    over the padded plan it is handed, as the real one reads it): two calls in a row with different grids capture
    the bucket's graph, later calls of that layout and bucket replay it with their own padded plan, each giving
    the eager output's tokens; another layout (two images) or a bucket above GRAPH_PATCHES runs eagerly, an
    exact graph still comes from a repeat of one size, and a refused padded capture is not tried again. A size's
    padded plan is kept with the plans: its repeat makes none, nor do three sizes of a bucket in turn."""
    from qwen35_fast.runtime import vision
    tower = small_tower()
    vc = tower.config
    made, replayed, plans = [], [], []
    make_plan = vision.plan

    def counted_plan(vc, grids, device, pad_to=None):
        plans.append((grids, pad_to))
        return make_plan(vc, grids, device, pad_to=pad_to)
    monkeypatch.setattr(vision, "plan", counted_plan)

    class Graph:
        def __init__(self, t, p, backend, x, key):
            made.append(key)
            real = sum(a * b * c for a, b, c in p.grids[:-1]) if p.padded else x.shape[0]
            assert x.shape[0] == p.n_patches and not x[real:].any()  # the padding's pixels are zeros
            self.key, self.p, self.nbytes = key, p, 1

        def __call__(self, x, p=None):
            p = p or self.p
            replayed.append(p.grids[:-1] if p.padded else p.grids)
            assert p.padded == (self.key[0] == "bucket") and p.n_patches == self.p.n_patches
            pad = x.new_zeros(p.n_patches - x.shape[0], x.shape[1])
            return tower(torch.cat([x, pad]), p)[:x.shape[0] // 4]

    monkeypatch.setattr(vision, "TowerGraph", Graph)
    monkeypatch.setattr(vision.VisionTower, "_graphable", lambda self, x, p, backend, key: key not in self._no_graph)
    monkeypatch.setattr(vision.VisionTower, "_replays_other_layouts", lambda self, backend: True)
    A, C, D, E = ((1, 4, 4),), ((1, 4, 8),), ((1, 8, 6),), ((1, 2, 2), (1, 4, 4))  # 16, 32, 48, 20 patches: bucket 64

    def call(grids):
        x = torch.randn(sum(t * h * w for t, h, w in grids), vc.patch_dim)
        torch.testing.assert_close(tower.run(x, grids), tower(x, tower.plan(grids)), rtol=1e-5, atol=1e-6)

    call(A)
    call(C)  # another size in A's bucket right after it: the bucket's graph
    assert made == [("bucket", 64, 1, 1, None)] and replayed == [C]
    call(D)
    call(A)
    call(A)  # a repeat replays the bucket's graph too
    assert len(made) == 1 and replayed == [C, D, A, A]
    assert [g for g, pad in plans if pad] == [C, D, A]  # (A's second replay took its kept padded plan)
    plans.clear()
    for grids in (C, D, A) * 2:
        call(grids)
    assert replayed[-6:] == [C, D, A] * 2 and plans == []  # each size's plan and padded plan kept
    call(E)
    call(E)  # two images: another layout, so another key; their repeat captures their exact graph
    assert made[1] == (E, None) and replayed[-1] == E
    call(D)
    assert replayed[-1] == E and len(made) == 2  # D ran eagerly (the bucket's graph went for E's)
    monkeypatch.setattr(vision, "GRAPH_PATCHES", 60)
    call(C)
    call(D)
    assert len(made) == 2  # a bucket above GRAPH_PATCHES: eager

    monkeypatch.setattr(vision, "GRAPH_PATCHES", 16384)

    def refuse(*a):
        made.append("refused")
        raise RuntimeError("capture refused")
    monkeypatch.setattr(vision, "TowerGraph", refuse)
    for grids in (A, C, D, A, C):
        call(grids)
    assert made[2:] == ["refused"] and ("bucket", 64, 1, 1, None) in tower._no_graph


def test_a_bucket_graph_replays_other_sizes_through_its_own_plan_tensors(monkeypatch):
    """TowerGraph itself, its capture stood in for by a replay that runs the captured call again (reading the
    graph's pixels and plan tensors, as the CUDA graph reads them): a bucket graph captured in inference mode
    (ComfyUI's) replays outside it too, each size of the bucket gets the tokens its own plan gives, whatever size
    came before it, and repeats replay rather than capture."""
    import types

    from qwen35_fast.runtime import decode_graph, vision
    tower = small_tower(depth=2, seed=5)
    vc, g = tower.config, torch.Generator().manual_seed(6)
    replays = []

    def capture(dev, run, restore=None, measure=True):
        out = run()

        def replay():
            replays.append(1)
            with torch.inference_mode():  # (the graph's kernels write its output whatever the caller's mode)
                out.copy_(run())
        return types.SimpleNamespace(replay=replay), out, 0
    monkeypatch.setattr(decode_graph, "capture_graph", capture)
    monkeypatch.setattr(vision.VisionTower, "_graphable", lambda self, x, p, backend, key: key not in self._no_graph)
    monkeypatch.setattr(vision.VisionTower, "_replays_other_layouts", lambda self, backend: True)
    real_positions = vision.kernels.vision_positions

    def positions(x, pos_embed, table, grids, *a, **k):  # the grids as the table holds them, as positions.cu reads
        return real_positions(x, pos_embed, table, [tuple(r[:3]) for r in table.tolist()], *a, **k)
    monkeypatch.setattr(vision.kernels, "vision_positions", positions)
    pixels = {}

    def call(grids):
        n = sum(t * h * w for t, h, w in grids)
        x = pixels.setdefault(grids, torch.randn(n, vc.patch_dim, generator=g))
        torch.testing.assert_close(tower.run(x, grids), tower(x, vision.plan(vc, grids, torch.device("cpu"))),
                                   rtol=1e-5, atol=1e-6)

    A, C, D, E = ((1, 4, 4),), ((1, 4, 8),), ((1, 8, 6),), ((2, 2, 6),)  # 16, 32, 48, 24 patches: bucket 64
    with torch.inference_mode():
        call(A)
        call(C)  # captured here
    assert tower._graph.key == ("bucket", 64, 1, 1, None) and len(replays) == 1
    for grids in (D, A, D, C, C):  # outside inference mode: each replays with its own plan
        call(grids)
    assert len(replays) == 6 and tower._graph.key == ("bucket", 64, 1, 1, None)
    call(E)  # a video of two slices: another layout, eager
    assert len(replays) == 6


def test_a_tower_of_another_width_is_left_out_by_name(tmp_path):
    """A tower whose merger writes another width than the text model's is not loaded (an image prompt would fail
    deep inside the prefill): the note names both widths, and image prompts say the tower is missing."""
    folder = make_checkpoint(tmp_path, seed=3, vision_overrides=dict(out_hidden_size=48))
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    assert model.vision is None
    assert "writes width 48 but the text model's width is 128" in model.vision_note
    with pytest.raises(Qwen35Error, match="no usable vision tower"):
        prefill_multimodal(model, "What is it?", images=IMAGE)


@pytest.mark.parametrize("grid", [(1, 5, 6), (1, 6, 5), (1, 1, 2), (0, 2, 2)])
def test_a_grid_that_is_no_whole_number_of_merged_blocks_is_refused(folder, grid):
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    with pytest.raises(Qwen35Error, match=rf"vision grid \({grid[0]}, {grid[1]}, {grid[2]}\) is not a whole number "
                                          r"of 2x2 patch blocks"):
        model.vision.plan([(1, 4, 4), grid])


@pytest.mark.parametrize("kind,grid,stamps", [("image", (1, 5, 6), ()), ("image", (2, 4, 4), ()),
                                              ("video", (2, 4, 4), (0.0,)), ("video", (1, 4, 4), (0.0, 1.0)),
                                              ("image", (1, 4, 5), ()), ("image", (1, 0, 4), ()),
                                              ("image", (1, 4, 0), ()), ("video", (1, 4, 4), ()),
                                              ("video", (0, 4, 4), ())])
def test_a_hand_made_input_whose_pads_would_not_be_its_tokens_is_refused(folder, kind, grid, stamps):
    """A VisionInput made by hand (not by media.py) with a grid of odd sides, an image of several temporal
    patches, or a video with another number of timestamps than slices, or none: refused by name before any work,
    not an IndexError / index_copy_ mismatch from the pad slots (a video of no slice lost the text before it)."""
    from qwen35_fast.runtime.media import VisionInput
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    inp = VisionInput(kind, torch.zeros(grid[0] * grid[1] * grid[2], model.vision.config.patch_dim), grid, (64, 64),
                      stamps)
    with pytest.raises(Qwen35Error, match=rf"{kind} grid \({grid[0]}, {grid[1]}, {grid[2]}\) is not one the tower"):
        prefill_multimodal(model, "What is it?", **({"images": [inp]} if kind == "image" else {"video": inp}))
