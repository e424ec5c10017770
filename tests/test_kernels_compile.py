"""Every CUDA source under kernels/ compiles with NVRTC for the GPUs we support (no GPU needed).

Uses the same options as the run-time build (kernels/cuda_build.py), so a kernel that compiles
here compiles on a user's machine. Skips only where NVRTC itself is not installed.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from qwen35_fast.kernels import cuda_build
from qwen35_fast.kernels.gdn_prefill import plan as _P
from qwen35_fast.kernels.rms_norm.launch import _tpr
from qwen35_fast.kernels.vision.launch import ROTARY_HG

KERNELS = Path(cuda_build.__file__).resolve().parent
SOURCES = sorted(KERNELS.rglob("*.cu"))
ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]  # sm_90a: what cuda_build picks on H100/H200
ONLY = {"gdn_prefill.cu": ("sm_90a",), "paged_attention_wg.cu": ("sm_90a",), "attention.cu": ("sm_90a",)}  # wgmma kernels


def _nvrtc_missing():
    try:
        cuda_build.nvrtc_version()
    except cuda_build.KernelBuildError as e:
        return str(e)
    return None


needs_nvrtc = pytest.mark.skipif(_nvrtc_missing() is not None,
                                 reason=f"NVRTC is not installed: {_nvrtc_missing()}")

# define sets the launchers use, so that every compiled variant is checked, not just the defaults
VARIANTS = {
    "attention.cu": [{"HEAD_DIM": 72, "HEADS": 16}, {"HEAD_DIM": 64, "HEADS": 16}, {"HEAD_DIM": 64, "HEADS": 12}],
    "conv1d.cu": [{}, {"HAS_BIAS": 1, "HAS_INIT": 1, "VARLEN": 1}, {"TX": 0, "VEC": 4, "W": 3},
                  {"VEC": 4, "UNROLL": 16}, {"TX": 0, "VEC": 2, "UNROLL": 4},
                  {"TX": 1, "VEC": 1, "TW": 0, "TS": 0, "TB": 0, "HAS_BIAS": 1}],
    "gdn_decode.cu": [{}, {"TQ": 0, "TV": 0, "TA": 0, "TP": 0}, {"TQ": 1, "TV": 1, "TA": 1, "TP": 2, "D": 64, "DV": 64},
                      {"VT": 16, "THREADS": 64}, {"VT": 64, "THREADS": 256}, {"VT": 16, "THREADS": 128},
                      {"VT": 16, "THREADS": 32}, {"VT": 16, "THREADS": 32, "D": 64, "DV": 64}],
    # gdn_prefill/plan.py + launch.py: the sizes the plan hands each module (the kernels static_assert them)
    "prep.cu": [{"IN_T": i, "AB_T": a, "PREP_SMEM": _P.prep_smem()} for i in (2, 1) for a in (0, 1, 2)],
    "gdn_prefill.cu": [{"DVS": d, "IN_T": i, "WALK_SMEM": _P.hopper_walk_smem(d), "WALK128_SMEM": _P.hopper_walk_smem(128)}
                       for d in (32, 64, 128) for i in (2, 1)],
    "portable.cu": [{"DVS": d, "IN_T": i, "OUT_IN_WALK": int(f), "STATE_SMEM": _P.portable_state_smem(d, f),
                     "OUT_SMEM": _P.PORTABLE_OUT_SMEM} for d in _P.PORTABLE_SPLITS for i in (2, 1) for f in (True, False)],
    # rms_norm/launch.py: row length (the model's 128, 256, hidden sizes) x x dtype x weight dtype x gated, with
    # its threads per row (_tpr: one row, and a few rows' whole block)
    "rms_norm.cu": [{"DIM": d, "IN_T": i, "W_T": w, "GATED": g, "TPR": _tpr(d)} for d in (64, 128, 256, 2560, 4096)
                    for i in (2, 1) for w in (0, i) for g in (0, 1)]
    # ... and q / k with the rotary after the norm (Qwen3.5: 64 of 256; small test models: 32 of 128)
    + [{"DIM": d, "IN_T": i, "W_T": w, "ROPE": r, "TPR": _tpr(d)} for d, r in ((256, 64), (128, 32), (128, 64), (64, 16))
       for i in (2, 1) for w in (0, i)]
    # ... and the residual add before the norm (the hidden sizes)
    + [{"DIM": d, "IN_T": i, "W_T": w, "RES": 1, "TPR": t} for d in (1024, 2048, 2560, 4096, 5120) for i in (2, 1)
       for w in (0, i) for t in {_tpr(d), _tpr(d, 2)}],
    "silu_mul.cu": [{"IN_T": i} for i in (2, 1)],
    "dequant.cu": [{"OUT_T": i} for i in (2, 1)],
    # sampling/launch.py: one module per vocabulary length (Qwen3.5's, Qwen's older one, the tests' small ones)
    "sample.cu": [{"VOCAB": v} for v in (248320, 151936, 4097, 65)],
    # gemv/launch.py: the plain product (split row groups too), the norm before it at each hidden size, the MLP's gate
    "gemv.cu": [{"IN_T": i, "SPLIT": s} for i in (2, 1) for s in (1, 2, 4)]
    + [{"IN_T": i, "PRO": 1, "DIM": d, "W_T": w, "TPR": _tpr(d)} for d in (1024, 2048, 2560, 4096, 5120)
       for i in (2, 1) for w in (0, i)]
    + [{"IN_T": i, "PRO": 2} for i in (2, 1)]
    # ... and each form with int8 rows and their scales
    + [{"IN_T": i, "SPLIT": s, "Q8": 1} for i in (2, 1) for s in (1, 2, 4)]
    + [{"IN_T": 2, "PRO": 1, "DIM": d, "W_T": 0, "TPR": _tpr(d), "Q8": 1} for d in (1024, 2560, 4096)]
    + [{"IN_T": i, "PRO": 2, "Q8": 1} for i in (2, 1)],
    # paged_attention/launch.py: warps per block x block size x split-K (9B: GROUP 4); tests/test_paged_attention.py
    # compiles the full grid (GQA 6, sm_86 / sm_120 too)
    "paged_attention.cu": [{"WARPS_M": w, "BLOCK_SIZE": b, "SPLIT": s} for w in (1, 4) for b in (16, 64) for s in (0, 1)],
    "paged_attention_wg.cu": [{"BLOCK_SIZE": b, "SPLIT": s} for b in (16, 64) for s in (0, 1)],
    "paged_combine.cu": [{"HEAD_DIM": d, "GATE": g} for d in (128, 256) for g in (0, 1)],
    "paged_decode.cu": [{"BLOCK_SIZE": b, "SPLIT": s, "GATE": g} for b in (16, 64) for s in (0, 1) for g in (0, 1)],
    # vision/launch.py: the released towers' heads (12 x 64, 16 x 64, 16 x 72) and other multiples of 8; row
    # lengths over every threads-per-row choice of layer_norm.cu (1 / 2 / 4 / 8 warps), plain and fused
    # ... positions: the released towers' rows and heads on the 48 x 48 grid, 2 x 2 merge, and odd sizes
    "positions.cu": [{"DIM": d, "HEAD_DIM": hd, "SIDE": s, "MERGE": m, "IN_T": i}
                     for d, hd, s, m in ((768, 64, 48, 2), (1024, 64, 48, 2), (1152, 72, 48, 2), (40, 8, 7, 3),
                                         (8, 4, 1, 1)) for i in (2, 1)],
    "rotary.cu": [{"HEAD_DIM": d, "HEADS": h, "IN_T": i, "HG": ROTARY_HG}
                  for d, h in ((64, 12), (64, 16), (72, 16), (80, 3), (8, 1)) for i in (2, 1)],
    "layer_norm.cu": [{"DIM": d, "IN_T": i, "HAS_Y": y} for d in (768, 1024, 1152, 2056, 5120, 8, 10240)
                      for i in (2, 1) for y in (1, 0)],
}


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert {"conv1d.cu", "gdn_decode.cu", "probe.cu", "rms_norm.cu", "rotary.cu", "positions.cu", "layer_norm.cu", "silu_mul.cu",
            "dequant.cu", "content_hash.cu", "gemv.cu", "sample.cu"} <= names


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_compiles(src, arch):
    if arch not in ONLY.get(src.name, (arch,)):
        pytest.skip(f"{src.name} is built for {ONLY[src.name]} only")
    sets = VARIANTS.get(src.name, [{}])
    # independent NVRTC programs, compiled side by side (the gdn_prefill sets take ~1 s each)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(sets))) as pool:
        cubins = list(pool.map(lambda d: cuda_build.compile_cubin(src, arch, d), sets))
    for defines, cubin in zip(sets, cubins):
        assert cubin[:4] == b"\x7fELF", f"{src.name} {arch} {defines}: not a cubin"


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_100", "sm_120"])  # B200-class and RTX 50-class cards
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_compiles_newer_archs(src, arch):
    """The first and the last define set of each source for the newer targets (the full sets run above)."""
    if int(arch[3:]) not in cuda_build.supported_archs():
        pytest.skip(f"NVRTC {cuda_build.nvrtc_version()} does not target {arch}")
    if src.name in ONLY:
        pytest.skip(f"{src.name} is built for {ONLY[src.name]} only")
    sets = VARIANTS.get(src.name, [{}])
    for defines in dict.fromkeys(map(lambda d: tuple(sorted(d.items())), (sets[0], sets[-1]))):
        cubin = cuda_build.compile_cubin(src, arch, dict(defines))
        assert cubin[:4] == b"\x7fELF", f"{src.name} {arch} {defines}: not a cubin"


@needs_nvrtc
def test_compile_error_names_log_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void f() { not_declared = 1; }\n')
    with pytest.raises(cuda_build.KernelBuildError) as e:
        cuda_build.compile_cubin(bad, "sm_90")
    log = next((tmp_path / "qwen35_fast" / "nvrtc-logs").glob("broken-sm_90-*.log"))
    assert str(log) in str(e.value)
    assert "not_declared" in log.read_text()


@needs_nvrtc
def test_targets():
    assert cuda_build.arch_for_capability(9, 0) == "sm_90a"
    assert cuda_build.arch_for_capability(8, 9) == "sm_89"
    assert cuda_build.arch_for_capability(99, 0).startswith("compute_")  # newer than NVRTC: PTX
    with pytest.raises(cuda_build.KernelBuildError):
        cuda_build.arch_for_capability(7, 5)


@pytest.mark.parametrize("major, fix", [
    (13, r"Fix: pip install 'nvidia-cuda-runtime==13\.\*', or set CUDA_HOME"),
    (14, r"Fix: pip install 'nvidia-cuda-runtime==14\.\*', or set CUDA_HOME"),
    (12, r"Fix: pip install 'nvidia-cuda-runtime-cu12==12\.\*', or set CUDA_HOME"),
    (11, r"Fix: the kernels need a PyTorch built for CUDA 12 or 13 \(this one is built for CUDA 11\)")])
def test_missing_headers_error(monkeypatch, tmp_path, major, fix):
    monkeypatch.setattr(cuda_build, "_include_dir", None)
    monkeypatch.setattr(cuda_build, "_include_candidates", lambda: [tmp_path])
    monkeypatch.setattr(cuda_build, "_torch_cuda_major", lambda: major)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)  # no minor version to hold to
    with pytest.raises(cuda_build.KernelBuildError, match="cuda_bf16.h.*" + fix):
        cuda_build.cuda_include_dir()


@pytest.mark.parametrize("major, fix", [
    (13, r"install 'cupy-cuda13x' and 'nvidia-cuda-nvrtc==13\.\*'"),
    (14, r"install 'cupy-cuda14x' and 'nvidia-cuda-nvrtc==14\.\*'"),
    (12, r"install 'cupy-cuda12x' and 'nvidia-cuda-nvrtc-cu12==12\.\*'"),
    (11, r"the kernels need a PyTorch built for CUDA 12 or 13 \(this one is built for CUDA 11\); install such a "
         r"PyTorch, then run the pack's install.py")])
def test_missing_nvrtc_error_names_the_packages_of_torchs_cuda(monkeypatch, major, fix):
    """A CUDA 11 PyTorch is not told to install cupy-cuda11x, which install.py does not take (the kernels are built
    for CUDA 12 and 13 only); a PyTorch of a newer CUDA than the kernels were tested with is told its own packages,
    not that it is too old."""
    import builtins
    real = builtins.__import__

    def no_cupy(name, *args, **kw):
        if name.startswith("cupy"):
            raise ImportError("No module named 'cupy_backends'")
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.setattr(cuda_build, "_torch_cuda_major", lambda: major)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)  # no minor version to hold to
    with pytest.raises(cuda_build.KernelBuildError, match="NVRTC is not available .*" + fix):
        cuda_build.nvrtc_version()


@pytest.mark.parametrize("cuda, nvrtc", [("12.4", "'nvidia-cuda-nvrtc-cu12==12.4.*'"),
                                         ("13.0", "'nvidia-cuda-nvrtc==13.0.*'")])
def test_the_nvrtc_named_is_held_to_torchs_cuda_version(monkeypatch, cuda, nvrtc):
    """As install.py installs it: the newest NVRTC of the major may make PTX that a driver of torch's CUDA refuses."""
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    assert cuda_build._pip_hint("nvrtc") == nvrtc


