"""runtime/host.upload: host values onto the device. On CUDA the copy must be staged before
the call returns (the prompt path drops or reuses its host lists at once) and must not wait for queued work,
whatever its size."""
import pytest
import torch

from qwen35_fast.runtime.host import upload


def test_upload_keeps_values_and_dtype():
    assert torch.equal(upload([3, 1, 2], torch.int32), torch.tensor([3, 1, 2], dtype=torch.int32))
    t = upload(torch.arange(5), torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [0, 1, 2, 3, 4]
    x = torch.ones(2)
    assert upload(x, device=torch.device("cpu")) is x  # nothing to copy


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
        config = None

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
    from qwen35_fast.runtime import Qwen35Error
    for other in ("models/LLM/Qwen3.5-9B", None, torch.device("cpu")):  # anything but a model: load one
        with pytest.raises(Qwen35Error, match=r"step needs the model that load_model returns, got a \w+"):
            step(other, 2)
