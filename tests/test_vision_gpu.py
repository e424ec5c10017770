"""Images on a GPU: the bf16 tower against transformers' (same weights), and a multimodal prefill plus
graphed decode on the CUDA kernels against the fp32 CPU run of the same checkpoint."""
import pytest
import torch

from qwen35_fast.runtime import SamplingParams, generate, load_model
from qwen35_fast.runtime.media import preprocess_images
from qwen35_fast.runtime.multimodal import prefill_multimodal
from qwen35_fast.runtime.vision import VisionTower, _targets, vision_config_from_hf

from _models import make_hf_model, peak_bytes, rel, spy_graphs

pytestmark = pytest.mark.gpu


def test_bf16_tower_matches_transformers_on_two_images():
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    cfg = Qwen3_5VisionConfig(depth=4, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = Qwen3_5VisionModel(cfg).to(torch.bfloat16).eval()
    tower = VisionTower(vision_config_from_hf({"vision_config": cfg.to_dict()}), torch.bfloat16,
                        torch.device("cuda"))
    sd = ref.state_dict()
    with torch.no_grad():
        for k, p in _targets(tower).items():
            p.copy_(sd[k].reshape(p.shape))
    imgs = preprocess_images(torch.rand(1, 512, 384, 3, device="cuda")) + \
        preprocess_images(torch.rand(1, 256, 640, 3, device="cuda"))
    pixels = torch.cat([i.pixels for i in imgs]).to(torch.bfloat16)
    grids = [i.grid for i in imgs]
    with torch.inference_mode():
        out = ref(pixels, grid_thw=torch.tensor(grids, device="cuda"))
        want = out if isinstance(out, torch.Tensor) else getattr(out, "pooler_output", None)
        want = out[0] if want is None else want
        got = tower(pixels, tower.plan(grids))
    assert rel(got.float(), want.float()) < 2e-2


def test_the_tower_in_passes_gives_one_passs_tokens_and_holds_less(monkeypatch):
    """A video and an image over TOWER_PASS_PATCHES run in passes on the kernels (bf16, 27 x 1152 widths, 4
    layers): one pass's tokens within bf16 rounding, and a lower peak."""
    from qwen35_fast import kernels
    from qwen35_fast.runtime import vision as vision_mod
    from qwen35_fast.runtime.media import preprocess_video
    from qwen35_fast.runtime.vision import VisionConfig, tower_passes
    vc = VisionConfig(depth=4, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048)
    tower = VisionTower(vc, torch.bfloat16, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(12)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.03 if p.dim() > 1 else 0.5))
    inputs = [preprocess_video(torch.rand(16, 360, 640, 3, device="cuda"), 2.0),
              *preprocess_images(torch.rand(1, 512, 512, 3, device="cuda"))]
    pixels, grids = torch.cat([i.pixels for i in inputs]).to(torch.bfloat16), [i.grid for i in inputs]
    be = kernels.select_backend("auto", torch.device("cuda"), torch.bfloat16)
    out, peak = {}, {}
    for limit in (10**9, 4096):
        monkeypatch.setattr(vision_mod, "TOWER_PASS_PATCHES", limit)
        with torch.inference_mode():
            out[limit], peak[limit] = peak_bytes(lambda: tower.run(pixels, grids, backend=be))
    assert len(tower_passes(grids, 4096)) > 2
    assert out[4096].shape == out[10**9].shape and rel(out[4096].float(), out[10**9].float()) < 1e-2
    assert peak[4096] < peak[10**9]


