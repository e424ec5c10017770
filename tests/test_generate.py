"""generate(): greedy equals transformers, sampling is reproducible, a prefill is never changed."""
import contextlib
import sys

import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.runtime import Qwen35Error, SamplingParams, generate, load_model, prefill, prefill_ids

from _models import fixed_store, make_hf_model, rel

SAMPLED = SamplingParams(do_sample=True, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01,
                         repetition_penalty=1.1, presence_penalty=0.3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen")
    hf = make_hf_model(folder, seed=11, vocab=248320)
    return hf, load_model(folder, dtype="fp32", device="cpu")


def test_greedy_equals_transformers_greedy(pair):
    hf, model = pair
    ids = list(range(5000, 5040))
    out = generate(model, prefill_ids(model, ids), max_new_tokens=16)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=list(model.config.eos_token_ids), pad_token_id=0)[0, len(ids):]
    assert list(out.token_ids) == ref.tolist()[: len(out.token_ids)]
    assert out.n_tokens == 16 and out.finish_reason == "length"


def test_same_seed_same_text_and_the_prefill_is_unchanged(pair):
    _, model = pair
    pf = prefill(model, "Describe a red fox in the snow.")
    kv = lambda: [t for pair in pf.cache.gather_kv() for t in pair]  # noqa: E731
    snapshot = [None if t is None else t.clone() for t in pf.cache.ssm + pf.cache.conv + kv()]
    copied = model.kv.bytes_copied
    logits = pf.logits.clone()
    a = generate(model, pf, max_new_tokens=12, sampling=SAMPLED, seed=7)
    b = generate(model, pf, max_new_tokens=12, sampling=SAMPLED, seed=7)
    c = generate(model, pf, max_new_tokens=12, sampling=SAMPLED, seed=8)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids
    assert torch.equal(pf.logits, logits) and pf.cache.length == pf.n_tokens
    for before, now in zip(snapshot, pf.cache.ssm + pf.cache.conv + kv()):
        assert (before is None and now is None) or torch.equal(before, now)
    # each generation shares the prefill's blocks: at most its partly filled last block was copied
    block = model.kv.k[:, 0].numel() * 2 * model.kv.k.element_size()
    assert model.kv.bytes_copied - copied <= 3 * block


def test_on_token_streams_the_text_and_can_cancel(pair):
    _, model = pair
    pf = prefill(model, "Count to ten.")
    deltas = []
    out = generate(model, pf, max_new_tokens=8, on_token=lambda d, n, total: deltas.append((d, n, total)))
    assert [n for _, n, _ in deltas] == list(range(1, 9)) and all(t == 8 for *_, t in deltas)
    assert "".join(d for d, _, _ in deltas).strip() == out.text

    class Cancelled(Exception):
        pass

    def cancel(d, n, total):
        if n == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        generate(model, pf, max_new_tokens=8, on_token=cancel)


def test_prefill_inside_torch_compile_gives_the_same_logits(pair):
    _, model = pair
    ids = list(range(3000, 3070))
    eager = prefill_ids(model, ids).logits

    @torch.compile(backend="eager")
    def wrapped(scale):
        return prefill_ids(model, ids).logits * scale

    assert rel(wrapped(torch.tensor(1.0)), eager) == 0.0


def test_a_compiled_decode_step_runs_step_after_step_as_eager(pair):
    """torch.compile of the decode step with its default (automatic dynamic) shapes: the recompile for the next
    position traces the cache's bookkeeping too (it failed on the second token on a message's format spec)."""
    _, model = pair
    torch._dynamo.reset()
    ids = torch.tensor([[3000, 3001, 3002, 3003, 3004, 3005, 3006]])
    caches = model.new_cache(1, 64), model.new_cache(1, 64)
    for cache in caches:
        model.forward_prefill(ids, cache)
    compiled = torch.compile(model.forward_decode, backend="aot_eager")
    for token in (11, 500, 9000, 12):
        tok = torch.tensor([token])
        assert torch.equal(compiled(tok, caches[1]), model.forward_decode(tok, caches[0]))


