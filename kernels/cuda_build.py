"""Run-time compilation and launching of the CUDA kernels under kernels/ (NVRTC + CuPy).

    fn = get_function(Path(".../gdn_decode.cu"), "gdn_decode_step", q.device, {"DV_TILE": 32})
    launch(fn, grid, block, (q, k, out, np.int32(n)), shared_mem=0)

`compile_cubin` builds one source for a named architecture with no GPU present (CI compile
tests); `get_function` builds for the device in hand and loads the result with CuPy. Both go
through the same NVRTC options, so what CI compiles is what users run.

Caches: in memory per (source text, defines, arch); on disk as cubins under CuPy's kernel cache
folder (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache), so a second process compiles nothing. Beside
them, a list of the modules loaded per target: compile_ahead compiles the missing ones in parallel.
We compile with NVRTC ourselves rather than through RawModule(code=...) because RawModule picks
the target itself and cannot build arch-specific targets such as sm_90a.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
KERNELS_DIR = Path(__file__).resolve().parent
HEADER = "cuda_bf16.h"
_lock = threading.Lock()


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded; the message says what is missing or where the log is."""


# ----------------------------------------------------------------------------- NVRTC and headers

def _torch_cuda_major() -> int:
    """The CUDA major version torch was built with (13 when unknown): CuPy and NVRTC must match it."""
    try:
        import torch
        return int((torch.version.cuda or "13").split(".")[0])
    except Exception:  # noqa: BLE001 - only shapes a hint
        return 13


# the CUDA major versions the kernels are built and tested with (install.py installs CuPy for these)
CUDA_MAJORS = (12, 13)


def _pip_hint(what: str) -> str:
    """The pip package for NVIDIA's `what` ("nvrtc" or "runtime") that matches torch's CUDA, held to torch's minor
    version where torch names it (12.4: ==12.4.*; the newest of the major may make PTX the driver refuses)."""
    major = _torch_cuda_major()
    try:
        import torch
        version = torch.version.cuda or ""
    except Exception:  # noqa: BLE001 - only shapes a hint
        version = ""
    minor = version.split(".")[1] if version.startswith(f"{major}.") else ""
    held = f"{major}.{minor}" if minor.isdigit() else str(major)
    name = f"nvidia-cuda-{what}" if major >= 13 else f"nvidia-cuda-{what}-cu{major}"
    return f"'{name}=={held}.*'"


def _older_cuda() -> str | None:
    """The fix where torch is built for a CUDA older than the kernels take (no CuPy or NVRTC package fits it)."""
    major = _torch_cuda_major()
    if major >= CUDA_MAJORS[0]:
        return None
    return (f"the kernels need a PyTorch built for CUDA {' or '.join(map(str, CUDA_MAJORS))} (this one is built for "
            f"CUDA {major}); install such a PyTorch, then run the pack's install.py. Until then the pack runs on "
            f"PyTorch")


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # ImportError, or the NVRTC shared library itself is missing
        fix = _older_cuda() or (f"install 'cupy-cuda{_torch_cuda_major()}x' and {_pip_hint('nvrtc')} (pip; the "
                                f"CUDA major version of your torch), or a CUDA toolkit")
        raise KernelBuildError(f"NVRTC is not available ({type(e).__name__}: {e}); {fix}") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def _nvcc_toolkit_roots() -> list[Path]:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return []
    path = Path(nvcc).resolve()
    roots = [path.parent.parent]
    try:  # distributions often install nvcc as a wrapper script: `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
        text = path.read_text(errors="ignore")[:4096] if path.stat().st_size < 65536 else ""
        roots += [Path(m).parent.parent for m in re.findall(r"(/[^\s\"']+/bin/nvcc)\b", text)]
    except OSError:
        pass
    return roots


def _pip_include_dirs() -> list[Path]:
    dirs = []
    for base in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include"):
            dirs.append(Path(base or ".") / sub)
    return dirs


def _include_candidates() -> list[Path]:
    cands = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands += _pip_include_dirs()
    cands += [r / "include" for r in _nvcc_toolkit_roots()]
    cands.append(Path("/usr/local/cuda/include"))
    return cands


_include_dir: Path | None = None


def cuda_include_dir() -> Path:
    """The folder holding cuda_bf16.h (and the headers it pulls in)."""
    global _include_dir
    if _include_dir is None:
        cands = _include_candidates()
        for d in cands:
            if (d / HEADER).is_file():
                _include_dir = d
                break
        else:
            tried = ", ".join(dict.fromkeys(str(d) for d in cands if "site-packages" not in str(d)))
            fix = _older_cuda() or f"pip install {_pip_hint('runtime')}, or set CUDA_HOME to a CUDA toolkit"
            raise KernelBuildError(
                f"CUDA headers not found: no {HEADER} under $CUDA_PATH, $CUDA_HOME, pip's nvidia/cu13/include "
                f"or nvidia/cuda_runtime/include, the toolkit beside nvcc, or /usr/local/cuda (tried {tried}). "
                f"Fix: {fix}")
    return _include_dir


# ----------------------------------------------------------------------------- targets and options

def supported_archs() -> tuple[int, ...]:
    return tuple(int(a) for a in _nvrtc().getSupportedArchs())