@needs_nvrtc
@pytest.mark.parametrize("src,defines", [
    ("prep.cu", {"PREP_SMEM": _P.prep_smem() + 16}),
    ("portable.cu", {"DVS": 32, "OUT_IN_WALK": 1, "STATE_SMEM": _P.portable_state_smem(32, True) + 16,
                     "OUT_SMEM": _P.PORTABLE_OUT_SMEM}),
    ("portable.cu", {"DVS": 64, "OUT_IN_WALK": 1, "STATE_SMEM": _P.portable_state_smem(64, False),
                     "OUT_SMEM": _P.PORTABLE_OUT_SMEM}),
    ("portable.cu", {"DVS": 64, "STATE_SMEM": _P.portable_state_smem(64, False), "OUT_SMEM": _P.PORTABLE_OUT_SMEM - 16}),
    ("gdn_prefill.cu", {"DVS": 64, "WALK_SMEM": _P.hopper_walk_smem(64) + 16, "WALK128_SMEM": _P.hopper_walk_smem(128)}),
])
def test_prefill_kernels_refuse_sizes_that_disagree_with_the_plan(src, defines):
    """The plan's shared-memory formulas and the kernels' layouts are one source of truth: a size that is off
    by 16 bytes does not compile."""
    with pytest.raises(cuda_build.KernelBuildError, match="disagrees"):
        cuda_build.compile_cubin(KERNELS / "gdn_prefill" / src, "sm_90a", defines)