def test_ops_on_strided_inputs_return_what_their_fakes_say():
    """Outputs are contiguous, as the fakes that torch.compile plans with say, for transposed inputs too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qwen35_fast.kernels import ops

    def strided(*shape):
        return torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))
    x, y, w, b = strided(6, 16), strided(6, 16), torch.randn(16), torch.randn(16)
    cases = [(ops.add_rms_norm_op, (x, y, w, 1e-6, False)), (ops.silu_mul_op, (strided(6, 32), False)),
             (ops.add_layer_norm_op, (x, y, w, b, 1e-6, False)),
             (ops.vision_positions_op, (strided(16, 8), torch.randn(9, 8), torch.zeros(1, 4, dtype=torch.int32),
                                        [1, 4, 4], torch.randn(2), 2, False)),
             # x with T fastest (channels_last), cos / sin in fp32 beside a bf16 x: still x's dtype, contiguous
             (ops.rms_norm_rope_op, (torch.randn(1, 5, 4, 64).to(memory_format=torch.channels_last), torch.randn(64),
                                     1e-6, torch.randn(5, 32), torch.randn(5, 32), False)),
             (ops.rms_norm_rope_op, (torch.randn(1, 5, 4, 64, dtype=torch.bfloat16), torch.randn(64), 1e-6,
                                     torch.randn(5, 32), torch.randn(5, 32), False))]
    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for r, f in zip(*(t if isinstance(t, tuple) else (t,) for t in (real, fake))):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), op


def test_kernel_ops_trace_into_a_full_graph():
    """The custom ops have fake implementations: a fullgraph compile traces through them, no break."""
    q, k = torch.randn(1, 70, 2, 32), torch.randn(1, 70, 2, 32)
    v, a, b = torch.randn(1, 70, 4, 32), torch.randn(1, 70, 4), torch.randn(1, 70, 4)
    A_log, dt = torch.zeros(4), torch.zeros(4)
    x, w = torch.randn(1, 70, 8), torch.randn(8, 4)

    def f(q, k, v, a, b, x):
        y, conv_state = kernels.causal_conv1d_prefill(x, w)
        o, state = kernels.gdn_chunk_prefill(q, k, v, a, b, A_log, dt)
        return o * 2, state, y, conv_state

    eager = f(q, k, v, a, b, x)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, a, b, x)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_on_a_cpu_each_token_is_read_before_the_next_step_and_no_step_follows_the_end(pair, monkeypatch):
    """The decode loop runs one step ahead only on CUDA: on a CPU a token reaches on_token before the step it
    feeds, and the end-of-turn token is the last step computed (none is wasted after it)."""
    import importlib
    gen_mod = importlib.import_module("qwen35_fast.runtime.generate")
    _, model = pair
    eos = model.tokenizer.token_id("<|im_end|>")
    script = iter([11, 12, 13, eos, 14, 15])
    monkeypatch.setattr(gen_mod, "pick", lambda logits, p, seed, n, backend, marks: torch.tensor([next(script)], device=logits.device))
    events = []
    real = model.forward_decode
    monkeypatch.setattr(model, "forward_decode", lambda ids, cache: events.append("step") or real(ids, cache))
    out = generate(model, prefill_ids(model, list(range(5000, 5010))), max_new_tokens=8,
                   on_token=lambda text, n, most: events.append(n))
    assert out.token_ids == (11, 12, 13) and out.finish_reason == "stop"
    assert events == [1, "step", 2, "step", 3, "step"]


def _scripted(monkeypatch, tokens):
    """generate picks `tokens` in turn, whatever the logits say (the list may change between calls)."""
    gen = sys.modules["qwen35_fast.runtime.generate"]
    monkeypatch.setattr(gen, "pick", lambda logits, p, seed, n, backend=None, marks=None: torch.tensor([tokens[n]]))
    return gen


def test_a_character_cut_by_the_length_limit_streams_as_the_text_has_it(pair, monkeypatch):
    _, model = pair
    tok = model.tokenizer
    ids = tok.encode("ok") + tok.encode("\U00013000")[:1]  # the last: the first byte(s) of a 4-byte character
    assert tok.decode(ids).endswith("\ufffd")
    _scripted(monkeypatch, ids)
    deltas = []
    out = generate(model, prefill_ids(model, list(range(5000, 5010))), max_new_tokens=len(ids),
                   on_token=lambda d, n, total: deltas.append(d))
    assert out.finish_reason == "length" and "".join(deltas) == out.text == tok.decode(ids).strip()


def test_the_decode_rate_counts_the_end_of_turn_step(pair, monkeypatch):
    """Each step a second on a stand-in clock: four tokens after the first, the end-of-turn one among them, in
    four seconds is one a second (three over four before)."""
    import types
    _, model = pair
    eos = model.tokenizer.eos_token_ids[0]
    gen = _scripted(monkeypatch, [100, 101, 102, 103, eos])
    now = [0.0]
    monkeypatch.setattr(gen, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    real = model.forward_decode
    monkeypatch.setattr(model, "forward_decode", lambda ids, cache: now.__setitem__(0, now[0] + 1) or real(ids, cache))
    out = generate(model, prefill_ids(model, list(range(5000, 5010))), max_new_tokens=50)
    assert out.token_ids == (100, 101, 102, 103) and out.finish_reason == "stop"
    assert out.decode_tokens_per_s == 1.0


@pytest.mark.parametrize("listed", [[248046, 248044, 248045], 248045])
def test_an_end_id_only_generation_config_lists_stops_the_answer(tmp_path, monkeypatch, listed):
    """transformers stops on generation_config.json's end ids too (a fine-tune may add one there only); a file
    that cannot be read adds none."""
    import json

    from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
    folder = make_checkpoint(tmp_path / "ck", text_overrides={"num_hidden_layers": 2,
                                                           "layer_types": ["linear_attention", "full_attention"]})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
    model = load_model(folder, dtype="fp32", device="cpu")
    assert 248045 in model.config.eos_token_ids
    _scripted(monkeypatch, [100, 101, 248045, 102])
    out = generate(model, prefill_ids(model, list(range(5000, 5010))), max_new_tokens=4)
    assert out.token_ids == (100, 101) and out.finish_reason == "stop"
    (folder / "generation_config.json").write_text("{not json")
    assert 248045 not in load_model(folder, dtype="fp32", device="cpu").config.eos_token_ids


def test_an_answer_stops_at_the_models_last_position(tmp_path, monkeypatch):
    """A prompt 8 positions short of max_position_embeddings (48) and an answer that never ends its turn: the
    answer takes exactly those 8 positions whatever max_new_tokens asks ("length"), and the memory asked for it
    is that of the 8 it can have, not of max_new_tokens (which the PyTorch attention would gather over)."""
    from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
    from qwen35_fast.runtime.memory import generate_bytes
    folder = make_checkpoint(tmp_path / "ck", text_overrides={"num_hidden_layers": 2, "max_position_embeddings": 48,
                                                           "layer_types": ["linear_attention", "full_attention"]})
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    pf = prefill_ids(model, list(range(5000, 5040)))
    room = 48 - pf.n_tokens
    script = [1000 + i for i in range(200)]  # ordinary ids, never an end-of-turn one
    _scripted(monkeypatch, script)
    for asked in (200, 50, room + 1):
        out = generate(model, pf, max_new_tokens=asked)
        assert out.token_ids == tuple(script[:room]) and out.finish_reason == "length", asked
    shorter = generate(model, pf, max_new_tokens=room - 1)
    assert shorter.n_tokens == room - 1 and shorter.finish_reason == "length"
    assert generate_bytes(model, pf.n_tokens, 200) == generate_bytes(model, pf.n_tokens, room)
    assert generate_bytes(model, pf.n_tokens, room) > generate_bytes(model, pf.n_tokens, room - 1)  # it counts them


def test_numpy_integers_are_whole_numbers(pair):
    import numpy as np
    _, model = pair
    pf = prefill_ids(model, np.array([5000, 5001, 5002]))
    np_args = generate(model, pf, np.int64(6), SamplingParams(do_sample=True, top_k=np.int64(3)), seed=np.int64(3))
    py_args = generate(model, pf, 6, SamplingParams(do_sample=True, top_k=3), seed=3)
    assert np_args.token_ids == py_args.token_ids


def test_a_batch_of_ids_is_refused_by_its_shape(pair):
    _, model = pair
    with pytest.raises(Qwen35Error, match=r"one sequence \(1-D\), got a Tensor of shape \[1, 3\]; pass ids\[0\]"):
        prefill_ids(model, torch.tensor([[5000, 5001, 5002]]))


def test_logits_that_leave_fp16s_range_are_an_error_not_a_run_of_one_token(tmp_path, pair):
    """One residual channel of a checkpoint past 65,504 (finite in fp32 and bf16): in fp16 the prompt's logits
    are NaN, and greedy would answer token 0 again and again (a draw: some other token again and again). Generate
    says so and what to do; the same file in bf16 answers. A step that turns NaN while answering (the cache or
    the state poisoned) is caught at the end."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ck"
    make_hf_model(folder, seed=3)
    path = folder / "model.safetensors"
    t = load_file(str(path))
    down, up = "model.language_model.layers.0.mlp.down_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"
    t[down] = t[down].clone()
    t[down][5] *= 6000
    t[up] = t[up] * 6000
    save_file(t, str(path), metadata={"format": "pt"})
    ids = list(range(10, 30))
    half = load_model(folder, dtype="fp16", device="cpu", backend="torch")
    pf = prefill_ids(half, ids)
    assert not torch.isfinite(pf.logits).all()
    for sampling in (SamplingParams(), SAMPLED):
        with pytest.raises(Qwen35Error, match=r"^the model's logits after the prompt of 20 tokens are not finite "
                                              r"numbers \(NaN or inf\): the model's activations left fp16's range "
                                              r".*load the model as bf16"):
            generate(half, pf, max_new_tokens=4, sampling=sampling)
    bf16 = load_model(folder, dtype="bf16", device="cpu", backend="torch")
    assert len(generate(bf16, prefill_ids(bf16, ids), max_new_tokens=2).token_ids) >= 1

    _, model = pair  # fp32: a step's NaN is blamed on the weights
    good = prefill_ids(model, ids)
    real = model.forward_decode
    calls = []

    def poisoned(tok, cache):
        calls.append(1)
        logits = real(tok, cache)
        return torch.full_like(logits, float("nan")) if len(calls) >= 2 else logits
    model.forward_decode = poisoned
    try:
        with pytest.raises(Qwen35Error, match=r"^the model's logits while answering \(found after \d+ tokens\) are "
                                              r"not finite .*weights hold NaN or inf"):
            generate(model, good, max_new_tokens=6, sampling=SamplingParams())
    finally:
        del model.forward_decode
    assert generate(model, good, max_new_tokens=3).token_ids  # and the model answers after it