def arch_for_capability(major: int, minor: int) -> str:
    """NVRTC target for a device: 'sm_90a' on Hopper (wgmma, setmaxnreg allowed: the cubin is for this
    exact chip), 'sm_XY' elsewhere, or 'compute_XY' (PTX the driver finishes) for a chip newer than NVRTC."""
    cc = 10 * major + minor
    if cc < 80:
        raise KernelBuildError(f"compute capability {major}.{minor} is below 8.0, which the kernels need")
    have = nvrtc_version()
    if have[0] < CUDA_MAJORS[0]:  # a CuPy for CUDA 11: its NVRTC builds the probe, not every kernel
        fix = _older_cuda() or (f"install 'cupy-cuda{_torch_cuda_major()}x' in place of this CuPy, and "
                                f"{_pip_hint('nvrtc')} (pip; the CUDA major version of your torch)")
        raise KernelBuildError(f"NVRTC {have[0]}.{have[1]} is older than the kernels take (CUDA "
                               f"{' or '.join(map(str, CUDA_MAJORS))}); {fix}")
    archs = supported_archs()
    if cc in archs:
        return "sm_90a" if cc == 90 else f"sm_{cc}"
    older = [a for a in archs if a <= cc]
    if not older:
        raise KernelBuildError(f"NVRTC {nvrtc_version()} supports none of the architectures up to sm_{cc}")
    return f"compute_{max(older)}"


DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _options(src_path: Path, arch: str, defines: dict | None) -> list[str]:
    opts = ["-std=c++17", f"--gpu-architecture={arch}", "-lineinfo",
            f"-I{cuda_include_dir()}", f"-I{src_path.parent}", f"-I{KERNELS_DIR}"]
    for name, value in sorted((defines or {}).items()):
        if not DEFINE_NAME.fullmatch(name):
            raise ValueError(f"bad define name {name!r} for {src_path.name}")
        opts.append(f"-D{name}={int(value)}")
    return opts


def _local_headers(src_path: Path) -> str:
    """Text of the headers beside the source and in kernels/ (part of the cache key)."""
    parts = []
    for d in dict.fromkeys((src_path.parent, KERNELS_DIR)):
        for h in sorted(d.glob("*.cuh")):
            parts.append(h.name + "\0" + h.read_text(encoding="utf-8"))
    return "\0".join(parts)


def _cache_key(source: str, src_path: Path, arch: str, opts: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, _local_headers(src_path), arch, " ".join(opts), str(nvrtc_version())):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qwen35_fast"


def _cubin_cache_dir() -> Path:
    base = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    return Path(base) / "qwen35_fast"


def _compile(source: str, src_path: Path, arch: str, opts: list[str]) -> bytes:
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, src_path.name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            log_dir = _user_cache_dir() / "nvrtc-logs"
            try:
                log_dir.mkdir(parents=True, exist_ok=True)
                log_path = log_dir / f"{src_path.stem}-{arch}-{_cache_key(source, src_path, arch, opts)[:12]}.log"
                log_path.write_text(f"source: {src_path}\noptions: {' '.join(opts)}\n\n{log}", encoding="utf-8")
                where = f"the compiler log is in {log_path}"
            except OSError:
                where = f"compiler log:\n{log}"
            first = next((ln for ln in log.splitlines() if "error" in ln), log.strip()[:300])
            raise KernelBuildError(f"NVRTC failed to compile {src_path.name} for {arch} ({e}): {first}; {where}") from None
        return nvrtc.getPTX(prog) if arch.startswith("compute_") else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(src_path, arch: str, defines: dict | None = None) -> bytes:
    """Compile `src_path` for `arch` ('sm_80', 'sm_90a', ...) without a GPU. Returns the cubin
    (PTX text for a 'compute_XY' target). Raises KernelBuildError naming the log file on failure."""
    src_path = Path(src_path).resolve()
    return _compile(src_path.read_text(encoding="utf-8"), src_path, arch, _options(src_path, arch, defines))


# ----------------------------------------------------------------------------- loading and launching

_functions: dict = {}  # (source, headers, defines, arch, name, device) -> RawKernel
_by_path: dict = {}  # (path, name, defines, device) -> RawKernel: no file read per launch


def _cubin_path(source: str, src_path: Path, arch: str, opts: list[str]) -> Path:
    ext = ".ptx" if arch.startswith("compute_") else ".cubin"
    return _cubin_cache_dir() / f"{src_path.stem}-{arch}-{_cache_key(source, src_path, arch, opts)}{ext}"


def _write_atomic(path: Path, data: bytes) -> None:
    """path holds data or what it held before, never part of it (concurrent processes, a crash, a full disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_private: list = []  # the process's own folder for cubins where the cache folder cannot be written
_private_lock = threading.Lock()


def _build_file(path: Path, source: str, src_path: Path, arch: str, opts: list[str]) -> Path:
    """Compiles the module into `path`; where the cache folder cannot be written (read-only, a file in the way,
    a full disk), into a folder of this process's own, with a warning once. Returns where the module is."""
    binary = _compile(source, src_path, arch, opts)
    data = binary if isinstance(binary, bytes) else binary.encode()
    try:
        _write_atomic(path, data)
        return path
    except OSError as e:
        with _private_lock:
            if not _private:
                _private.append(Path(tempfile.mkdtemp(prefix="qwen35_fast-kernels-")))
                # removed at exit: the driver has read each module by then (a load reads the whole file)
                atexit.register(shutil.rmtree, _private[0], True)
                log.warning("Qwen3.5: the kernel cache folder %s cannot be written (%s); compiled kernels are kept "
                            "in %s for this process only, so every start compiles them again. Set CUPY_CACHE_DIR "
                            "to a writable folder", path.parent, e, _private[0])
        own = _private[0] / path.name
        own.write_bytes(data)
        return own


