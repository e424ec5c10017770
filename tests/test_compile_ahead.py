"""Compiling ahead (cuda_build.compile_ahead): get_function lists the modules it loads per target beside the
cubins; compile_ahead compiles the listed ones whose cubin is missing on worker threads, and the caller's
get_function waits for that worker instead of compiling again. CPU tests with NVRTC faked; one GPU test end to
end."""
import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from qwen35_fast.kernels import cuda_build as cb

from _models import rel

NORM = cb.KERNELS_DIR / "rms_norm" / "rms_norm.cu"
ROOT = Path(__file__).resolve().parents[1]
CONV = cb.KERNELS_DIR / "conv1d" / "conv1d.cu"
ELF = b"\x7fELF"  # how a cubin starts


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """An empty cache folder, this process's notes and compile_ahead's targets cleared, and NVRTC faked: each
    compile takes 50 ms and is recorded with the thread that ran it; a source named in `fail` fails."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cb, "_noted", set())
    monkeypatch.setattr(cb, "_ahead", set())
    monkeypatch.setattr(cb, "_building", {})
    monkeypatch.setattr(cb, "_told", [])
    monkeypatch.setattr(cb, "_private", [])
    monkeypatch.setattr(cb, "cuda_include_dir", lambda: tmp_path)
    monkeypatch.setattr(cb, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(cb, "_nvrtc", lambda: None)
    state = {"compiled": [], "fail": set()}

    def compile_(source, src_path, arch, opts):
        time.sleep(0.05)
        state["compiled"].append((src_path.name, tuple(o for o in opts if o.startswith("-D")),
                                  threading.current_thread().name))
        if src_path.name in state["fail"]:
            raise cb.KernelBuildError(f"NVRTC failed to compile {src_path.name}")
        return ELF + b" cubin of " + " ".join(opts).encode()
    monkeypatch.setattr(cb, "_compile", compile_)
    return state


def _path(src, arch, defines):
    return cb._cubin_path(src.read_text(), src, arch, cb._options(src, arch, defines))


def test_loaded_modules_are_listed_per_target_once_a_day(fake, monkeypatch):
    cb._note_wanted(NORM, "sm_90a", {"DIM": 4096, "IN_T": 2})
    cb._note_wanted(NORM, "sm_90a", {"IN_T": 2, "DIM": 4096})  # the same module: noted once
    cb._note_wanted(CONV, "sm_90a", {})
    cb._note_wanted(CONV, "sm_86", {"TX": 0})
    cb._note_wanted(cb.KERNELS_DIR.parent / "bench" / "experiments" / "x.cu", "sm_90a", {})  # not the pack's
    assert cb._read_wanted("sm_90a") == [
        {"source": "rms_norm/rms_norm.cu", "defines": {"DIM": 4096, "IN_T": 2}, "day": int(time.time() // 86400)},
        {"source": "conv1d/conv1d.cu", "defines": {}, "day": int(time.time() // 86400)}]
    assert [e["defines"] for e in cb._read_wanted("sm_86")] == [{"TX": 0}]
    # a later process, days later: the module used again is marked today, one unused for AHEAD_DAYS leaves
    today = int(time.time() // 86400)
    monkeypatch.setattr(cb, "_noted", set())
    monkeypatch.setattr(cb.time, "time", lambda: (today + cb.AHEAD_DAYS + 1) * 86400.0)
    cb._note_wanted(CONV, "sm_90a", {})
    later = today + cb.AHEAD_DAYS + 1
    assert cb._read_wanted("sm_90a") == [{"source": "conv1d/conv1d.cu", "defines": {}, "day": later}]
    cb._wanted_path("sm_80").write_text("{not json")  # a damaged list is an empty one, and is written anew
    assert cb._read_wanted("sm_80") == []
    cb._note_wanted(CONV, "sm_80", {})
    assert len(cb._read_wanted("sm_80")) == 1


def test_listed_modules_compile_on_workers_and_the_caller_waits_for_them(fake):
    mods = [(NORM, {"DIM": d, "IN_T": 2}) for d in (128, 256, 4096)] + [(CONV, {"TX": 0})]
    for src, d in mods:
        cb._note_wanted(src, "sm_90a", d)
    cb._wanted_path("sm_90a").write_text(cb._wanted_path("sm_90a").read_text()[:-1]
                                         + ', {"source": "gone/gone.cu", "defines": {}, "day": 1}]')  # no such file
    cb._write_atomic(_path(NORM, "sm_90a", mods[0][1]), ELF + b"cached")  # on disk already: not compiled again
    assert cb.compile_ahead("sm_90a", workers=3) == 3
    assert cb.compile_ahead("sm_90a") == 0  # once per target and process
    src, d = mods[3]
    got = cb._load_or_compile(src.read_text(), src, "sm_90a", d)  # waits for its worker
    assert got.read_bytes().startswith(ELF + b" cubin of ")
    for f in list(cb._building.values()):
        f.result()
    assert len(fake["compiled"]) == 3 and all(t.startswith("qwen35-nvrtc") for *_, t in fake["compiled"])
    for src, d in mods[1:3]:  # compiled by the workers: loading them compiles nothing more
        assert cb._load_or_compile(src.read_text(), src, "sm_90a", d).is_file()
    assert len(fake["compiled"]) == 3 and cb._load_or_compile(NORM.read_text(), NORM, "sm_90a", mods[0][1]).read_bytes() == ELF + b"cached"


def test_a_module_that_failed_ahead_leaves_the_list_and_raises_for_its_caller(fake):
    """A listed module that no longer compiles (defines an older version took) is dropped from the list, the
    others stay; a caller that does ask for it compiles it again and gets the error."""
    cb._note_wanted(CONV, "sm_90a", {"TX": 0})
    cb._note_wanted(NORM, "sm_90a", {"DIM": 128})
    fake["fail"].add("conv1d.cu")
    assert cb.compile_ahead("sm_90a", workers=1) == 2
    for f in list(cb._building.values()):
        f.exception()
    assert [e["source"] for e in cb._read_wanted("sm_90a")] == ["rms_norm/rms_norm.cu"]
    fake["compiled"].clear()
    with pytest.raises(cb.KernelBuildError, match="conv1d.cu"):
        cb._load_or_compile(CONV.read_text(), CONV, "sm_90a", {"TX": 0})
    assert [(n, t) for n, _, t in fake["compiled"]] == [("conv1d.cu", threading.current_thread().name)]
    assert list(cb._building) == [_path(NORM, "sm_90a", {"DIM": 128})]  # compiled, not yet asked for


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_listed_module_is_compiled_ahead_and_runs(monkeypatch, tmp_path):
    """get_function lists what it loads; with its cubin gone (an update) and this process's caches cleared,
    compile_ahead rebuilds it on a worker and the kernel it gives then computes the norm."""
    from qwen35_fast import kernels
    from qwen35_fast.kernels.rms_norm.launch import rms_norm_cuda
    from qwen35_fast.kernels.rms_norm.reference import rms_norm_ref
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    for name in ("_noted", "_ahead"):
        monkeypatch.setattr(cb, name, set())
    for name in ("_building", "_functions", "_by_path"):
        monkeypatch.setattr(cb, name, {})
    x = torch.randn(5, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, device="cuda").bfloat16()
    want = rms_norm_cuda(x, w, 1e-6)
    arch = cb.card_of("cuda").arch
    probe = cb.KERNELS_DIR / "probe.cu"
    cb.get_function(probe, "probe_scale", "cuda", {"X": 1}, arch=arch)  # the device's own target, named: listed
    cb.get_function(probe, "probe_scale", "cuda", {"X": 2}, arch="compute_80")  # another target: not listed
    listed = cb._read_wanted(arch)
    assert any(e["source"] == "rms_norm/rms_norm.cu" for e in listed)
    assert [e["defines"] for e in listed if e["source"] == "probe.cu"] == [{"X": 1}]
    assert cb._read_wanted("compute_80") == []
    for f in [*tmp_path.glob("qwen35_fast/*.cubin"), *tmp_path.glob("qwen35_fast/*.ptx")]:
        f.unlink()
    monkeypatch.setattr(cb, "_functions", {})
    monkeypatch.setattr(cb, "_by_path", {})
    assert kernels.compile_ahead("cuda") == len(listed)
    got = rms_norm_cuda(x, w, 1e-6)
    assert torch.equal(got, want) and rel(got, rms_norm_ref(x, w, 1e-6)) < 4e-3
    cb.get_function(probe, "probe_scale", "cuda", {"X": 1})  # waits for its worker: none is left
    assert not cb._building and len(list(tmp_path.glob("qwen35_fast/*.cubin"))) == len(listed)


def test_the_first_compile_of_a_process_says_so_once(fake, caplog):
    """Compiling on the caller's thread (a cache miss) logs once a process what the wait is and where the cubins
    go; loading a cached one says nothing."""
    with caplog.at_level("INFO", logger="qwen35_fast.kernels.cuda_build"):
        cb._load_or_compile(NORM.read_text(), NORM, "sm_90a", {"DIM": 128})
        cb._load_or_compile(NORM.read_text(), NORM, "sm_90a", {"DIM": 256})
        cb._load_or_compile(NORM.read_text(), NORM, "sm_90a", {"DIM": 128})
    said = [r.getMessage() for r in caplog.records if "compiling the CUDA kernels" in r.getMessage()]
    assert len(said) == 1 and "sm_90a" in said[0] and str(cb._cubin_cache_dir()) in said[0]
    assert len(fake["compiled"]) == 2


def test_a_cache_folder_that_cannot_be_written_costs_the_list_only(fake, monkeypatch, tmp_path):
    """Where the list cannot be written (the cache path is a file here), noting a module and compiling ahead do
    nothing and raise nothing: the list is a head start, not a need."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocked))
    cb._note_wanted(NORM, "sm_90a", {"DIM": 128})
    assert cb._read_wanted("sm_90a") == [] and cb.compile_ahead("sm_90a") == 0 and not fake["compiled"]


