"""Small launches of the GDN prefill kernel for compute-sanitizer (memcheck / racecheck)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda  # noqa: E402

import conftest  # noqa: E402,F401

torch.manual_seed(0)
dev = "cuda"
for split, variant in ((32, None), (128, None), (16, "split_o"), (32, "split_o")):
    q, k = torch.randn(2, 1, 130, 1, 128, device=dev).bfloat16()
    v = torch.randn(1, 130, 2, 128, device=dev).bfloat16()
    a, b = torch.randn(2, 1, 130, 2, device=dev)
    h0 = torch.randn(3, 2, 128, 128, device=dev)
    cu = torch.tensor([0, 1, 66, 130], dtype=torch.int32, device=dev)
    o, ht = gdn_chunk_prefill_cuda(q, k, v, a, b, torch.zeros(2, device=dev), torch.ones(2, device=dev), h0, cu,
                                   dv_split=split, variant=variant)
    torch.cuda.synchronize()
    print(split, variant or "default", "finite", bool(torch.isfinite(o).all() and torch.isfinite(ht).all()))
