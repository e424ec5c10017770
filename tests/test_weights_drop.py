"""A model's weights let go (drop_weights: an unload where RAM is short) and read again from its checkpoint
(reload_weights): the same model after, and the prefills made before still good; a changed file is refused."""
import os

import pytest
import torch

from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.generate import generate, prefill
from qwen35_fast.runtime.loader import load_model
from qwen35_fast.runtime.multimodal import prefill_multimodal
from qwen35_fast.runtime.sampling import SamplingParams

IMAGE = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(1))
GREEDY = SamplingParams(do_sample=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf"), seed=5)


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_weights_let_go_and_read_again_give_the_same_model(folder):
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    assert model.vision is not None and not model.weights_dropped
    before = _weights(model)
    pf = prefill_multimodal(model, "What is in <image>?", images=IMAGE)
    first = generate(model, pf, max_new_tokens=6, sampling=GREEDY)
    cold = prefill_multimodal(model, "What is in <image>?", images=IMAGE, use_cache=False).logits
    size = model.weight_bytes()

    model.drop_weights("cpu")
    assert model.weights_dropped and model.weight_bytes() == size  # what they take once back
    assert all(p.is_meta for p in model.parameters())  # text and tower: no memory anywhere
    assert model.kv.device.type == "cpu" and model.inv_freq.device.type == "cpu"
    assert model.graphs == {}

    model.reload_weights("cpu")
    assert not model.weights_dropped
    after = _weights(model)
    assert after.keys() == before.keys()
    for name, p in after.items():
        assert p.device.type == "cpu" and torch.equal(p, before[name]), name
    # the prefill made before the weights left continues as it did
    again = generate(model, pf, max_new_tokens=6, sampling=GREEDY)
    assert again.token_ids == first.token_ids
    # and the same prompt read again from the start gives the same logits
    pf2 = prefill_multimodal(model, "What is in <image>?", images=IMAGE, use_cache=False)
    assert pf2.cached_tokens == 0 and torch.equal(pf2.logits, cold)


def test_a_changed_checkpoint_file_is_not_read_in_their_place(folder, tmp_path):
    import shutil
    copy = tmp_path / "ck"
    shutil.copytree(folder, copy)
    model = load_model(copy, dtype="fp32", device="cpu", backend="torch")
    pf = prefill(model, "Hello there")

    def held():  # the prefill's GDN states and its K/V in the store
        return [t for t in pf.cache.conv + pf.cache.ssm if t is not None] + [t for kv in pf.cache.gather_kv() for t in kv]
    before = [t.clone() for t in held()]
    model.drop_weights("cpu")
    weights = sorted(copy.glob("*.safetensors"))[0]
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another file under the same name
    with pytest.raises(Qwen35Error, match=f"{weights.name} changed on disk.*load the model anew"):
        model.reload_weights("cpu")
    assert model.weights_dropped and all(p.is_meta for p in model.parameters())  # nothing half-read stays
    weights.unlink()
    with pytest.raises(Qwen35Error, match=f"{weights.name} is gone"):
        model.reload_weights("cpu")
    after = held()  # the prefill is untouched either way
    assert len(after) == len(before) > 0 and all(torch.equal(x, y) for x, y in zip(after, before))


def test_a_changed_config_is_not_read_in_its_place(folder, tmp_path):
    """config.json is read again with the vision tower's weights: a config changed since the load is refused by
    name like a changed weight file (it was read raw: a JSON error, or another tower's settings)."""
    import shutil
    copy = tmp_path / "ck"
    shutil.copytree(folder, copy)
    model = load_model(copy, dtype="fp32", device="cpu", backend="torch")
    model.drop_weights("cpu")
    cfg = copy / "config.json"
    cfg.write_text(cfg.read_text()[:-5])
    with pytest.raises(Qwen35Error, match="config.json changed on disk"):
        model.reload_weights("cpu")


def test_a_failed_read_leaves_the_weights_let_go(folder, monkeypatch):
    from qwen35_fast.runtime import loader
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    model.drop_weights("cpu")

    def fail(m):
        raise RuntimeError("CUDA out of memory (simulated)")
    monkeypatch.setattr(loader, "refill", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        model.reload_weights("cpu")
    assert model.weights_dropped and all(p.is_meta for p in model.parameters())
    monkeypatch.undo()
    model.reload_weights("cpu")
    assert not model.weights_dropped and prefill(model, "Hello").logits.isfinite().all()


def test_a_model_not_read_from_a_checkpoint_cannot_let_them_go(folder):
    model = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    model.checkpoint = None
    with pytest.raises(Qwen35Error, match="not loaded from a checkpoint"):
        model.drop_weights("cpu")
    assert not model.weights_dropped