def test_malformed_or_stale_entries_leave_the_list_and_never_stop_a_load(fake, monkeypatch):
    """Entries another version or a damaged file left (defines that are no C name or no int, a day past
    AHEAD_DAYS, a day ahead of the clock that would never age out) are left out."""
    from qwen35_fast import kernels
    today = int(time.time() // 86400)
    good = {"source": "rms_norm/rms_norm.cu", "defines": {"DIM": 128}, "day": today}
    bad = [{"source": "rms_norm/rms_norm.cu", "defines": {"DIM": v}, "day": today} for v in (None, [1], {"x": 1}, True, 1.5)]
    bad += [{"source": "rms_norm/rms_norm.cu", "defines": {"A-B": 1}, "day": today},
            {"source": "rms_norm/rms_norm.cu", "defines": {"DIM": 256}, "day": today - cb.AHEAD_DAYS - 1},
            {"source": "rms_norm/rms_norm.cu", "defines": {"DIM": 512}, "day": float(today)}, ["x"], None]
    ahead = {"source": "conv1d/conv1d.cu", "defines": {}, "day": today + 2000}
    cb._wanted_path("sm_90a").parent.mkdir(parents=True)
    cb._wanted_path("sm_90a").write_text(
        json.dumps([good, *bad, ahead])[:-1] + ', {"source": "probe.cu", "defines": {"X": 1e999}, "day": 1}]')
    assert cb._read_wanted("sm_90a") == [good]
    monkeypatch.setattr(cb, "card_of", lambda device: cb.Card("sm_90a", 132, 232448, 233472))
    assert kernels.compile_ahead("cuda:0") == 1
    for f in list(cb._building.values()):
        f.result()
    monkeypatch.setattr(cb.time, "time", lambda: (today + cb.AHEAD_DAYS + 1) * 86400.0)
    assert cb._read_wanted("sm_90a") == []


def test_two_processes_noting_at_once_lose_no_entry(fake):
    """The list's read-modify-write is locked between processes, not only between threads."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_note_many, args=(first,)) for first in (1, 1001)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert len(cb._read_wanted("sm_90a")) == 2 * 60


def _note_many(first: int) -> None:
    for dim in range(first, first + 60):
        cb._note_wanted(NORM, "sm_90a", {"DIM": dim})


def test_a_cache_folder_that_cannot_be_written_keeps_the_modules_for_the_process(fake, monkeypatch, tmp_path, caplog):
    """The cubins go to a folder of the process's own (said once, with the fix); the process compiles each once."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocked))
    with caplog.at_level("WARNING", logger="qwen35_fast.kernels.cuda_build"):
        got = [cb._load_or_compile(NORM.read_text(), NORM, "sm_90a", {"DIM": d}) for d in (128, 256, 128)]
    assert got[0] == got[2] != got[1] and got[0].read_bytes().startswith(ELF) and len(fake["compiled"]) == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(blocked / "qwen35_fast") in said[0] and "CUPY_CACHE_DIR" in said[0]


def test_the_process_own_kernel_folder_is_removed_at_exit(fake, tmp_path):
    """A process whose cache folder cannot be written leaves no folder of its own behind (one a start before)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["CUPY_CACHE_DIR"] = {str(blocked)!r}
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import _import  # the repository as qwen35_fast where it is not pip-installed (the GPU machine)
        import qwen35_fast.kernels.cuda_build as cb
        cb._compile = lambda source, src_path, arch, opts: b"\\x7fELF module"
        path = cb._build_file(cb.Path({str(blocked / "x.cubin")!r}), "", cb.Path("x.cu"), "sm_90a", [])
        print(path.parent)
        assert path.is_file()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    own = Path(done.stdout.strip().splitlines()[-1])
    assert own.name.startswith("qwen35_fast-kernels-") and not own.exists()
    # a folder already gone by then (a temp cleaner got there first) is no error at exit
    done = subprocess.run([sys.executable, "-c", code + "import shutil; shutil.rmtree(path.parent)\n"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cb.os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        cb._write_atomic(tmp_path / "x.cubin", b"data")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def fake_driver(fake, monkeypatch):
    """get_function on the CPU: the device's target sm_90a, and a module loader that refuses what is not a cubin
    (as cuModuleLoad does) or, once, everything (`refuse`); loads are recorded."""
    import cupy
    monkeypatch.setattr(cb, "card_of", lambda device: cb.Card("sm_90a", 132, 232448, 233472))
    for name in ("_functions", "_by_path"):
        monkeypatch.setattr(cb, name, {})
    state = {"loaded": [], "refuse": 0}

    class Module:
        def __init__(self, path):
            data = open(path, "rb").read()
            if not data.startswith(ELF) or state["refuse"]:
                state["refuse"] = max(0, state["refuse"] - 1)
                raise RuntimeError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
            state["loaded"].append(path)

        def get_function(self, name):
            return type("Kernel", (), {"kernel": None})()
    monkeypatch.setattr(cupy, "RawModule", Module)
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: contextlib.nullcontext())
    return state


def test_a_damaged_cached_module_is_compiled_again(fake, fake_driver):
    """A cubin that is no ELF file (zeros a crash left) is rebuilt before loading; one the driver refuses anyway
    is rebuilt once; refused again, the error names the file."""
    path = _path(NORM, "sm_90a", {"DIM": 128})
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(4096))
    cb.get_function(NORM, "rms_norm", "cuda:0", {"DIM": 128})
    assert len(fake["compiled"]) == 1 and fake_driver["loaded"] == [str(path)]
    cb._load_or_compile(NORM.read_text(), NORM, "sm_90a", {"DIM": 256})  # cached, then refused once
    fake_driver["refuse"] = 1
    cb.get_function(NORM, "rms_norm", "cuda:0", {"DIM": 256})
    assert len(fake["compiled"]) == 3 and len(fake_driver["loaded"]) == 2
    fake_driver["refuse"] = 2
    with pytest.raises(cb.KernelBuildError, match=r"refused the kernel module .*rms_norm-sm_90a-.*\.cubin"):
        cb.get_function(NORM, "rms_norm", "cuda:0", {"DIM": 512})


def test_a_pack_reached_through_a_symlink_shares_the_cache(fake, fake_driver, tmp_path):
    """ComfyUI keeps a custom node's folder as found; a symlinked pack gives its launchers unresolved paths.
    They load the module compile_ahead built under the resolved path, not a second one."""
    link = tmp_path / "linked-kernels"
    link.symlink_to(cb.KERNELS_DIR, target_is_directory=True)
    cb.get_function(link / "rms_norm" / "rms_norm.cu", "rms_norm", "cuda:0", {"DIM": 128})
    cb.get_function(NORM, "rms_norm", "cuda:1", {"DIM": 128})
    assert len(fake["compiled"]) == 1 and len(set(fake_driver["loaded"])) == 1
    assert cb._read_wanted("sm_90a")[0]["source"] == "rms_norm/rms_norm.cu"
