"""runtime/host.upload and upload_arrays: host values onto the device. On CUDA the copy must be staged before
the call returns (the prompt path drops or reuses its host lists at once) and must not wait for queued work,
whatever its size."""
import numpy as np
import pytest
import torch

from qwen35_fast.runtime.host import upload, upload_arrays


def test_upload_keeps_values_and_dtype():
    assert torch.equal(upload([3, 1, 2], torch.int32), torch.tensor([3, 1, 2], dtype=torch.int32))
    t = upload(torch.arange(5), torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [0, 1, 2, 3, 4]
    x = torch.ones(2)
    assert upload(x, device=torch.device("cpu")) is x  # nothing to copy


def _arrays(seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(-9, 9, (37, 4)), rng.random((5, 3), dtype=np.float32), np.arange(7, dtype=np.int32),
            np.zeros(0, np.int64), rng.random(3), np.arange(1, dtype=np.int32), rng.integers(0, 5, 11)]


def test_upload_arrays_keeps_each_arrays_values_dtype_and_shape():
    arrays = _arrays(0)
    got = upload_arrays(arrays, "cpu")
    for a, t in zip(arrays, got):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert torch.equal(t, torch.from_numpy(a))
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # one buffer


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1 << 14, 1 << 17, 1 << 20], ids=["128KB", "1MB", "8MB"])
def test_upload_is_staged_and_queued_behind_busy_work(n):
    src = torch.arange(n)  # pageable memory: a prompt's positions, a plan, a video's plan
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued GPU work in front of the copy
    got = upload(src, device="cuda")
    src.fill_(-1)  # the host copy changes before the device copy has run
    assert not torch.cuda.current_stream().query()  # the upload did not wait for the queued work
    assert torch.equal(got.cpu(), torch.arange(n))


@pytest.mark.gpu
def test_upload_arrays_is_one_copy_queued_behind_busy_work():
    arrays = _arrays(1) + [np.arange(1 << 20)]  # 8 MB among them
    want = [torch.from_numpy(a.copy()) for a in arrays]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    got = upload_arrays(arrays, "cuda")
    for a in arrays:
        a[...] = 0  # the host arrays change before the copy has run
    assert not torch.cuda.current_stream().query()
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1
    for w, t in zip(want, got):
        assert t.is_cuda and t.dtype == w.dtype and torch.equal(t.cpu(), w)


def test_the_runtime_runs_on_the_models_gpu_when_another_is_current(monkeypatch):
    """on_model_device: a model on cuda:1 while cuda:0 is current runs inside torch.cuda.device(cuda:1) (our
    launches take the current device's stream); on the current device, or off CUDA, nothing is changed."""
    import contextlib

    import torch

    from qwen35_fast.runtime.host import on_model_device
    entered = []

    @contextlib.contextmanager
    def fake_device(dev):
        entered.append(torch.device(dev))
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", fake_device)

    class Model:
        def __init__(self, device):
            self.device = torch.device(device)

    @on_model_device
    def step(model, x, y=1):
        return x + y

    assert step(Model("cuda:1"), 2, y=3) == 5 and entered == [torch.device("cuda:1")]
    assert step(model=Model("cuda:1"), x=1) == 2 and len(entered) == 2
    entered.pop()
    assert step(Model("cuda:0"), 2) == 3 and step(Model("cpu"), 2) == 3 and len(entered) == 1
    assert step.__name__ == "step"