def _intact(path: Path) -> bool:
    """A cached module that can be loaded as far as its bytes show: a cubin an ELF file, PTX text."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return False
    return head == b"\x7fELF" if path.suffix == ".cubin" else bool(head) and b"\0" not in head


_told: list = []  # the note that kernels are being compiled is logged once a process


def _load_or_compile(source: str, src_path: Path, arch: str, defines: dict | None) -> Path:
    opts = _options(src_path, arch, defines)
    path = _cubin_path(source, src_path, arch, opts)
    ahead = _building.pop(path, None)
    if ahead is not None:  # compile_ahead's worker has it: wait for that compile
        try:
            ahead.result()
        except Exception:  # noqa: BLE001 - compiled again below, so that its error is raised here
            pass
    if path.is_file() and _intact(path):
        return path
    private = _private[0] / path.name if _private else None
    if private is not None and private.is_file():
        return private
    if not _told:
        _told.append(path)
        log.info("Qwen3.5: compiling the CUDA kernels for this GPU (%s) as they are first used; the first prompts "
                 "wait for them once, later runs load them from %s", arch, path.parent)
    return _build_file(path, source, src_path, arch, opts)


# ----------------------------------------------------------------------------- compiling ahead
# get_function notes each module it loads for the device's own target (a source under kernels/ and its
# defines) in a list per target beside the cubins. compile_ahead compiles the listed modules whose cubin is
# missing on worker threads (NVRTC compiles programs concurrently): the run after the pack's kernels or NVRTC
# changed (every cache key new) then waits about as long as the slowest module, not for all of them in turn.
AHEAD_DAYS = 30  # a module no process has loaded for this many days leaves the list
_building: dict = {}  # cubin path -> the Future of the worker compiling it
_noted: set = set()  # (source, defines, target) this process has noted
_ahead: set = set()  # targets compile_ahead has run for in this process
_list_lock = threading.Lock()  # the lists' read-modify-writes (the caller's thread and the workers)


def _wanted_path(arch: str) -> Path:
    return _cubin_cache_dir() / f"wanted-{arch}.json"


def _today() -> int:
    return int(time.time() // 86400)


def _entry_ok(e) -> bool:
    """An entry as _note_wanted writes it: a source path, int defines under C names, the day it was last used."""
    return (isinstance(e, dict) and isinstance(e.get("source"), str) and type(e.get("day")) is int
            and isinstance(e.get("defines"), dict)
            and all(isinstance(k, str) and DEFINE_NAME.fullmatch(k) and type(v) is int
                    for k, v in e["defines"].items()))


def _read_wanted(arch: str) -> list[dict]:
    """The target's list: entries used within AHEAD_DAYS; anything unreadable or malformed in it, and a day
    ahead of the clock (noted while it was set wrong: it would never age out), is left out (the list is only a
    head start)."""
    try:
        entries = json.loads(_wanted_path(arch).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: nothing to compile ahead
        return []
    today = _today()
    kept = []
    for e in entries if isinstance(entries, list) else []:
        if _entry_ok(e) and 0 <= today - e["day"] <= AHEAD_DAYS:
            kept.append(e)
    return kept


@contextmanager
def _wanted_lock(arch: str):
    """The list's read-modify-write, between this process's threads and between processes (an advisory lock on a
    file beside it, where the platform and the folder allow one)."""
    with _list_lock:
        try:
            path = _wanted_path(arch).with_suffix(".lock")
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(path, "a+b")
        except OSError:  # a read-only folder: nothing will be written either
            fh = None
        if fh is None:
            yield
            return
        try:
            _lock_file(fh, True)
            yield
        finally:
            _lock_file(fh, False)
            fh.close()


def _lock_file(fh, on: bool) -> None:
    try:
        if os.name == "nt":
            import msvcrt
            fh.seek(0)
            msvcrt.locking(fh.fileno(), msvcrt.LK_LOCK if on else msvcrt.LK_UNLCK, 1)
        else:
            import fcntl
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX if on else fcntl.LOCK_UN)
    except OSError:  # a file system without locks: the threads' lock still holds
        pass


def _note_wanted(src_path: Path, arch: str, defines: dict | None) -> None:
    """Adds the module to the target's list (or marks it used today); sources outside kernels/ are not listed."""
    try:
        rel = Path(src_path).resolve().relative_to(KERNELS_DIR).as_posix()
    except ValueError:  # a benchmark's experiment
        return
    d = {k: int(v) for k, v in sorted((defines or {}).items())}
    key = (rel, tuple(d.items()), arch)
    if key in _noted:
        return
    _noted.add(key)
    today = _today()
    with _wanted_lock(arch):
        entries = _read_wanted(arch)
        for e in entries:
            if e["source"] == rel and e["defines"] == d:
                if e["day"] == today:
                    return
                e["day"] = today
                break
        else:
            entries.append({"source": rel, "defines": d, "day": today})
        _write_wanted(arch, entries)


