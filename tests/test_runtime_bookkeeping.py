"""The runtime's bookkeeping that other tests only pass through: blocks going back with dropped prefills, the
prefix cache's states moving with the model, the checkpoint stamp covering every file, the raw prompt keeping its
system prompt, the vocabulary's last id, the first token's time, long texts with multi-word added tokens, FP8 files
with 64 x 64 blocks, out of memory while a device is checked, the estimate of a follow-up over a long context,
and a decode step from an empty cache.
Each was a one-line change no test saw (mutation runs)."""
import gc
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen35_fast.runtime import Qwen35Error, generate, load_model, prefill, prefill_ids
from qwen35_fast.runtime.demo_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck"), with_tokenizer=True)


@pytest.fixture
def model(folder):
    return load_model(folder, dtype="fp32", device="cpu", backend="torch")


def test_dropped_prefills_give_their_blocks_back(model):
    model.setup_kv(8 << 20)
    pool = model.kv.pool
    start = pool.num_free
    for i in range(12):
        pf = prefill(model, "word " * 300 + str(i), use_cache=False)
        assert pool.num_free < start
        del pf
        gc.collect()
        assert pool.num_free == start


def test_a_model_move_moves_the_prefix_caches_states(model):
    """Module._apply (what .to() and ComfyUI's offload call) replaces every snapshot's conv and recurrent state:
    none is left on the device the model left; packed states stay packed."""
    prefill(model, "Describe a red circle.", system_prompt="You describe pictures.")
    snaps = model.kv.pool.snapshots
    before = [t for s in snaps for t in s.states.conv + s.states.ssm if t is not None]  # held: no id reused
    assert snaps and before
    from qwen35_fast.runtime.packed import flat_view
    packed = [s for s in snaps if flat_view(s.states.ssm) is not None]  # a turn's state: packed, moved in one copy
    assert packed
    model._apply(lambda t: t.clone())
    after = [t for s in snaps for t in s.states.conv + s.states.ssm if t is not None]
    assert len(after) == len(before) and not {id(t) for t in after} & {id(t) for t in before}
    assert all(flat_view(s.states.ssm) is not None and flat_view(s.states.conv) is not None for s in packed)


def test_a_packed_state_moved_stays_packed(model):
    """A prefill's turn state is packed (the conv states in one flat tensor, the recurrent states in another, so a
    graphed prefill from it copies it in two copies); moved off the device (a parked list item, an unloaded
    model), it moves in one copy each and stays packed, in the same shapes."""
    from qwen35_fast.runtime.packed import flat_view
    pf = prefill(model, "Name a colour.")
    turn = pf.turn
    assert all(flat_view(xs) is not None for xs in (turn.conv, turn.ssm))
    before = [None if t is None else t.shape for t in turn.ssm]  # (None: the attention layers)
    turn.to("meta")
    assert all(flat_view(xs) is not None and flat_view(xs).device.type == "meta" for xs in (turn.conv, turn.ssm))
    assert [None if t is None else t.shape for t in turn.ssm] == before
    pf.cache.to("meta")
    assert all(t.device.type == "meta" for t in pf.cache.ssm + pf.cache.conv if t is not None)
    model.kv.pool.clear()  # (the snapshot holding this turn is on meta now)