def test_tower_mlp_takes_the_gelu_in_the_gemm_epilogue_at_least_as_exactly():
    """The tower's MLP on CUDA (fc1's bias and tanh GELU in cuBLASLt's epilogue): within bf16 rounding of the
    fp32 MLP, and no further from it than the unfused bf16 GEMM, round, GELU."""
    import torch.nn.functional as F

    from qwen35_fast.runtime.vision import VisionBlock, VisionConfig
    vc = VisionConfig(depth=1, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048)
    g = torch.Generator(device="cuda").manual_seed(11)
    blk = VisionBlock(vc, torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.03 if p.dim() > 1 else 0.5))
    x = torch.randn(777, 1152, device="cuda", generator=g).bfloat16()
    f = {k: v.float() for k, v in blk.named_parameters()}
    want = F.linear(F.gelu(F.linear(x.float(), f["fc1_w"], f["fc1_b"]), approximate="tanh"), f["fc2_w"], f["fc2_b"])
    unfused = F.linear(F.gelu(F.linear(x, blk.fc1_w, blk.fc1_b), approximate="tanh"), blk.fc2_w, blk.fc2_b)
    got = VisionTower._mlp(blk, x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert rel(got.float(), want) < 1e-2
    assert rel(got.float(), want) <= 1.05 * rel(unfused.float(), want)


def test_images_of_two_sizes_take_one_attention_launch(monkeypatch):
    """On the kernels backend, slices of different lengths run as one attention call per layer: our kernel on
    sm_90a cards, else one variable-length flash attention call (the reference backend: one batched SDPA per
    length); the same features to bf16 rounding."""
    from qwen35_fast import kernels
    from qwen35_fast.runtime import vision
    vc = vision.VisionConfig(depth=3, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048)
    tower = VisionTower(vc, torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(p.numel()))
    imgs = preprocess_images(torch.rand(1, 512, 384, 3, device="cuda")) + \
        preprocess_images(torch.rand(1, 256, 640, 3, device="cuda"))
    pixels = torch.cat([i.pixels for i in imgs]).to(torch.bfloat16)
    plan = tower.plan([i.grid for i in imgs])
    assert len(plan.groups) == 2
    be = kernels.select_backend("cuda", torch.device("cuda"), torch.bfloat16)
    q = torch.empty(plan.n_patches, vc.num_heads, vc.head_dim, device="cuda", dtype=torch.bfloat16)
    ours = kernels.vision_attention_takes(q, q, q, plan.cu_seqlens, backend=be)
    if not ours and vision._varlen_attn() is None:
        pytest.skip("neither our attention kernel (sm_90a) nor torch.nn.attention.varlen here")
    calls = []
    if ours:
        real = kernels.vision_attention
        monkeypatch.setattr(kernels, "vision_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    else:
        real = vision._varlen_attn()
        monkeypatch.setattr(vision, "_varlen_attn", lambda: lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        got = tower(pixels, plan, backend=be)
        want = tower(pixels, plan)  # references: grouped SDPA
    assert len(calls) == vc.depth
    assert rel(got.float(), want.float()) < 1e-2


def test_multimodal_prefill_and_decode_on_cuda(tmp_path, monkeypatch):
    make_hf_model(tmp_path, seed=5, vocab=248320, head_dim_lin=128)
    image = torch.rand(1, 96, 160, 3, generator=torch.Generator().manual_seed(0))
    cpu = load_model(tmp_path, dtype="fp32", device="cpu", backend="torch")
    gpu = load_model(tmp_path, dtype="bf16", device="cuda", backend="auto")
    assert gpu.vision is not None and gpu.vision.patch_w.is_cuda
    a = prefill_multimodal(cpu, "What is this?", images=image)
    b = prefill_multimodal(gpu, "What is this?", images=image.cuda())
    assert a.token_ids == b.token_ids and rel(b.logits, a.logits) < 5e-2
    greedy = SamplingParams(do_sample=False)
    steps = spy_graphs(monkeypatch)
    graphed = generate(gpu, b, max_new_tokens=8, sampling=greedy)  # the image's rope_delta inside the graph
    assert len(steps) == 1 and steps[0] is not None
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    eager = generate(gpu, b, max_new_tokens=8, sampling=greedy)
    assert graphed.token_ids == eager.token_ids and len(eager.token_ids) >= 1


def test_the_estimates_cover_an_image_prompt_and_its_answer(tmp_path):
    """What a multimodal prefill asks ComfyUI to make room for (prefill_bytes + vision_bytes, through `reserve`)
    and what Generate asks for (generate_bytes) are not below the peaks they reach on the GPU: the tower over a
    1,536-patch image, the prompt's pass, and a graphed generation of 32 tokens after it."""
    from qwen35_fast.runtime.memory import generate_bytes
    make_hf_model(tmp_path, seed=6, vocab=248320, head_dim_lin=128)
    gpu = load_model(tmp_path, dtype="bf16", device="cuda", backend="auto")
    g = torch.Generator(device="cuda").manual_seed(3)
    image = torch.rand(1, 512, 768, 3, device="cuda", generator=g)
    greedy = SamplingParams(do_sample=False)
    warm = prefill_multimodal(gpu, "Warm up.", images=image[:, :128, :128])  # kernels built, workspaces made
    generate(gpu, warm, max_new_tokens=4, sampling=greedy)
    asked = []
    pf, peak = peak_bytes(lambda: prefill_multimodal(gpu, "What is in this picture?", images=image,
                                                     reserve=asked.append))
    assert pf.vision.vision_tokens == 384 and len(asked) == 1
    print(f"image prompt: peak {peak / 2**20:.1f} MiB, asked {asked[0] / 2**20:.1f} MiB")
    assert peak <= asked[0]
    out, peak = peak_bytes(lambda: generate(gpu, pf, max_new_tokens=32, sampling=greedy))
    want = generate_bytes(gpu, pf.n_tokens, 32)
    print(f"generation of {out.n_tokens} tokens: peak {peak / 2**20:.1f} MiB, estimate {want / 2**20:.1f} MiB")
    assert peak <= want


def test_image_prompt_waits_for_the_gpu_only_at_its_end(tmp_path, monkeypatch):
    """From the tower's first launch to the end of the prefill nothing in the runtime waits for the GPU
    (torch's sync debug mode names every implicit synchronisation): the text layers queue while the
    tower runs. The one wait left is the logits' read at the end (prefill_multimodal)."""
    import traceback
    import warnings

    from qwen35_fast.runtime import multimodal
    make_hf_model(tmp_path, seed=5, vocab=248320, head_dim_lin=128)
    gpu = load_model(tmp_path, dtype="bf16", device="cuda", backend="auto")
    image = torch.rand(1, 96, 160, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for use_cache in (False, True):
        gpu.kv.pool.clear()
        prefill_multimodal(gpu, "What is this?", images=image, use_cache=use_cache)  # warm: modules, graphs
        gpu.kv.pool.clear()
        tower_started, waits = [False], []
        start = multimodal.TowerClock.start
        monkeypatch.setattr(multimodal.TowerClock, "start", lambda self: tower_started.__setitem__(0, True) or start(self))

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/runtime/" in f.filename.replace("\\", "/")]
            if tower_started[0] and frames:
                waits.append(f"{frames[-1].name} ({frames[-1].filename.split('/')[-1]}:{frames[-1].lineno})")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            monkeypatch.setattr(warnings, "showwarning", record)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pf = prefill_multimodal(gpu, "What is this?", images=image, use_cache=use_cache)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        monkeypatch.undo()
        assert tower_started[0] and pf.vision.vision_ms > 0
        assert [w for w in waits if not w.startswith("prefill_multimodal ")] == [], (use_cache, waits)


def random_tower(depth: int, seed: int):
    """A bf16 tower of the 9B's width (1,152, 16 heads) and `depth` blocks on the GPU with small random weights,
    the CUDA backend, and the generator that made them (for the test's pixels)."""
    from qwen35_fast import kernels
    from qwen35_fast.runtime import vision
    vc = vision.VisionConfig(depth=depth, hidden_size=1152, intermediate_size=4304, num_heads=16,
                             out_hidden_size=2048)
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(seed)
    tower = VisionTower(vc, torch.bfloat16, dev)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, device=dev, generator=g) * 0.03)
    return tower, kernels.select_backend("cuda", dev, torch.bfloat16), g


def test_the_tower_replays_a_cuda_graph_from_the_second_call_with_the_same_grids(monkeypatch):
    """run(): the first call with some grids is eager, the second captures, later ones replay; each gives the
    eager forward's output bit for bit (the same kernels), whatever pixels it gets. Other grids run eagerly
    without dropping the graph; a move of the weights, QWEN35_CUDA_GRAPHS=0, or sizes above GRAPH_PATCHES
    never replay a graph, and a capture that fails leaves that size eager."""
    from qwen35_fast.runtime import vision
    tower, be, g = random_tower(3, 5)
    vc, dev = tower.config, tower.device
    grids, other = [(1, 16, 24), (1, 8, 8)], [(1, 32, 32)]

    def pixels(gr):
        n = sum(t * h * w for t, h, w in gr)
        return torch.randn(n, vc.patch_dim, device=dev, generator=g).bfloat16()

    def eager(x, gr):
        return tower(x, vision.plan(vc, gr, dev), backend=be)

    captures = []
    real = vision.TowerGraph
    monkeypatch.setattr(vision, "TowerGraph", lambda *a: captures.append(1) or real(*a))
    for i in range(4):
        x = pixels(grids)
        assert torch.equal(tower.run(x, grids, be), eager(x, grids))
        assert len(captures) == (0 if i == 0 else 1)
    assert tower.graph_bytes() >= x.numel() * x.element_size() + 1  # its input and its pool
    y = pixels(other)
    assert torch.equal(tower.run(y, other, be), eager(y, other))
    x = pixels(grids)
    assert torch.equal(tower.run(x, grids, be), eager(x, grids)) and len(captures) == 1  # replayed
    tower.to(dev)  # no move: the same tensors, yet the graph goes with any _apply
    assert tower._graph is None
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    for _ in range(3):
        tower.run(x, grids, be)
    assert len(captures) == 1 and tower._graph is None
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "1")
    monkeypatch.setattr(vision, "GRAPH_PATCHES", 100)
    for _ in range(3):
        tower.run(x, grids, be)
    assert len(captures) == 1 and tower._graph is None
    monkeypatch.setattr(vision, "GRAPH_PATCHES", 16384)

    def refuse(*a):
        raise RuntimeError("capture refused")
    monkeypatch.setattr(vision, "TowerGraph", refuse)
    for _ in range(3):
        assert torch.equal(tower.run(x, grids, be), eager(x, grids))
    assert tower._graph is None and (tower.plan(grids).grids, "cuda") in tower._no_graph


def test_other_sizes_of_one_bucket_replay_one_padded_graph(monkeypatch):
    """run(): two calls in a row with images of other sizes in one bucket (3,840 to 4,032 patches: 4,096) capture
    the bucket's padded graph (the attention's segments read on the device); every later size of that bucket
    replays it with its own plan and gives the eager output's tokens within the rounding of products of another
    row count; a replay after an image of another size gives what it gave before (its plan taken back into the
    graph's tensors)."""
    from qwen35_fast.runtime import vision
    tower, be, g = random_tower(2, 7)
    vc, dev = tower.config, tower.device
    captures, replays = [], []
    real = vision.TowerGraph
    monkeypatch.setattr(vision, "TowerGraph", lambda *a: captures.append(a[4]) or real(*a))
    real_call = real.__call__
    monkeypatch.setattr(real, "__call__", lambda self, *a: replays.append(1) or real_call(self, *a))
    sizes = [[(1, 60, 64)], [(1, 62, 64)], [(1, 52, 76)], [(1, 56, 72)], [(1, 60, 64)], [(1, 48, 84)]]
    inputs = {}
    for grids in sizes:
        n = sum(t * h * w for t, h, w in grids)
        x = inputs.setdefault(n, torch.randn(n, vc.patch_dim, device=dev, generator=g).bfloat16())
        got = tower.run(x, grids, be)
        want = tower(x, vision.plan(vc, grids, dev), backend=be)
        assert got.shape == want.shape == (n // 4, vc.out_hidden_size)
        assert rel(got.float(), want.float()) < 1e-2, grids
    assert captures == [("bucket", 4096, 1, 1, "cuda")] and tower._graph.key == captures[0] and len(replays) == 5
    x = inputs[60 * 64]
    first = tower.run(x, [(1, 60, 64)], be)
    tower.run(inputs[56 * 72], [(1, 56, 72)], be)  # 4,032 patches: 192 rows more than 3,840 of the next call
    assert torch.equal(tower.run(x, [(1, 60, 64)], be), first) and len(captures) == 1 and len(replays) == 8
    assert tower.graph_bytes() >= 4096 * vc.patch_dim * 2


def test_a_kept_graph_outlives_its_plan_in_the_towers_cache():
    """A graph keeps the plan its replays read: after other grids push that plan out of the tower's cache
    (PLAN_CACHE) and the allocator hands its memory to others, a replay still gives the eager output."""
    from qwen35_fast.runtime import vision
    tower, be, g = random_tower(2, 6)
    vc, dev = tower.config, tower.device
    grids = [(1, 24, 16)]
    x = torch.randn(384, vc.patch_dim, device=dev, generator=g).bfloat16()
    want = tower(x, vision.plan(vc, grids, dev), backend=be)
    tower.run(x, grids, be)
    tower.run(x, grids, be)  # captured
    for i in range(vision.PLAN_CACHE + 2):  # other sizes push the plan out; their plans land where it was
        other = [(1, 8, 8 * (i + 1))]  # (64, 128, 192 .. patches: each in another graph bucket than the one before)
        tower.run(torch.randn(64 * (i + 1), vc.patch_dim, device=dev, generator=g).bfloat16(), other, be)
    assert tower._graph is not None and tower._graph.key[0] == tuple(grids)
    assert torch.equal(tower.run(x, grids, be), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_on_the_second_gpu_gives_the_first_gpus_tokens(tmp_path):
    """ComfyUI may load the model onto cuda:1 while cuda:0 stays current: every launch (GDN, vision tower,
    paged attention, decode graphs) goes to the model's GPU (runtime.host.on_model_device), the current
    device is left as it was, and an image prompt gives what the same model gives on cuda:0."""
    make_hf_model(tmp_path, seed=5, vocab=248320, head_dim_lin=128)
    image = torch.rand(1, 96, 160, 3, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(do_sample=False)
    torch.cuda.set_device(0)
    runs = []
    for dev in ("cuda:0", "cuda:1"):
        model = load_model(tmp_path, dtype="bf16", device=dev, backend="auto")
        assert model.vision.patch_w.device == torch.device(dev)
        pf = prefill_multimodal(model, "What is this?", images=image.to(dev))
        runs.append((pf.logits.float().cpu(), generate(model, pf, max_new_tokens=8, sampling=greedy).token_ids))
        assert torch.cuda.current_device() == 0
        del model, pf
    (l0, t0), (l1, t1) = runs
    assert t1 == t0 and len(t0) >= 1
    assert rel(l1, l0) < 1e-3