def _write_wanted(arch: str, entries: list[dict]) -> None:
    try:
        _write_atomic(_wanted_path(arch), json.dumps(entries, indent=0).encode())
    except OSError:  # a read-only cache folder: the list is only a head start
        pass


def _build_ahead(path: Path, source: str, src_path: Path, arch: str, opts: list[str], entry: dict) -> Path:
    """A worker's compile; a module that no longer compiles (defines an older version of the pack took) leaves
    the list, so that later starts do not try it again."""
    try:
        return _build_file(path, source, src_path, arch, opts)
    except KernelBuildError:
        gone = (entry["source"], entry["defines"])
        with _wanted_lock(arch):
            _write_wanted(arch, [e for e in _read_wanted(arch) if (e["source"], e["defines"]) != gone])
        raise


def compile_ahead(arch: str, workers: int | None = None) -> int:
    """Starts compiling, on `workers` threads (default: the CPUs less one, at most 8), the modules of the list
    for `arch` whose cubin is missing; get_function waits for a module's worker instead of compiling it again.
    Once per target and process; returns how many compiles it started."""
    with _lock:
        if arch in _ahead:
            return 0
        _ahead.add(arch)
    jobs = []
    for e in _read_wanted(arch):
        src = KERNELS_DIR / e["source"]
        try:
            source = src.read_text(encoding="utf-8")
            opts = _options(src, arch, e["defines"])
        except Exception:  # noqa: BLE001 - a source the pack no longer has, defines it would not take: skipped
            continue
        path = _cubin_path(source, src, arch, opts)
        if not path.is_file() and path not in _building:
            jobs.append((path, source, src, arch, opts, e))
    if not jobs:
        return 0
    _nvrtc()  # loaded once, before the threads
    from concurrent.futures import ThreadPoolExecutor
    workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1))
    pool = ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="qwen35-nvrtc")
    for job in jobs:
        _building[job[0]] = pool.submit(_build_ahead, *job)
    pool.shutdown(wait=False)  # the workers end with their queue
    return len(jobs)


def get_function(src_path, name: str, device, defines: dict | None = None, arch: str | None = None):
    """The `extern "C"` kernel `name` of `src_path`, compiled for `device` with `-D` `defines` (for `arch`,
    an NVRTC target the device runs, e.g. "compute_80"; default: arch_for_capability of the device).
    Returns a cupy.RawKernel; cached in memory and on disk."""
    import torch

    index = device.index if isinstance(device, torch.device) else None  # (with its index: no conversion)
    if index is None:
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
    dkey = tuple(sorted(defines.items())) if defines else ()
    fast = (src_path, name, dkey, index, arch)
    fn = _by_path.get(fast)
    if fn is None:
        src_path = Path(src_path).resolve()  # one cache key however the pack's folder is reached (a symlink)
        source = src_path.read_text(encoding="utf-8")
        own = card_of(torch.device("cuda", index)).arch
        arch, own = arch or own, arch in (None, own)  # built for the device's own target: listed for compile_ahead
        key = (source, _local_headers(src_path), dkey, arch, name, index)
        with _lock:
            fn = _functions.get(key)
            if fn is None:
                fn = _load_function(source, src_path, arch, defines, name, index)
                _functions[key] = fn
                _targets[id(fn)] = arch
                if own:
                    _note_wanted(src_path, arch, defines)
            _by_path[fast] = fn
    return fn


def _load_function(source: str, src_path: Path, arch: str, defines: dict | None, name: str, index: int):
    """The kernel loaded on device `index`; a cached module the driver refuses (a file damaged on disk) is
    compiled again once, and a refusal of that one names the file."""
    import cupy

    def load(path: Path):
        with cupy.cuda.Device(index):
            fn = cupy.RawModule(path=str(path)).get_function(name)
            fn.kernel  # load the module now, not inside a CUDA-graph capture
        return fn

    path = _load_or_compile(source, src_path, arch, defines)
    try:
        return load(path)
    except RuntimeError as e:  # CuPy's CUDADriverError is one
        if "OUT_OF_MEMORY" in str(e):
            raise
        if "UNSUPPORTED_PTX_VERSION" in str(e):  # the driver is older than NVRTC: compiled again, refused again
            raise KernelBuildError(f"the CUDA driver refused the kernel module {path} ({e}){_driver_behind()}") from e
        log.warning("Qwen3.5: the cached kernel module %s could not be loaded (%s); compiling it again", path, e)
        path.unlink(missing_ok=True)
    path = _load_or_compile(source, src_path, arch, defines)
    try:
        return load(path)
    except RuntimeError as e:
        if "OUT_OF_MEMORY" in str(e):
            raise
        raise KernelBuildError(f"the CUDA driver refused the kernel module {path}, compiled just now "
                               f"({e}){_driver_behind()}") from e


