"""runtime/host.upload: host values onto the device. On CUDA the copy must be staged before the call
returns (the prompt path drops or reuses its host lists at once) and must not wait for queued work."""
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
def test_upload_is_staged_and_queued_behind_busy_work():
    src = torch.arange(1 << 14)  # 128 KB of pageable memory: the size of a prompt's positions or plan
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued GPU work in front of the copy
    got = upload(src, device="cuda")
    src.fill_(-1)  # the host copy changes before the device copy has run
    assert not torch.cuda.current_stream().query()  # the upload did not wait for the queued work
    assert torch.equal(got.cpu(), torch.arange(1 << 14))