def test_a_shard_holding_only_the_vision_weights_is_stamped(folder, tmp_path):
    from qwen35_fast.runtime.checkpoint import locate
    from qwen35_fast.runtime.loader import check_unchanged, file_stamp
    d = tmp_path / "two-shards"
    shutil.copytree(folder, d)
    (d / "model.safetensors").unlink()
    w = load_file(folder / "model.safetensors")
    vis = {k: v for k, v in w.items() if k.startswith("model.visual")}
    names = {k: "model-00002-of-00002.safetensors" if k in vis else "model-00001-of-00002.safetensors" for k in w}
    save_file({k: v for k, v in w.items() if k not in vis}, d / "model-00001-of-00002.safetensors")
    save_file(vis, d / "model-00002-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    ck = locate(d)
    stamp = file_stamp(ck)
    save_file({k: v * 2 for k, v in vis.items()}, d / "model-00002-of-00002.safetensors")
    with pytest.raises(Qwen35Error, match="changed"):
        check_unchanged(ck, stamp)


def test_a_raw_prompt_keeps_its_system_prompt(model):
    from qwen35_fast.runtime.generate import encode_prompt
    ids = encode_prompt(model, "Continue the story.", system_prompt="You are a pirate.", use_chat_template=False)
    assert model.tokenizer.decode(ids) == "You are a pirate.\n\nContinue the story."


def test_the_id_one_past_the_vocabulary_is_refused_by_name(model):
    v = model.config.vocab_size
    prefill_ids(model, [1, 2, v - 1], use_cache=False)
    with pytest.raises(Qwen35Error, match=str(v)):
        prefill_ids(model, [1, 2, v], use_cache=False)


def test_the_first_tokens_time_counts_the_prefill(model):
    pf = prefill(model, "Hello there.", use_cache=False)
    pf = type(pf)(**{**pf.__dict__, "ms": 5000.0})  # a prefill that took 5 s
    out = generate(model, pf, max_new_tokens=2)
    assert out.first_token_ms >= 5000.0


def test_long_texts_keep_added_tokens_that_hold_a_space(tmp_path, folder):
    """A long text is encoded in pieces cut at spaces; not where an added token ("red apple") holds one."""
    from tokenizers import AddedToken, Tokenizer

    from qwen35_fast.runtime.tokenizer import load_tokenizer
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_tokens([AddedToken("red apple", special=False, normalized=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = "a" * 4096 + "red apple" + " more words" * 500
    ids = tok.encode(text)
    assert ids == Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tok.token_id("red apple") in ids


def test_fp8_blocks_of_64_are_found_without_weight_block_size(tmp_path):
    from qwen35_fast.runtime.checkpoint import _fp8_block
    assert _fp8_block("w", [256, 256], "w_scale_inv", [4, 4], None, tmp_path / "m.safetensors") == (64, 64)
    assert _fp8_block("w", [256, 256], "w_scale_inv", [2, 2], None, tmp_path / "m.safetensors") == (128, 128)


def test_out_of_memory_while_a_device_is_checked_stays_out_of_memory(model, monkeypatch):
    """An accelerator merely short of memory is not one the model does not run on (the loader's auto would take
    the CPU for it)."""
    import sys

    from qwen35_fast.runtime.devices import DeviceUnsupported, check_device
    gen = sys.modules["qwen35_fast.runtime.generate"]

    def oom(*a, **k):
        raise RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)")
    monkeypatch.setattr(gen, "generate", oom)
    with pytest.raises(RuntimeError, match="out of memory") as e:
        check_device(model)
    assert not isinstance(e.value, DeviceUnsupported)
    monkeypatch.setattr(gen, "generate", lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("aten::x")))
    with pytest.raises(DeviceUnsupported, match="aten::x"):
        check_device(model)


def test_a_follow_up_over_a_long_context_counts_the_context(model):
    """Where the attention runs in PyTorch it gathers every cached position: 20 new tokens after 60,000 cached
    ones need more than a 20-token prompt."""
    from qwen35_fast.runtime.memory import prefill_bytes, reference_attention_bytes
    assert prefill_bytes(model, 20, 60_020) - prefill_bytes(model, 20) \
        == reference_attention_bytes(model, 60_020, 20) - reference_attention_bytes(model, 20, 20) > 0


def test_bf16_works_runs_the_product():
    from qwen35_fast.runtime import devices
    assert devices.bf16_works(torch.device("cpu"))
    assert not devices.bf16_works(torch.device("meta"))  # no values to read back: as a device without bf16


def test_the_content_hash_sees_every_byte():
    """The prefix cache keys images by content_hash: tensors that differ only in their last bytes (an odd
    number of 4-byte values, a 3 x 3 image's last channel) hash apart; a tensor hashed in parts of odd sizes
    hashes as the whole."""
    from qwen35_fast.runtime.fingerprint import StreamedHash, content_hash
    assert content_hash(torch.tensor([1.0, 2.0, 3.0])) != content_hash(torch.tensor([1.0, 2.0, 4.0]))
    a = torch.zeros(1, 3, 3, 3)
    b = a.clone()
    b[0, 2, 2, 2] = 1.0
    assert content_hash(a) != content_hash(b)
    x = torch.arange(37, dtype=torch.uint8)
    h = StreamedHash()
    for lo, hi in ((0, 3), (3, 20), (20, 37)):
        h.add(x[lo:hi])
    assert h.digest(tuple(x.shape), x.dtype) == content_hash(x)


@pytest.mark.parametrize("tie", [False, True])
def test_the_prefill_flop_floor_counts_what_the_prefill_multiplies(tmp_path, tie):
    """Qwen35Model.flops (the first token's floor in bench/vision.py): its projection, MLP and LM-head part is
    the weight matmuls' FLOPs a prefill runs (torch's FLOP counter over a prefill on the PyTorch path, which
    keeps the last position's logits), its attention part the causal pairs of each full-attention layer but
    the last, whose one query (the last token's: its logits are all a prefill reads) sees all T keys."""
    from torch.utils.flop_counter import FlopCounterMode

    from _models import make_hf_model
    make_hf_model(tmp_path, tie=tie)
    m = load_model(tmp_path, dtype="fp32", device="cpu", backend="torch")
    c = m.config
    full = sum(1 for t in c.layer_types if t == "full_attention")
    for T in (1, 16, 200):
        with FlopCounterMode(display=False) as fc:
            prefill_ids(m, list(range(3, 3 + T)))
        mm = fc.get_flop_counts()["Global"][torch.ops.aten.mm]
        assert c.layer_types[-1] == "full_attention"
        attention = 4 * c.num_attention_heads * c.head_dim * ((full - 1) * T * (T + 1) // 2 + T)
        assert m.flops(T) - attention == mm, T
    assert m.flops(16, logits=3) - m.flops(16) == 2 * 2 * c.vocab_size * c.hidden_size


def test_decoding_from_an_empty_cache_equals_the_prefill(model):
    """forward_decode on a new cache (no tokens, no GDN states yet) starts from zero states, as a prefill does."""
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    want = model.forward_prefill(ids, model.new_cache(1, 9))
    cache = model.new_cache(1, 9)
    for t in range(9):
        got = model.forward_decode(ids[0, t:t + 1], cache)
    assert cache.length == 9 and torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_a_prefill_fits_only_the_model_that_made_it(folder, model):
    """A prefill names its model by a serial number, not by id(): CPython hands a freed model's address to the
    next object, so a model loaded after another was freed could take a stale prefill (of the freed model's
    blocks) as its own."""
    pf = prefill(model, "Hello.")
    other = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    assert other.serial != model.serial
    assert pf.model_id == model.serial
    with pytest.raises(Qwen35Error, match="^this prefill was made by another model"):
        generate(other, pf, max_new_tokens=1)
    assert generate(model, pf, max_new_tokens=1).token_ids
