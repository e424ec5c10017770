"""One small case per CUDA kernel, for compute-sanitizer (memcheck, racecheck) in bench/run_gpu.sh.

    compute-sanitizer --tool memcheck python bench/sanitize_cases.py

The prefill on both paths of kernels/gdn_prefill/plan.py: the Hopper path (where the GPU is sm_90: column
split, sequence split, whole heads) and the portable path built for compute_80 (column slices, segments).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _import  # noqa: E402,F401

from qwen35_fast.kernels.conv1d.launch import (  # noqa: E402
    causal_conv1d_prefill_cuda,
    causal_conv1d_states_cuda,
    causal_conv1d_update_cuda,
)
from qwen35_fast.kernels.gdn_decode.launch import gdn_decode_step_cuda  # noqa: E402

dev = "cuda"
torch.manual_seed(0)
N, Hk, Hv, D, C, W = 3, 2, 4, 128, 1000, 4

q, k = torch.randn(N, Hk, D, device=dev, dtype=torch.bfloat16), torch.randn(N, Hk, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(N, Hv, D, device=dev, dtype=torch.bfloat16)
a, b = torch.randn(N, Hv, device=dev), torch.randn(N, Hv, device=dev)
state = torch.randn(N, Hv, D, D, device=dev)
gdn_decode_step_cuda(q, k, v, a, b, torch.rand(Hv, device=dev), torch.randn(Hv, device=dev), state)

cu = torch.tensor([0, 5, 5, 70, 71, 200], dtype=torch.int32, device=dev)
x = torch.randn(1, 200, C, device=dev, dtype=torch.bfloat16)
weight, bias = torch.randn(C, W, device=dev, dtype=torch.bfloat16), torch.randn(C, device=dev, dtype=torch.bfloat16)
init = torch.randn(5, C, W - 1, device=dev, dtype=torch.bfloat16)
causal_conv1d_prefill_cuda(x, weight, bias, init, cu)
causal_conv1d_prefill_cuda(x[:, :, :999], weight[:999], None, None, None)  # unaligned channels: VEC = 1
causal_conv1d_states_cuda(x[:, :, :999], init[:1, :999], torch.tensor([0, 2, 199, 200, 500], device=dev), W)
causal_conv1d_update_cuda(torch.randn(N, C, device=dev, dtype=torch.bfloat16),
                          torch.randn(N, C, W - 1, device=dev, dtype=torch.bfloat16), weight, bias)

try:
    from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda
except ImportError as e:
    print(f"prefill kernel not checked: {e}")
else:
    T = 700  # sequences of 77 and 623 tokens: the second one takes the sequence split (10 chunks)
    qp = torch.randn(1, T, Hk, D, device=dev, dtype=torch.bfloat16)
    kp = torch.randn(1, T, Hk, D, device=dev, dtype=torch.bfloat16)
    vp = torch.randn(1, T, Hv, D, device=dev, dtype=torch.bfloat16)
    ap, bp = torch.randn(1, T, Hv, device=dev), torch.randn(1, T, Hv, device=dev)
    import qwen35_fast.kernels.gdn_prefill.plan as plan_mod
    hopper = torch.cuda.get_device_capability() == (9, 0)
    runs = [{"path": "hopper", "dv_split": 32}, {"path": "hopper", "dv_split": 128}] if hopper else []
    runs += [{"path": "portable", "arch": "compute_80", "dv_split": 16, "segments": 1},
             {"path": "portable", "arch": "compute_80", "dv_split": 64, "segments": 4},
             {"path": "portable", "arch": "compute_80", "dv_split": 32, "segments": 3},
             {"path": "portable", "arch": "compute_80", "dv_split": 64, "segments": 2, "fused_out": False}]
    for i, kw in enumerate(runs):
        if i == 0:  # the prep kernel with both value heads of a q/k head in one block
            plan_mod.prep_heads, keep = (lambda *a: Hv // Hk), plan_mod.prep_heads
        gdn_chunk_prefill_cuda(qp, kp, vp, ap, bp, torch.rand(Hv, device=dev), torch.randn(Hv, device=dev),
                               torch.randn(2, Hv, D, D, device=dev),
                               torch.tensor([0, 77, T], dtype=torch.int32, device=dev), **kw)
        if i == 0:
            plan_mod.prep_heads = keep
        # one sequence keeping states on the way (chunk 0, inside a segment, at a boundary, the last chunk)
        gdn_chunk_prefill_cuda(qp, kp, vp, ap, bp, torch.rand(Hv, device=dev), torch.randn(Hv, device=dev),
                               torch.randn(1, Hv, D, D, device=dev), keep=[0, 320, 384, 640], **kw)
from qwen35_fast.kernels.rms_norm.launch import (  # noqa: E402
    add_rms_norm_cuda,
    gated_rms_norm_cuda,
    rms_norm_cuda,
    rms_norm_rope_cuda,
)
from qwen35_fast.kernels.silu_mul.launch import silu_mul_cuda  # noqa: E402

xs = torch.randn(2, 37, 3, 256, device=dev, dtype=torch.bfloat16)
rms_norm_cuda(xs, torch.randn(256, device=dev), 1e-6)
rms_norm_cuda(torch.randn(37, 4096, device=dev, dtype=torch.bfloat16), torch.randn(4096, device=dev), 1e-6)
rms_norm_cuda(torch.randn(37, 2560, device=dev, dtype=torch.bfloat16), torch.randn(2560, device=dev), 1e-6)
rms_norm_cuda(torch.randn(37, 4096, device=dev, dtype=torch.bfloat16), torch.randn(4097, device=dev)[1:], 1e-6)  # unaligned
gated_rms_norm_cuda(xs[..., :128], xs[..., 128:], torch.rand(128, device=dev, dtype=torch.bfloat16), 1e-6)
# q / k with the rotary (strided q, 37 tokens: a partly filled last block), the residual add + norm, silu * mul
cs = torch.rand(37, 64, device=dev, dtype=torch.bfloat16)
rms_norm_rope_cuda(torch.randn(1, 37, 3, 512, device=dev, dtype=torch.bfloat16)[..., :256], torch.randn(256, device=dev),
                   1e-6, cs, cs.flip(0))
h37 = torch.randn(1, 37, 4096, device=dev, dtype=torch.bfloat16)
add_rms_norm_cuda(h37, torch.randn_like(h37), torch.randn(4096, device=dev), 1e-6)
silu_mul_cuda(torch.randn(1, 37, 2 * 12288, device=dev, dtype=torch.bfloat16))

from qwen35_fast.kernels.paged_attention.launch import card_of, paged_attention_cuda  # noqa: E402

# paged attention: 3 sequences (cached, new) = (40, 9), (0, 70), (500, 1) in shuffled 16-token blocks, GQA 4;
# the whole kernel (two warp counts) and the split + combine path; on sm_90a the warpgroup kernel too (two
# warpgroups for the 280 rows of 70 tokens, one for the 36 rows of the first sequence alone)
Hq, Hkv_, Dh, bs = 8, 2, 256, 16
lens, nqs = [40, 0, 500], [9, 70, 1]
need = [-(-(L + n) // bs) for L, n in zip(lens, nqs)]
perm = torch.randperm(sum(need) + 2, device=dev).to(torch.int32)
table = torch.zeros(3, max(need), dtype=torch.int32, device=dev)
for i, (off, k) in enumerate(zip([0, need[0], need[0] + need[1]], need)):
    table[i, :k] = perm[off:off + k]
pool_k = torch.randn(sum(need) + 2, bs, Hkv_, Dh, device=dev, dtype=torch.bfloat16)
pool_v = torch.randn_like(pool_k)
Tn = sum(nqs)
qg = torch.randn(Tn, Hq, 2 * Dh, device=dev, dtype=torch.bfloat16)
kn, vn = (torch.randn(Tn, Hkv_, Dh, device=dev, dtype=torch.bfloat16) for _ in range(2))
cl = torch.tensor(lens, dtype=torch.int32, device=dev)
cuq = torch.tensor([0, 9, 79, 80], dtype=torch.int32, device=dev)
for sp in (1, 3):
    for kern in ("mma", "dec", "wg") if card_of(dev).wgmma else ("mma", "dec"):
        paged_attention_cuda(qg[..., :Dh], kn, vn, pool_k, pool_v, table, cl, cuq, qg[..., Dh:], 70, splits=sp,
                             kernel=kern)
    if card_of(dev).wgmma:
        paged_attention_cuda(qg[:9, :, :Dh], kn[:9], vn[:9], pool_k, pool_v, table[:1], cl[:1], cuq[:2],
                             qg[:9, :, Dh:], 9, splits=sp, kernel="wg")
paged_attention_cuda(qg[79:, :, :Dh], kn[79:], vn[79:], pool_k, pool_v, table[2:], cl[2:],
                     torch.tensor([0, 1], dtype=torch.int32, device=dev), None, 1)  # the decode kernel, no gate
from qwen35_fast.kernels.vision import launch as vision_launch  # noqa: E402
from qwen35_fast.kernels.vision.launch import (  # noqa: E402
    add_layer_norm_cuda,
    layer_norm_cuda,
    vision_positions_cuda,
    vision_rotary_cuda,
)

# the vision tower's kernels: positions for images of two sizes and a 3-frame video, rows of 1,152 (144 vectors
# over 128 threads); rotary with head dim 72 (half not a multiple of 8) and a token count off the block;
# LayerNorm rows over one warp (1,152: some lanes' last slot empty) and over 4 warps (5,120), fused and plain
vision_positions_cuda(torch.randn(96 + 16 + 36, 1152, device=dev, dtype=torch.bfloat16),
                      torch.randn(48 * 48, 1152, device=dev, dtype=torch.bfloat16),
                      torch.tensor([[1, 8, 12, 0], [1, 4, 4, 96], [3, 2, 6, 112]], dtype=torch.int32, device=dev),
                      [1, 8, 12, 1, 4, 4, 3, 2, 6], torch.rand(18, device=dev), 2)
qkv = torch.randn(37, 3, 5, 72, device=dev, dtype=torch.bfloat16)
vision_rotary_cuda(qkv, torch.randn(37, 72, device=dev), torch.randn(37, 72, device=dev))
for D in (1152, 5120):
    xv, yv = (torch.randn(37, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    wv, bv = torch.randn(D, device=dev, dtype=torch.bfloat16), torch.randn(D, device=dev, dtype=torch.bfloat16)
    add_layer_norm_cuda(xv, yv, wv, bv, 1e-6)
    layer_norm_cuda(xv, wv, bv, 1e-6)
# the vision attention (sm_90a): segments shorter than a row block, one across two, a partial key tile; v strided;
# in one wave (a block a CTA) and on four CTAs (two whole rounds, then runs of tiles: blocks split between CTAs)
if card_of(dev).wgmma:
    for hd, ctas in ((72, None), (64, None), (72, 4)):
        qkv_a = torch.randn(461, 3, 3, hd, device=dev, dtype=torch.bfloat16)
        vision_launch.vision_attention_cuda(qkv_a[:, 0].contiguous(), qkv_a[:, 1].contiguous(), qkv_a[:, 2],
                                            torch.tensor([0, 5, 205, 461], dtype=torch.int32, device=dev), 256,
                                            ctas=ctas)
# the content hash: more words than threads of its grid, a count off the block
from qwen35_fast.kernels.content_hash.launch import hash_words_cuda  # noqa: E402

hash_words_cuda(torch.randint(0, 1 << 40, (300_001,), dtype=torch.int64, device=dev), (1, 2))
# the sampled token: the full vocabulary (every block selecting), a vocabulary whose last blocks hold fewer
# logits than k or none, ties everywhere
from qwen35_fast.kernels.sampling.launch import sample_cuda  # noqa: E402

sample_cuda(torch.randn(248320, device=dev), 20, 0.7, 0.0, 0.8, 0.4)
sample_cuda(torch.randn(3000, device=dev).bfloat16().float(), 64, 1.0, 0.05, 0.9, 0.9)
sample_cuda(torch.zeros(65, device=dev), 64, 1.0, 0.0, 1.0, 0.5)
sample_cuda(torch.randn(248320, device=dev), 20, 0.7, 0.0, 0.8, 0.4,
            ((torch.rand(248320, device=dev) < 0.3).to(torch.uint8), 1.1, 1.5))  # with the penalties' marks
# the decode projections: an odd row count (the last warp's second row past N), K not a multiple of the
# lanes' 128-piece stride, x staged in shared memory
from qwen35_fast.kernels.gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda, gemv_silu_mul_cuda  # noqa: E402

for n, k in ((4097, 4096), (3, 72), (37, 17408)):
    gemv_cuda(torch.randn(1, k, device=dev, dtype=torch.bfloat16), torch.randn(n, k, device=dev, dtype=torch.bfloat16))
# with the residual add and norm formed as x is staged (four warps a row at 4,096, two at 2,560; without x),
# and with the MLP's gate
for k, with_x in ((4096, True), (2560, True), (4096, False)):
    r16 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    gemv_add_rms_norm_cuda(r16, torch.randn_like(r16) if with_x else None, torch.randn(k, device=dev), 1e-6,
                           torch.randn(301, k, device=dev, dtype=torch.bfloat16), fuse=True)
gemv_silu_mul_cuda(torch.randn(1, 2 * 12288, device=dev, dtype=torch.bfloat16),
                   torch.randn(257, 12288, device=dev, dtype=torch.bfloat16))
# int8 rows with a scale a row (Q8): each split of the row groups forced, K of one 16-byte piece, and fused


def int8_rows(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8),
            torch.rand(n, device=dev, dtype=torch.bfloat16) / 127)


for (n, k), sp in (((4097, 4096), 1), ((4097, 4096), 2), ((4097, 4096), 4), ((3, 16), 1), ((37, 17408), 2)):
    q8, s8 = int8_rows(n, k)
    gemv_cuda(torch.randn(1, k, device=dev, dtype=torch.bfloat16), q8, split=sp, scale=s8)
q8, s8 = int8_rows(301, 4096)
r16 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
gemv_add_rms_norm_cuda(r16, torch.randn_like(r16), torch.randn(4096, device=dev), 1e-6, q8, fuse=True, scale=s8)
q8, s8 = int8_rows(257, 12288)
gemv_silu_mul_cuda(torch.randn(1, 2 * 12288, device=dev, dtype=torch.bfloat16), q8, fuse=True, scale=s8)
# int8 rows times their scales (a prompt's matmul with int8 weights): a row count that is no multiple of the block's
# 256 pieces, and a slice of rows past the first
from qwen35_fast.kernels.dequant.launch import dequant_rows_cuda  # noqa: E402

q8, s8 = int8_rows(301, 2560)  # 160 pieces a row: the last block's threads past the end
dequant_rows_cuda(q8, s8)
dequant_rows_cuda(q8[7:200], s8[7:200])
torch.cuda.synchronize()
print("sanitize cases ran")