def test_the_step_after_the_end_of_turn_token_is_no_part_of_the_check(pair, monkeypatch):
    """On CUDA the loop queues a step behind each token before the host reads it: after the end-of-turn token
    that step is never read. Non-finite logits there (the end-of-turn token fed back, an fp16 overflow on it) do
    not turn a finished answer into an error; non-finite logits that picked a token of the answer still do. The
    one-step-ahead order is emulated on the CPU (the host's token queue told it runs on CUDA)."""
    import importlib
    gen = importlib.import_module("qwen35_fast.runtime.generate")
    _, model = pair
    eos = model.tokenizer.token_id("<|im_end|>")
    pf = prefill_ids(model, list(range(5000, 5020)))

    class Ahead(gen._HostTokens):
        def __init__(self, dev):
            super().__init__(dev)
            self.cuda = True  # the loop's order on a GPU; the copies stay the CPU's

        def push(self, tok):
            self.slots[self.pushed % 2].copy_(tok.view(1))
            self.pushed += 1

        def pop(self):
            self.popped += 1
            return int(self.slots[(self.popped - 1) % 2][0])

    monkeypatch.setattr(gen, "_HostTokens", Ahead)
    script = {0: 11, 1: 12, 2: 13, 3: eos}
    monkeypatch.setattr(gen, "pick", lambda logits, p, seed, n, backend, marks: torch.tensor([script.get(n, 14)]))
    real = model.forward_decode
    poison = {eos}

    def decode(tok, cache):
        logits = real(tok, cache)
        return torch.full_like(logits, float("nan")) if int(tok.view(-1)[0]) in poison else logits
    monkeypatch.setattr(model, "forward_decode", decode)
    out = generate(model, pf, max_new_tokens=8)
    assert out.token_ids == (11, 12, 13) and out.finish_reason == "stop"
    poison = {13}  # the logits that picked the end-of-turn token are not finite: the answer is refused
    with pytest.raises(Qwen35Error, match=r"logits while answering \(found after 3 tokens\) are not finite"):
        generate(model, pf, max_new_tokens=8)