def _driver_behind() -> str:
    """Where the NVIDIA driver runs an older CUDA than the NVRTC that compiled a module it refused (PTX it cannot
    JIT: CUDA_ERROR_UNSUPPORTED_PTX_VERSION; a cubin of a newer CUDA major), "; " and the fix; else ""."""
    try:
        import cupy
        d = int(cupy.cuda.runtime.driverGetVersion())  # e.g. 12040 for CUDA 12.4
        nvrtc = tuple(nvrtc_version())[:2]
    except Exception:  # noqa: BLE001 - only shapes a hint
        return ""
    driver = (d // 1000, d % 1000 // 10)
    if driver >= nvrtc:
        return ""
    if driver[0] < nvrtc[0]:  # (CuPy loads only the NVRTC of its own CUDA major)
        fix = f"update the NVIDIA driver to one for CUDA {nvrtc[0]}.{nvrtc[1]} or newer"
    else:
        pin = (f"'nvidia-cuda-nvrtc=={driver[0]}.{driver[1]}.*'" if driver[0] >= 13
               else f"'nvidia-cuda-nvrtc-cu{driver[0]}=={driver[0]}.{driver[1]}.*'")
        fix = f"update the NVIDIA driver, or pip install {pin} (an NVRTC this driver runs)"
    return (f"; the NVIDIA driver runs CUDA {driver[0]}.{driver[1]}, older than the NVRTC {nvrtc[0]}.{nvrtc[1]} that "
            f"compiled it: {fix}, then restart ComfyUI")


_streams: dict = {}
_targets: dict = {}  # id(RawKernel) -> the NVRTC target get_function built it for (kept: _functions holds it)
_kernels: dict = {}  # (id(RawKernel), device) -> [its loaded cupy Function (skipping RawKernel's own lookup),
#                       whether it may be launched programmatically there (None: as the card), the most dynamic
#                       shared memory a launch asked of it there]


def _raw_stream(index: int) -> int:
    """The handle of torch's current stream on device `index`, without building a torch.cuda.Stream object
    where this torch allows (a few microseconds per launch)."""
    import torch
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except (AttributeError, RuntimeError):
        return torch.cuda.current_stream(index).cuda_stream


def _current_stream():
    """(device, CuPy's view of torch's current stream on it), cached per stream."""
    import torch
    try:
        dev = torch._C._cuda_getDevice()
    except (AttributeError, RuntimeError):
        dev = torch.cuda.current_device()
    ptr = _raw_stream(dev)
    cs = _streams.get(ptr)
    if cs is None:
        import cupy
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external(obj); a raw handle needs this
            warnings.simplefilter("ignore", DeprecationWarning)
            cs = _streams[ptr] = cupy.cuda.ExternalStream(ptr, dev)
    return dev, cs


def _arg(a):
    if a is None:
        return np.uint64(0)  # a null pointer for an optional tensor
    if isinstance(a, TensorMap):
        return a.arg
    if isinstance(a, np.generic):
        return a
    if hasattr(a, "data_ptr"):
        return np.uint64(a.data_ptr())
    if isinstance(a, bool):
        return np.int32(a)
    if isinstance(a, int):
        if not -2 ** 31 <= a < 2 ** 31:
            raise OverflowError(f"kernel argument {a} does not fit in int32; pass numpy.int64 explicitly")
        return np.int32(a)
    if isinstance(a, float):
        return np.float32(a)
    raise TypeError(f"kernel argument of type {type(a).__name__} is not a tensor, None, int, float or numpy scalar")


def _driver_library():
    """The CUDA driver library (nvcuda.dll on Windows, libcuda.so.1 elsewhere) through ctypes."""
    import ctypes
    return ctypes.WinDLL("nvcuda.dll") if os.name == "nt" else ctypes.CDLL("libcuda.so.1")


# ----------------------------------------------------------------------------- TMA tensor maps
_encode_tiled = None


def _tensor_map_encoder():
    """cuTensorMapEncodeTiled from the driver library (CUDA 12+), through ctypes."""
    global _encode_tiled
    if _encode_tiled is None:
        import ctypes
        fn = _driver_library().cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _encode_tiled = fn
    return _encode_tiled


class TensorMap:
    """A CUtensorMap (128 bytes, 64-byte aligned, in host memory) for a kernel parameter passed by value
    (`const __grid_constant__` in the kernel; `launch` hands the driver its address). 16-bit elements,
    128-byte swizzle, zero fill out of bounds. `dims` innermost first, `strides` in bytes for dims[1:],
    `box` the tile one copy moves, `promotion` the L2 promotion (CUtensorMapL2promotion: 0 none, 1 64 B,
    2 128 B, 3 256 B). TensorMap.zero() is an all-zero map for kernels that will not use it."""
    __slots__ = ("_buf", "addr", "arg")

    def __init__(self, ptr: int = 0, dims=(), strides=(), box=(), promotion: int = 2):
        import ctypes

        from cupy.cuda.function import CPointer
        self._buf = ctypes.create_string_buffer(128 + 64)
        addr = (ctypes.addressof(self._buf) + 63) & ~63
        if dims:
            rank = len(dims)
            rc = _tensor_map_encoder()(
                addr, 1, rank, ptr,  # CU_TENSOR_MAP_DATA_TYPE_UINT16
                (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
                0, 3, promotion, 0)  # no interleave, 128-byte swizzle, L2 promotion, zero fill
            if rc != 0:
                raise ValueError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {tuple(dims)}, strides "
                                 f"{tuple(strides)} bytes, box {tuple(box)}: strides must be multiples of 16 bytes "
                                 f"and the address 16-byte aligned")
        self.addr = addr
        self.arg = CPointer(addr)

    @staticmethod
    def zero() -> "TensorMap":
        return TensorMap()

    def at(self, ptr: int) -> "TensorMap":
        """This map's copy for the address ptr (its dims, strides, box and promotion): the 128 bytes copied and
        their address replaced by the driver (cuTensorMapReplaceAddress), without encoding again."""
        m = TensorMap()
        ctypes.memmove(m.addr, self.addr, 128)
        rc = _driver_function("cuTensorMapReplaceAddress", (ctypes.c_void_p, ctypes.c_void_p))(m.addr, ptr)
        if rc != 0:
            raise ValueError(f"cuTensorMapReplaceAddress failed (CUresult {rc}) for address {ptr:#x}: it must be "
                             f"16-byte aligned")
        return m


_maps: dict = {}
_shapes: dict = {}  # (dims, strides, box, promotion) -> the first map encoded for them, which new addresses copy
MAPS_KEPT = 256  # entries of each cache of tensor maps keyed by device addresses (and of _shapes)


def keep_map(cache: dict, key, value):
    """cache[key] = value, the cache emptied first when it holds MAPS_KEPT entries (maps are keyed by device
    addresses: the allocator's reuse brings calls back to a few, but a cache must not grow with every new one).
    Returns value."""
    if len(cache) >= MAPS_KEPT:
        cache.clear()
    cache[key] = value
    return value


def tensor_map(x, dims: tuple, strides: tuple, box: tuple, promotion: int = 2) -> TensorMap:
    """TensorMap(x.data_ptr(), ...), made once per address, dims, strides, box and promotion: a CUDA graph's
    captures and the allocator's reuse of addresses find the map made before (keep_map). A new address of a
    shape seen before copies that shape's map with the address replaced (TensorMap.at), a driver call of two
    arguments instead of the encode's twelve."""
    ptr, shape = x.data_ptr(), (tuple(dims), tuple(strides), tuple(box), promotion)
    key = (ptr, *shape)
    m = _maps.get(key)
    if m is None:
        first = _shapes.get(shape)
        if first is None:
            m = keep_map(_shapes, shape, TensorMap(ptr, dims, strides, box, promotion))
        else:
            m = first.at(ptr)
        keep_map(_maps, key, m)
    return m


_smem_optin: dict = {}


def max_shared_memory(device) -> int:
    """Bytes of dynamic shared memory one block may opt in to on `device` (H100/H200: 227 KiB, A100:
    163 KiB, RTX 30/40/50 series: 99 KiB)."""
    import cupy
    import torch
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _smem_optin:
        _smem_optin[idx] = int(cupy.cuda.runtime.deviceGetAttribute(
            cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, idx))
    return _smem_optin[idx]


@dataclass(frozen=True)
class Card:
    """What the launchers' plans need of a GPU: arch_for_capability's NVRTC target, the SM count, the shared
    memory one block may opt in to and one SM holds."""
    arch: str
    sms: int
    smem_per_block: int
    smem_per_sm: int

    @property
    def wgmma(self) -> bool:
        """Whether the card runs the warpgroup-mma (wgmma, TMA) kernels: sm_90a, the H100 / H200."""
        return self.arch == "sm_90a"

    @property
    def programmatic(self) -> bool:
        """Whether kernels built for the card take programmatic dependent launch (programmatic_target)."""
        return programmatic_target(self.arch)


def programmatic_target(arch: str) -> bool:
    """Whether code built for the NVRTC target `arch` waits in common.cuh's grid_wait: compute capability 9.0
    or newer (Hopper, Blackwell). Built for an older target (compute_80 PTX on any card), grid_wait is empty,
    so such a kernel must never start early."""
    return int(re.sub(r"\D", "", arch)) >= 90


_cards: dict = {}


def card_of(device) -> Card:
    """The Card of a torch CUDA device (asked once per device)."""
    import torch

    card = _cards.get(device.index) if isinstance(device, torch.device) else None
    if card is not None:  # (a torch.device with its index: every launch asks)
        return card
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _cards:
        import cupy
        rt = cupy.cuda.runtime
        p = torch.cuda.get_device_properties(idx)
        per_sm = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMaxSharedMemoryPerMultiprocessor", 81), idx)
        _cards[idx] = Card(arch_for_capability(p.major, p.minor), p.multi_processor_count,
                           max_shared_memory(idx), int(per_sm))
    return _cards[idx]


# ----------------------------------------------------------------------------- launching
# Kernels are launched with the driver's cuLaunchKernel through ctypes rather than CuPy's call, which turns
# every argument into an object of its own: a cold image prompt on the 9B shape makes ~475 launches and is
# bound by the host (bench/ttft_profile.py before this: launch and argument conversion ~28 of ~98 ms of
# profiled host time, 63.5 ms wall for 44.8 ms of GPU kernels). Here a launch packs the values into one
# reused buffer with struct.pack_into (24 arguments: 3.9 us on a CI core against 7.0 us for the numpy
# scalars CuPy is handed): one 8-byte slot per parameter (4-byte values in its low half; the driver copies
# as many bytes as the kernel's parameter has) and an array of pointers to the slots; a TensorMap
# parameter (128 bytes, by value) points at the map itself. What each argument becomes (its slot, a
# tensor's data_ptr, None's 0) is found once per tuple of argument types, not per argument per launch: 23
# arguments 2.8 -> 1.9 us, 29 with six TensorMaps (the GDN walk's) 4.8 -> 2.2 us on one CPU core. Without
# the driver library launches go through CuPy.

_SLOT = {"p": "Q", "q": "q", "i": "i4x", "f": "f4x", "d": "d", "m": "Q"}  # struct codes of the parameter kinds
_NP_KIND = {np.int32: "i", np.int64: "q", np.uint64: "p", np.float32: "f", np.float64: "d"}
_tls = threading.local()  # per thread: the packed-parameter buffers by kinds and the argument types' plans
#                           (launches may come from any thread)
_driver_fns: dict = {}  # name -> ctypes function, or False where it is not there
_plain_only: set = set()  # devices whose driver refused a programmatic launch


def _param(a) -> tuple[str, object]:
    """(kind, value) of one kernel argument: "p" a 64-bit pointer (a tensor's data_ptr, None as 0), "q" int64,
    "i" int32, "f" float32, "d" float64, "m" a TensorMap (its address). Python ints are int32, floats float32
    (numpy.float64, a float too, is a double)."""
    kind = _NP_KIND.get(type(a))
    if kind is not None:
        return kind, a.item()
    if a is None:
        return "p", 0
    if isinstance(a, TensorMap):
        return "m", a.addr
    if hasattr(a, "data_ptr"):
        return "p", a.data_ptr()
    if isinstance(a, bool):
        return "i", int(a)
    if isinstance(a, int):
        if not -2 ** 31 <= a < 2 ** 31:
            raise OverflowError(f"kernel argument {a} does not fit in int32; pass numpy.int64 explicitly")
        return "i", a
    if isinstance(a, float):
        return "f", a
    raise TypeError(f"kernel argument of type {type(a).__name__} is not a tensor, None, int, float, TensorMap "
                    f"or numpy int32 / int64 / uint64 / float32 / float64 scalar")


class _Packed:
    """The parameter buffer of one sequence of argument kinds: 8 bytes a parameter, and kernelParams (an
    array of pointers to them; a TensorMap's entry is set to the map's address at each launch)."""
    __slots__ = ("fmt", "buf", "ptrs")

    def __init__(self, kinds: str):
        import ctypes
        self.fmt = "<" + "".join(_SLOT[k] for k in kinds)
        self.buf = ctypes.create_string_buffer(8 * max(1, len(kinds)))
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * max(1, len(kinds)))(*(base + 8 * i for i in range(len(kinds))))


