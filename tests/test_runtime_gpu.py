"""The runtime on a GPU: kernels vs the PyTorch path, graphed decode vs eager decode."""
import pytest
import torch

from qwen35_fast.runtime import Qwen35Error, SamplingParams, generate, load_model, prefill_ids

from _models import make_hf_model, peak_bytes, rel, spy_graphs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("gpu")
    make_hf_model(f, seed=4, vocab=248320, head_dim_lin=128)
    return f


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kernels_match_the_pytorch_path(folder, dtype):
    model = load_model(folder, dtype=dtype, device="cuda", backend="cuda")
    assert model.backend.name == "cuda"
    ids = list(torch.randint(0, 248000, (300,), generator=torch.Generator().manual_seed(0)).tolist())
    ours = prefill_ids(model, ids).logits
    model.set_backend("torch")
    ref = prefill_ids(model, ids).logits
    assert rel(ours, ref) < 2e-2


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_decode_steps_on_the_kernels_match_the_pytorch_path(folder, dtype):
    """Eight decode steps after a prefill, the same tokens fed to both backends (the decode kernels, gemv and
    its fused norms where the card takes them, paged attention's decode kernel; against the references), each
    on its own fork of the prefill's cache: every step's logits within the prefill's tolerance."""
    model = load_model(folder, dtype=dtype, device="cuda", backend="cuda")
    g = torch.Generator().manual_seed(1)
    pf = prefill_ids(model, torch.randint(0, 248000, (300,), generator=g).tolist())
    feed = torch.randint(0, 248000, (8,), generator=g).to("cuda")
    steps = {}
    for backend in ("cuda", "torch"):
        assert model.set_backend(backend).name == backend
        cache = pf.cache.clone(pf.n_tokens + len(feed), device=model.device)
        steps[backend] = [model.forward_decode(t.view(1), cache).float() for t in feed]
        assert cache.length == pf.n_tokens + len(feed)
    assert len(steps["cuda"]) == len(steps["torch"]) == len(feed)
    for i, (ours, ref) in enumerate(zip(steps["cuda"], steps["torch"])):
        assert torch.isfinite(ours).all(), f"step {i}"
        assert rel(ours, ref) < 2e-2, f"step {i}: {rel(ours, ref):.2e}"


def test_a_graphed_step_gives_the_eager_steps_logits_bit_for_bit(folder):
    """The same 24 tokens fed to a GraphedDecode and to forward_decode, each on its own fork of one prefill's
    cache: every step's logits equal (the graph replays the eager step's kernels on the same data). Where the
    generate() test below differs, this one tells the numbers from the loop."""
    from qwen35_fast.runtime.decode_graph import GraphedDecode
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    pf = prefill_ids(model, list(range(7000, 7100)))
    feed = torch.randint(0, 248000, (24,), generator=torch.Generator().manual_seed(5)).to("cuda")
    steps = {}
    for graphed in (True, False):
        cache = pf.cache.clone(pf.n_tokens + len(feed), device=model.device)
        step = GraphedDecode(model, cache, pf.n_tokens + len(feed)) if graphed else None
        steps[graphed] = [(step(t.view(1)) if graphed else model.forward_decode(t.view(1), cache)).clone()
                          for t in feed]
    differ = [i for i, (g, e) in enumerate(zip(steps[True], steps[False])) if not torch.equal(g, e)]
    assert not differ, (f"steps {differ} differ, the first by "
                        f"{float((steps[True][differ[0]] - steps[False][differ[0]]).abs().max()):.3g}")


def test_graphed_decode_gives_what_eager_decode_gives(folder, monkeypatch):
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    pf = prefill_ids(model, list(range(7000, 7100)))
    sampled = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9)
    steps = spy_graphs(monkeypatch)
    graphed = [generate(model, pf, max_new_tokens=24, sampling=s, seed=3) for s in (SamplingParams(), sampled)]
    assert len(steps) == 2 and all(g is not None for g in steps)  # (None: the capture failed, eager ran)
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    eager = [generate(model, pf, max_new_tokens=24, sampling=s, seed=3) for s in (SamplingParams(), sampled)]
    for g, e, name in zip(graphed, eager, ("greedy", "sampled")):
        first = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), None)
        assert g.token_ids == e.token_ids, f"{name}: token {first} differs ({g.token_ids} against {e.token_ids})"