class _AheadOnCpu:
    """_HostTokens as on CUDA (cuda: the loop queues the next step before it reads a token), kept on the host."""
    cuda = True

    def __init__(self, dev):
        self.queue = []

    def push(self, tok):
        self.queue.append(int(tok))

    def pop(self):
        return self.queue.pop(0)

    def drain(self):
        pass


@contextlib.contextmanager
def _prompt_in_fixed_store(model, monkeypatch, blocks: int, prompt_tokens: int, ahead: bool):
    """A prompt of `prompt_tokens` ids prefilled into a fixed K/V store of `blocks` blocks of 64 positions, generated
    from one step ahead (as on CUDA) where `ahead`; the default store given back after."""
    if ahead:
        monkeypatch.setattr(sys.modules["qwen35_fast.runtime.generate"], "_HostTokens", _AheadOnCpu)
    assert fixed_store(model, blocks).block_size == 64
    try:
        yield prefill_ids(model, list(range(5000, 5000 + prompt_tokens)), use_cache=False)
    finally:
        model.setup_kv()


@pytest.mark.parametrize("ahead", [False, True])
def test_an_answer_that_ends_where_a_fixed_cache_is_full_is_no_error(pair, monkeypatch, ahead):
    """A fixed K/V store with room for the prompt and the answer exactly: the answer ends there with an end-of-turn
    token. Run one step ahead (as on CUDA) the step queued behind that token needs one block more; the answer is
    whole, so that step's lack of room is no error."""
    model = pair[1]
    with _prompt_in_fixed_store(model, monkeypatch, 4, 64, ahead) as pf:  # a prompt of one block
        eos = model.tokenizer.eos_token_ids[0]
        answer = [100 + i for i in range(256 - 64)] + [eos]  # fills the other three blocks to the last position
        _scripted(monkeypatch, answer)
        out = generate(model, pf, max_new_tokens=500)
        assert out.finish_reason == "stop" and list(out.token_ids) == answer[:-1]
        answer[-1] = 99  # an answer that goes on: no room, after the same tokens on both loops
        with pytest.raises(Qwen35Error, match=r"The answer had 193 tokens after a prompt of 64: lower max_new_tokens"):
            generate(model, pf, max_new_tokens=500)