def _signature(args: tuple) -> tuple:
    """What pack_params does with arguments of these types: (the _Packed of their kinds on this thread, the
    positions of tensors (their data_ptr), of None (0) and of TensorMaps (their address in kernelParams));
    every other value is packed as it is. Raises on an argument of no kind (_param names it)."""
    kinds, tensors, nones, maps = "", [], [], []
    for i, a in enumerate(args):
        k, _ = _param(a)
        kinds += k
        if a is None:
            nones.append(i)
        elif k == "m":
            maps.append(i)
        elif k == "p" and type(a) not in _NP_KIND:
            tensors.append(i)
    cache = _thread_dict("packed")
    p = cache.get(kinds)
    if p is None:
        p = cache[kinds] = _Packed(kinds)
    return p, tuple(tensors), tuple(nones), tuple(maps)


def _thread_dict(name: str) -> dict:
    """This thread's dict `name` of _tls (made on first use)."""
    d = getattr(_tls, name, None)
    if d is None:
        d = {}
        setattr(_tls, name, d)
    return d


def pack_params(args: tuple) -> _Packed:
    """`args` packed for cuLaunchKernel (the buffer is reused by the next launch of the same kinds on this
    thread: the driver has copied the values by then). What each argument becomes is looked up once per tuple
    of argument types (a launch has ~25 arguments, and a prefill makes hundreds of launches)."""
    types = tuple(map(type, args))
    sigs = _thread_dict("sigs")
    sig = sigs.get(types)
    if sig is None:
        sig = sigs[types] = _signature(args)
    p, tensors, nones, maps = sig
    vals = list(args)
    for i in tensors:
        vals[i] = vals[i].data_ptr()
    for i in nones:
        vals[i] = 0
    for i in maps:
        vals[i] = 0  # (its slot unused: kernelParams points at the map)
    try:
        struct.pack_into(p.fmt, p.buf, 0, *vals)
    except struct.error as e:
        for a in args:
            _param(a)  # an int past int32 is named there
        raise OverflowError(f"a kernel argument does not fit its parameter: {e}") from None
    for i in maps:
        p.ptrs[i] = args[i].addr
    return p