@pytest.mark.parametrize("sampling", [
    SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),
    SamplingParams(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3),
    SamplingParams(repetition_penalty=1.5, presence_penalty=0.5),  # greedy with penalties: the kernel at top_k 1
], ids=["presence", "repetition", "greedy-penalised"])
def test_generate_picks_on_the_kernel_what_the_torch_ops_pick(folder, monkeypatch, sampling):
    """generate() with the sampling kernel (its penalties' marks updated by each launch, the next step queued
    before the host reads a token) gives the tokens of the same loop with every pick in torch ops."""
    import importlib

    gen_mod = importlib.import_module("qwen35_fast.runtime.generate")
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    pf = prefill_ids(model, list(range(7000, 7100)) * 2)
    kernel = generate(model, pf, max_new_tokens=32, sampling=sampling, seed=5).token_ids
    pick = gen_mod.pick
    monkeypatch.setattr(gen_mod, "pick", lambda logits, p, seed, n, backend, marks: pick(logits, p, seed, n, None,
                                                                                          marks))
    torch_ops = generate(model, pf, max_new_tokens=32, sampling=sampling, seed=5).token_ids
    assert kernel == torch_ops and len(kernel) > 8


def test_a_prefill_moved_to_ram_generates_the_same(folder):
    """ComfyUI unloads the model and parks cached prefills in RAM; generate brings the state back."""
    model = load_model(folder, dtype="bf16", device="cuda")
    pf = prefill_ids(model, list(range(9000, 9100)))
    before = generate(model, pf, max_new_tokens=12)
    model.to("cpu")  # the K/V store goes with the weights
    pf.cache.to("cpu")
    assert model.kv.device.type == "cpu"
    assert all(t is None or t.device.type == "cpu" for t in pf.cache.ssm)
    model.to("cuda")
    assert model.kv.device.type == "cuda"
    assert generate(model, pf, max_new_tokens=12).token_ids == before.token_ids


def test_repeated_generations_do_not_grow_vram_and_workspaces_free():
    from qwen35_fast.runtime import demo_checkpoint, free_gpu_workspaces
    model = load_model(demo_checkpoint(), dtype="bf16", device="cuda", backend="auto")
    pf = prefill_ids(model, list(range(1000, 1040)))
    assert pf.logits.device.type == "cpu"  # a cached prefill holds no VRAM beyond its state
    generate(model, pf, max_new_tokens=8)
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_allocated()
    for seed in range(4):  # each capture used a fresh pool stream once: one cuBLAS workspace apiece
        generate(model, pf, max_new_tokens=8, seed=seed)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == after_one
    weights = model.size_bytes()
    model.to("cpu")
    pf.cache.to("cpu")
    free_gpu_workspaces()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < after_one - weights + 2**20