def test_a_turn_that_ends_inside_its_thinking_is_the_answer(pair, monkeypatch):
    """Thinking on: the text before `</think>` is the thinking, after it the answer; a turn that ends (end-of-turn
    token) without closing the block is the answer, as Qwen's parsing reads it (an empty answer went downstream);
    a length cut before `</think>` is thinking with no answer yet."""
    model = pair[1]
    tok = model.tokenizer
    eos, close = model.tokenizer.eos_token_ids[0], tok.token_id("</think>")
    hmm, fox = tok.encode("Let me look."), tok.encode("A red fox.")
    pf = prefill(model, "Describe it.", thinking=True)
    for answer, budget, want in [(hmm + [close] + fox + [eos], 64, ("Let me look.", "A red fox.", "stop")),
                                 (fox + [eos], 64, ("", "A red fox.", "stop")),
                                 (hmm + [close] + fox, len(hmm), ("Let me look.", "", "length"))]:
        _scripted(monkeypatch, answer)
        out = generate(model, pf, max_new_tokens=budget)
        assert (out.thinking, out.text, out.finish_reason) == want


@pytest.mark.parametrize("ahead", [False, True])
def test_a_fixed_store_short_of_the_rounded_room_still_gives_the_next_block(pair, monkeypatch, ahead):
    """The answer takes its room in steps of KV_STEP positions; full at 256, a fixed store of five 64-position blocks
    cannot give the next step (512 positions) but has the one block the next token needs: the answer goes on into it
    and ends at its last position. An answer of exactly the store's room, cut by max_new_tokens, is whole on both loops: no
    step is queued behind the budget's last token (one would find the store full)."""
    model = pair[1]
    with _prompt_in_fixed_store(model, monkeypatch, 5, 192, ahead) as pf:  # a prompt of three blocks
        eos = model.tokenizer.eos_token_ids[0]
        answer = [100 + i for i in range(320 - 192)] + [eos]  # the other two blocks, to the last position
        _scripted(monkeypatch, answer)
        out = generate(model, pf, max_new_tokens=500)
        assert out.finish_reason == "stop" and list(out.token_ids) == answer[:-1]
        answer[-1] = 99  # as many tokens as the store holds, the last one the budget's
        out = generate(model, pf, max_new_tokens=len(answer))
        assert out.finish_reason == "length" and list(out.token_ids) == answer