def _driver_function(name: str, argtypes: tuple):
    """A CUDA driver function (int result) through ctypes, or None where the library or the function is not
    there (kept after the first lookup)."""
    f = _driver_fns.get(name)
    if f is None:
        try:
            f = getattr(_driver_library(), name)
            f.restype, f.argtypes = ctypes.c_int, argtypes
        except (OSError, AttributeError):
            f = False
        _driver_fns[name] = f
    return f or None


_LAUNCH_ARGTYPES = (ctypes.c_void_p,) + (ctypes.c_uint,) * 7 + (ctypes.c_void_p,) * 3


def _driver_launch():
    """cuLaunchKernel, or None where it cannot be loaded."""
    return _driver_function("cuLaunchKernel", _LAUNCH_ARGTYPES)


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: the id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
# launch(..., programmatic=True) launches so where the card takes it; False: every launch waits for the one
# before it to complete (bench/decode_fused_ab.py --b-plain measures the difference)
PROGRAMMATIC = True


_LAUNCH_EX_ARGTYPES = (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def _driver_launch_ex():
    """cuLaunchKernelEx (CUDA 12+), or None where it is not there."""
    return _driver_function("cuLaunchKernelEx", _LAUNCH_EX_ARGTYPES)


def _programmatic_config(grid, block, shared_mem, stream_ptr) -> _LaunchConfig:
    """The launch configuration with programmatic stream serialization allowed (one per thread, refilled)."""
    cfg = getattr(_tls, "pdl", None)
    if cfg is None:
        attr = _LaunchAttr(PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
        cfg = _tls.pdl = (_LaunchConfig(), attr)
        cfg[0].attrs, cfg[0].num_attrs = ctypes.pointer(attr), 1
    c = cfg[0]
    c.grid[:], c.block[:], c.shared_mem, c.stream = grid, block, shared_mem, stream_ptr
    return c


def aligned16(t):
    """t contiguous with a 16-byte aligned start, for kernels that read it in 16-byte vectors (a copy only when
    it is not already)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def launch(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, programmatic: bool = False) -> None:
    """Launch `fn` on torch's current stream. Tensors become device pointers (None a null pointer),
    Python ints int32 and floats float32; numpy scalars pass as they are. Never synchronises.
    programmatic: the kernel may start while the one before it still runs (programmatic dependent launch,
    where the kernel's build target takes it: programmatic_target); only for kernels that call grid_wait()
    (common.cuh) before they read another kernel's output or write anything."""
    dev, stream = _current_stream()
    known = _kernels.get((id(fn), dev))
    if known is None:  # a kernel not from get_function counts as built for the card
        target = _targets.get(id(fn))
        known = _kernels[(id(fn), dev)] = [fn.kernel, programmatic_target(target) if target else None, 0]
    kern, built_to_wait, allowed = known
    if shared_mem > allowed:
        # past 48 KB with the kernel's static shared memory, the kernel must be allowed the dynamic part
        if shared_mem + getattr(fn, "shared_size_bytes", 0) > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared_mem  # on the current device's copy of the kernel
        known[2] = shared_mem
    cu = _driver_launch()
    if cu is None:
        kern(tuple(grid), tuple(block), tuple(_arg(a) for a in args), shared_mem=shared_mem, stream=stream)
        return
    p = pack_params(args)
    gx, gy, gz = grid if len(grid) == 3 else (tuple(grid) + (1, 1))[:3]
    bx, by, bz = block if len(block) == 3 else (tuple(block) + (1, 1))[:3]
    ex = (_driver_launch_ex() if programmatic and PROGRAMMATIC and dev not in _plain_only
          and (card_of(dev).programmatic if built_to_wait is None else built_to_wait) else None)
    if ex is not None:
        rc = ex(_programmatic_config((gx, gy, gz), (bx, by, bz), shared_mem, stream.ptr), kern.ptr, p.ptrs, None)
        if rc not in (0, 201):
            rc = cu(kern.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream.ptr, p.ptrs, None)
            if rc == 0:  # the driver refuses only the attribute: plain launches on this device from now on
                _plain_only.add(dev)
    else:
        rc = cu(kern.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream.ptr, p.ptrs, None)
    if rc == 201:  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread yet; CuPy makes it so
        kern(tuple(grid), tuple(block), tuple(_arg(a) for a in args), shared_mem=shared_mem, stream=stream)
    elif rc != 0:
        raise RuntimeError(f"cuLaunchKernel failed (CUresult {rc}) for grid {tuple(grid)}, block {tuple(block)}, "
                           f"{shared_mem} bytes of shared memory")


_FLAGS: dict = {}  # (device index, stream) -> int32 flags at zero (stream_flags)


def stream_flags(device, n: int):
    """n int32 flags at zero for the launch about to go on the current stream, for kernels whose blocks hand
    work on through flags or count their arrivals on them (vision/attention.cu, sampling/sample.cu): one buffer
    per (device, stream), filled with zeros once. Such a kernel sets each flag back to zero before it ends, so
    launches in stream order always find zeros. A CUDA graph's capture gets flags of its own, filled on every
    replay: a graph shares no state with the launches around its replays, and nothing of its memory pool is
    kept here."""
    import torch

    device = torch.device(device)
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _raw_stream(index))
    f = _FLAGS.get(key)
    if f is None or f.numel() < n:
        f = _FLAGS[key] = torch.zeros(max(n, card_of(device).sms), dtype=torch.int32, device=device)
    return f