def test_estimate_covers_a_long_prefill(folder):
    """runtime.memory's estimate (what the nodes ask ComfyUI to make room for) is not below what a prefill takes."""
    from qwen35_fast.runtime.memory import prefill_bytes
    model = load_model(folder, dtype="bf16", device="cuda")
    ids = list(torch.randint(0, 248000, (32768,), generator=torch.Generator().manual_seed(1)).tolist())
    prefill_ids(model, ids[:64])  # kernels built and workspaces made before measuring
    pf, peak = peak_bytes(lambda: prefill_ids(model, ids))
    print(f"prefill of 32768 tokens: peak {peak / 2**20:.0f} MiB, estimate {prefill_bytes(model, 32768) / 2**20:.0f} MiB")
    assert peak <= prefill_bytes(model, 32768)
    del pf


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_estimate_covers_a_generation_after_a_long_prompt(folder, backend):
    """generate_bytes (what Generate asks ComfyUI to make room for) is not below a generation's peak after an
    8,192-token prompt: on the kernels (a graphed decode) and on the PyTorch path, whose attention gathers the
    whole context each step."""
    from qwen35_fast.runtime.memory import generate_bytes
    model = load_model(folder, dtype="bf16", device="cuda", backend=backend)
    ids = torch.randint(0, 248000, (8192,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = SamplingParams(do_sample=False)
    generate(model, prefill_ids(model, ids[:64]), max_new_tokens=4, sampling=greedy)  # built, captured
    pf = prefill_ids(model, ids)
    out, peak = peak_bytes(lambda: generate(model, pf, max_new_tokens=48, sampling=greedy))
    want = generate_bytes(model, pf.n_tokens, 48)
    print(f"{backend}: generation of {out.n_tokens} tokens: peak {peak / 2**20:.1f} MiB, estimate "
          f"{want / 2**20:.1f} MiB")
    assert peak <= want


def test_a_prompt_read_in_pieces_gives_the_one_pass_logits_and_holds_less(folder, monkeypatch):
    """Pieces on the kernels (the first through SDPA, the others through the paged kernel over the pieces before):
    the logits of one pass within bf16's tolerance, and a lower peak for a long prompt."""
    from qwen35_fast.runtime import model as model_mod
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    ids = torch.randint(0, 248000, (16384,), generator=torch.Generator().manual_seed(2)).tolist()
    prefill_ids(model, ids[:64], use_cache=False)
    peaks, logits = {}, {}
    for piece in (16384, 3000):
        monkeypatch.setattr(model_mod, "PREFILL_PIECE", piece)
        pf, peaks[piece] = peak_bytes(lambda: prefill_ids(model, ids, use_cache=False))
        logits[piece] = pf.logits
        del pf
    print(f"peak MiB: one pass {peaks[16384] / 2**20:.0f}, pieces of 3000 {peaks[3000] / 2**20:.0f}")
    assert rel(logits[3000], logits[16384]) < 2e-2
    assert peaks[3000] < peaks[16384]


def test_out_of_memory_says_what_to_change_and_the_model_still_works(folder):
    """Issue 12 item 10: a 128k-token prefill with a fifth of what the estimate says it needs free (another model
    holding the rest; the prompt is read in pieces, so its K/V cache is most of that). The estimate is generous: on an
    H200 it said 823 MiB where the prefill's peak was 270 MiB, so a third of it (274 MiB) fitted now and then."""
    from qwen35_fast.runtime.memory import prefill_bytes
    model = load_model(folder, dtype="bf16", device="cuda")
    short = list(range(5000, 5040))
    before = generate(model, prefill_ids(model, short), max_new_tokens=8).token_ids
    ids = list(torch.randint(0, 248000, (131072,), generator=torch.Generator().manual_seed(2)).tolist())
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - prefill_bytes(model, len(ids)) // 5, dtype=torch.uint8, device="cuda")  # the diffusion model
    try:
        with pytest.raises(Qwen35Error, match=r"out of memory on cuda(:0)? reading a prompt of 131,072 tokens: that "
                                              r"needs about \d+\.\d\d GiB beyond .* and \d+\.\d\d GiB of "
                                              r"\d+\.\d\d GiB is free\. Shorten the prompt"):
            prefill_ids(model, ids)
    finally:
        del hog
    torch.cuda.empty_cache()
    assert generate(model, prefill_ids(model, short), max_new_tokens=8).token_ids == before
    assert prefill_ids(model, ids).n_tokens == 131072  # the same prompt goes through once memory is back


def test_one_decode_graph_follows_the_growing_cache(folder, monkeypatch):
    """The cache grows in blocks while one captured decode step runs the whole answer: its block table
    (room for the whole budget) gets the new blocks; the same tokens as eager decoding."""
    import importlib
    gen_mod = importlib.import_module("qwen35_fast.runtime.generate")
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    pf = prefill_ids(model, list(range(7000, 7100)))
    steps = spy_graphs(monkeypatch)
    monkeypatch.setattr(gen_mod, "KV_STEP", 16)
    penalised = SamplingParams(repetition_penalty=1.3)  # greedy without an early stop
    grown = generate(model, pf, max_new_tokens=120, sampling=penalised)
    assert len(steps) == 1 and steps[0].cache.capacity >= 220 > model.kv.block_size * 2
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    eager = generate(model, pf, max_new_tokens=120, sampling=penalised)
    assert grown.token_ids == eager.token_ids and grown.n_tokens == 120



def test_the_pytorch_path_decode_captures_in_a_graph_and_gives_the_eager_tokens(folder, monkeypatch):
    """The PyTorch path (GPUs without our kernels: AMD, NVIDIA before Ampere) reads nothing back to the host in a
    decode step (paged_attention_on_device), so generate() captures it in a CUDA graph, and the graph gives the
    tokens of eager decoding."""
    model = load_model(folder, dtype="bf16", device="cuda", backend="torch")
    pf = prefill_ids(model, list(range(7000, 7100)))
    penalised = SamplingParams(repetition_penalty=1.3)  # greedy without an early stop
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    eager = generate(model, pf, max_new_tokens=40, sampling=penalised)
    monkeypatch.delenv("QWEN35_CUDA_GRAPHS")
    steps = spy_graphs(monkeypatch)
    graphed = generate(model, pf, max_new_tokens=40, sampling=penalised)
    assert len(steps) == 1 and steps[0] is not None and model.backend.name == "torch"
    assert graphed.token_ids == eager.token_ids


def test_a_reused_prefix_gives_the_cold_logits_and_tokens(folder):
    """bf16 on the kernels: a prompt that reuses an earlier one's system prompt (paged attention over the
    cached blocks, GDN states from the snapshot) against the same prompt prefilled cold. Tolerance: the
    relative error of bf16 prefills that differ only in where the chunked scan and attention split
    (measured ~5e-3 here); greedy tokens equal."""
    from qwen35_fast.runtime import prefill
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    system = "You write prompts for an image model. " * 12
    prefill(model, "A harbour at dawn.", system_prompt=system)
    reused = prefill(model, "A forest in the rain, seen from above.", system_prompt=system)
    cold = prefill(model, "A forest in the rain, seen from above.", system_prompt=system, use_cache=False)
    assert reused.cached_tokens > 60 and cold.cached_tokens == 0
    assert rel(reused.logits, cold.logits) < 2e-2
    assert generate(model, reused, max_new_tokens=16).token_ids == generate(model, cold, max_new_tokens=16).token_ids


def test_the_decode_graph_is_captured_again_when_the_store_grows(folder, monkeypatch):
    """An auto store that starts with two blocks grows while a graphed generation runs: the pools move to
    larger tensors, generate captures its decode step again over them, and the tokens are those of the
    same graphed generation on a store large enough from the start (same table width, so the same key
    splits; eager decoding splits by its own table and may flip a near-tie after many tokens)."""
    from qwen35_fast.runtime import kv_store
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    penalised = SamplingParams(repetition_penalty=1.3)
    model.setup_kv(64 << 20)  # fixed, room for everything
    pf = prefill_ids(model, list(range(7000, 7100)))
    want = generate(model, pf, max_new_tokens=300, sampling=penalised)
    monkeypatch.setattr(kv_store, "AUTO_TOKENS", 128)
    store = model.setup_kv()
    assert store.growable and store.num_blocks == 2
    pf = prefill_ids(model, list(range(7000, 7100)))
    steps = spy_graphs(monkeypatch)
    graphed = generate(model, pf, max_new_tokens=300, sampling=penalised)
    assert store.version >= 2 and len(steps) >= 2 and steps[-1].version == store.version
    assert graphed.token_ids == want.token_ids and graphed.n_tokens == 300


def test_int8_weights_on_the_kernels_compute_what_the_dequantized_twin_does(folder, monkeypatch):
    """8-bit weights on the GPU: the prefill (kernels, dequantized matrices through cuBLAS) and the graphed decode
    (the int8 rows and their scales through gemv) give what a full model holding the dequantized matrices gives
    (a tolerance, not bit equality: the int8 product scales its fp32 sum once, the twin sums rounded weights),
    eager and graphed decode agree, and the weights take about half the VRAM of the full ones."""
    from qwen35_fast.runtime.quant import Int8Weight
    a = load_model(folder, dtype="bf16", device="cuda", backend="cuda", weights="int8")
    b = load_model(folder, dtype="bf16", device="cuda", backend="cuda", weights="full")
    full_bytes = b.weight_bytes()
    with torch.no_grad():
        for name, m in a.named_modules():
            if isinstance(m, Int8Weight):
                b.get_parameter(name).copy_(m.rows())
    assert a.int8 and a.backend.name == "cuda" and a.weight_bytes() < 0.6 * full_bytes
    assert a._gemv  # int8 decodes through gemv on every card
    ids = torch.randint(0, 248000, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    pa, pb = prefill_ids(a, ids), prefill_ids(b, ids)
    assert rel(pa.logits, pb.logits) < 2e-2
    steps = spy_graphs(monkeypatch)
    out = generate(a, pa, max_new_tokens=16, seed=1)
    assert len(steps) == 1 and steps[0] is not None  # the int8 products captured
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    assert generate(a, pa, max_new_tokens=16, seed=1).token_ids == out.token_ids
    twin = generate(b, pb, max_new_tokens=16, seed=1)
    same = next((i for i, (x, y) in enumerate(zip(out.token_ids, twin.token_ids)) if x != y), 16)
    assert same >= 4, (out.token_ids, twin.token_ids)  # random weights: near ties part them sooner or later


def test_an_answer_that_ends_where_a_fixed_store_is_full_is_whole_on_the_graphed_loop(folder, monkeypatch):
    """The graphed decode runs one step ahead of the host: behind the end-of-turn token that fills a fixed store's
    last position it wants one block more. The answer is whole; an answer that goes on is out of room, with the
    tokens it had counted."""
    import sys

    from qwen35_fast.runtime.kv_pool import model_sizes
    gen = sys.modules["qwen35_fast.runtime.generate"]
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    block = model_sizes(model.config, 64, 2)["kv_block_bytes"]
    store = model.setup_kv(4 * block * 4 // 3 + 1)  # four blocks of 64 positions, fixed
    assert store.num_blocks == 4 and not store.growable and store.block_size == 64
    pf = prefill_ids(model, list(range(5000, 5064)), use_cache=False)
    eos = model.tokenizer.eos_token_ids[0]
    answer = [100 + i for i in range(256 - 64)] + [eos]
    monkeypatch.setattr(gen, "pick", lambda logits, p, seed, n, backend=None, marks=None:
                        torch.tensor([answer[n]], device=logits.device))
    steps = spy_graphs(monkeypatch)
    out = generate(model, pf, max_new_tokens=500)
    assert steps and steps[-1] is not None
    steps.clear()  # (a spied graph holds its generation's cache: its blocks)
    assert out.finish_reason == "stop" and list(out.token_ids) == answer[:-1]
    answer[-1] = 99
    with pytest.raises(Qwen35Error, match=r"The answer had 193 tokens after a prompt of 64: lower max_new_tokens"):
        generate(model, pf, max_new_tokens=500)


def test_a_kept_graph_keeps_its_cublas_workspace_when_workspaces_are_freed():
    """capture_graph lets cuBLAS's workspace go before the capture, so that the captured products take one inside
    the graph's pool: free_gpu_workspaces (another model unloaded) then frees nothing a kept graph writes to, and
    memory handed out after it is never written by a replay."""
    from qwen35_fast.runtime.decode_graph import capture_graph, free_gpu_workspaces
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(96, 4096, device=dev, dtype=torch.bfloat16, generator=g)  # few rows: a split-K product
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty(96, 4096, device=dev, dtype=torch.bfloat16)
    graph, _, _ = capture_graph(dev, lambda: torch.matmul(a, b, out=out))
    free_gpu_workspaces()
    taken = [torch.zeros(2**20, dtype=torch.uint8, device=dev) for _ in range(256)]  # what was freed, handed out
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, a.float() @ b.float()) < 1e-2
    assert not any(t.any() for t in taken)