def test_out_of_memory_behind_the_end_of_turn_token_is_no_error(pair, monkeypatch):
    """One step ahead (as on CUDA), the room for the step behind a token is taken before the token is read. Out of
    memory there is no error when that token ends the answer (the step is never read); where the answer goes on, it
    is the out-of-memory error, and the logits that picked the end-of-turn token are checked as ever. Any other error
    there is raised at once, the end of the turn or not."""
    model = pair[1]
    gen = sys.modules["qwen35_fast.runtime.generate"]
    cache_cls = sys.modules["qwen35_fast.runtime.model"].Cache
    monkeypatch.setattr(gen, "_HostTokens", _AheadOnCpu)
    pf = prefill_ids(model, list(range(5000, 5064)), use_cache=False)
    eos = model.tokenizer.eos_token_ids[0]
    answer = [100 + i for i in range(256 - 64)] + [eos]  # its last step behind it wants more than 256 positions
    _scripted(monkeypatch, answer)
    real, failure = cache_cls.reserve, []

    def reserve(self, capacity):
        if capacity > 256 and failure:
            raise failure[0]
        return real(self, capacity)
    monkeypatch.setattr(cache_cls, "reserve", reserve)
    failure.append(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    out = generate(model, pf, max_new_tokens=500)
    assert out.finish_reason == "stop" and list(out.token_ids) == answer[:-1]
    real_decode = model.forward_decode  # the logits that picked the end-of-turn token are still the ones checked

    def poisoned(tok, cache):
        logits = real_decode(tok, cache)
        return torch.full_like(logits, float("nan")) if int(tok.view(-1)[0]) == answer[-2] else logits
    monkeypatch.setattr(model, "forward_decode", poisoned)
    with pytest.raises(Qwen35Error, match=r"logits while answering \(found after 192 tokens\) are not finite"):
        generate(model, pf, max_new_tokens=500)
    monkeypatch.setattr(model, "forward_decode", real_decode)
    answer[-1] = 99  # the answer goes on: out of memory, once its token is read
    with pytest.raises(Qwen35Error, match=r"^out of memory on cpu generating after a prompt of 64 tokens"):
        generate(model, pf, max_new_tokens=500)
    answer[-1] = eos
    failure[0] = RuntimeError("an unrelated failure")  # not out of memory: raised, though the answer ends
    with pytest.raises(RuntimeError, match="an unrelated failure"):
        generate(model, pf, max_new_tokens=500)


def test_on_thinking_end_comes_at_the_think_token_not_at_its_spelling(pair, monkeypatch):
    """With thinking on, on_thinking_end runs once, just before the </think> token's text goes to on_token: thinking
    that spells "</think>" out of ordinary tokens is not its end (a page following the text showed the rest as
    the answer); the split agrees with Generation's. Thinking off: never."""
    gen = sys.modules["qwen35_fast.runtime.generate"]
    _, model = pair
    tok = model.tokenizer
    close, spelled = tok.token_id("</think>"), tok.encode_text(" </think> so")
    assert close not in spelled
    script = tok.encode_text("Hmm") + spelled + [close] + tok.encode_text("Red.") + [model.config.eos_token_ids[0]]
    real = gen.pick
    monkeypatch.setattr(gen, "pick", lambda logits, sampling, seed, n, *a: torch.full_like(
        real(logits, sampling, seed, n, *a), script[min(n, len(script) - 1)]))
    for thinking in (True, False):
        pf = prefill(model, "Think about tags.", thinking=thinking)
        seen = []
        out = generate(model, pf, max_new_tokens=30, on_token=lambda d, n, total: seen.append(d),
                       on_thinking_end=lambda: seen.append(None))
        if thinking:
            at = seen.index(None)
            assert seen.count(None) == 1 and seen[at + 1] == "</think>"
            assert "".join(seen[:at]).strip() == out.thinking == "Hmm </think> so"
            assert "".join(seen[at + 2:]).strip() == out.text == "Red."
        else:
            assert None not in seen and out.thinking == "" and "</think>" in out.text
