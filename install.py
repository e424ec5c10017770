"""Run by ComfyUI-Manager after requirements.txt: installs the CuPy that fits this PyTorch's CUDA.

CuPy must match the CUDA major version PyTorch was built with (cupy-cuda12x or cupy-cuda13x; a `cupy` that runs
that CUDA, as conda-forge's, counts too), so it cannot be a plain requirement. This script:
- never installs, upgrades or removes torch (the versions of torch and numpy are held as they are);
- does nothing when the right CuPy is already there (a second run changes nothing);
- where that CuPy is there but cannot load NVRTC (the run-time compiler the kernels are built with: CUDA's
  libnvrtc, which CuPy finds in a CUDA toolkit or in NVIDIA's pip package), installs that package;
- where the CUDA headers the kernels are compiled with (cuda_bf16.h) are nowhere the kernels look (PyTorch's
  Windows wheels ship CUDA's libraries but not its headers, and most Windows ComfyUI installs have no CUDA
  toolkit), installs NVIDIA's CUDA runtime package of torch's CUDA version, which carries them;
- without CUDA, without a network, or with an unknown CUDA version, says so and exits 0: the pack
  then runs on PyTorch instead of its CUDA kernels.

    python install.py            # what ComfyUI-Manager runs
    python install.py --dry-run  # only say what it would do
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile

log = logging.getLogger("qwen35-fast install")

CUPY_FOR_CUDA_MAJOR = {12: "cupy-cuda12x", 13: "cupy-cuda13x"}
NVRTC_FOR_CUDA_MAJOR = {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc"}
HEADERS_FOR_CUDA_MAJOR = {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-runtime"}
CUDA_BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "cuda_build.py")
PIP_TIMEOUT_S = 900


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cupy_distributions() -> list[str]:
    """Every installed distribution that provides the `cupy` package (cupy, cupy-cuda12x, the older cupy-cuda117,
    cupy-rocm-*, ...), by name as pip knows it."""
    try:
        names = metadata.packages_distributions().get("cupy", [])
    except Exception:  # noqa: BLE001 - a damaged distribution's metadata: fall back to the names
        names = []
    names += [d.metadata["Name"] for d in metadata.distributions()
              if (d.metadata["Name"] or "").lower().startswith("cupy")]
    return sorted({n.lower() for n in names if n})


def torch_cuda() -> tuple[str | None, str | None, str]:
    """(torch version, CUDA version torch was built with, why torch could not be imported); None where absent."""
    try:
        import torch
    except ImportError:
        return None, None, ""
    except Exception as e:  # noqa: BLE001 - a broken install (a DLL that does not load: OSError on Windows)
        return None, None, f"{type(e).__name__}: {e}"
    return torch.__version__, torch.version.cuda, ""


def nvrtc_problem() -> str | None:
    """Why CuPy cannot load NVRTC here (its last line of error), asked of a fresh Python so that a CuPy installed
    just now is the one imported, with torch imported first as the pack runs (torch's CUDA libraries loaded);
    None where it loads."""
    code = "import torch; from cupy_backends.cuda.libs import nvrtc; nvrtc.getVersion()"
    return _fresh_python_problem([sys.executable, "-c", code])


def headers_problem() -> str | None:
    """Why the kernels would not find the CUDA headers here (kernels/cuda_build.py's own search, run in a fresh
    Python so that a package installed just now is on its path: the last line of its error); None where they
    are found."""
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('qwen35_cuda_build', sys.argv[1]); "
            "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); m.cuda_include_dir()")
    return _fresh_python_problem([sys.executable, "-c", code, CUDA_BUILD])


def cupy_cuda_major() -> int | None:
    """The CUDA major version the installed CuPy runs (asked of a fresh Python, torch imported first as the pack
    does); None where CuPy cannot be imported or asked. For the `cupy` distribution, whose name carries no CUDA
    version: conda-forge's, or one built from source against a CUDA toolkit."""
    done = _fresh_python([sys.executable, "-c", "import torch, cupy; print(cupy.cuda.runtime.runtimeGetVersion())"])
    if isinstance(done, Exception) or done.returncode != 0:
        return None
    lines = done.stdout.strip().splitlines()
    return int(lines[-1]) // 1000 if lines and lines[-1].strip().isdigit() else None


def _fresh_python(command: list[str]) -> subprocess.CompletedProcess | Exception:
    """`command` run to its end, its output captured as text; the OSError or timeout where it could not run."""
    try:
        # errors="replace": output in another encoding than the locale's (PYTHONIOENCODING=utf-8 under a Windows code
        # page, a path in it) must not end the script with a UnicodeDecodeError
        return subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return e


def _fresh_python_problem(command: list[str]) -> str | None:
    """The last line of `command`'s error output where it fails (or cannot run); None where it succeeds."""
    done = _fresh_python(command)
    if isinstance(done, Exception):
        return f"{type(done).__name__}: {done}"
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def installer() -> list[str] | None:
    """The command that installs into this interpreter: pip if it has pip, else uv (installed in it as a package, as
    ComfyUI-Manager also tries, or on PATH)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    if importlib.util.find_spec("uv") is not None:  # a venv made by uv, without pip, its scripts folder not on PATH
        return [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable]
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--python", sys.executable]
    return None


def plan() -> tuple[str | None, str]:
    """(package to install or None, what to tell the user)."""
    torch_version, cuda, broken = torch_cuda()
    if broken:
        return None, f"PyTorch could not be imported ({broken}); repair ComfyUI's PyTorch first. Nothing done."
    if torch_version is None:
        return None, "PyTorch is not installed in this Python; install ComfyUI's requirements first. Nothing done."
    if not cuda:
        return None, (f"PyTorch {torch_version} has no CUDA (a CPU, ROCm or MPS build); the pack runs on PyTorch. "
                      "Nothing to install.")
    major = int(cuda.split(".")[0])
    want = CUPY_FOR_CUDA_MAJOR.get(major)
    if want is None:
        return None, (f"PyTorch {torch_version} is built for CUDA {cuda}, for which there is no CuPy package "
                      f"here (known: {', '.join(CUPY_FOR_CUDA_MAJOR.values())}); the pack runs on PyTorch.")
    have = installed_version(want)
    present = cupy_distributions()
    if not have and present == ["cupy"] and cupy_cuda_major() == major:
        want, have = "cupy", installed_version("cupy")  # a CuPy of this CUDA without it in its name: it fits
    others = [f"{d} {installed_version(d)}" for d in present if d != want]
    if have and others:  # checked first: two CuPy packages break `import cupy` even when one is the right one
        return None, (f"{want} {have} is installed for CUDA {cuda} (PyTorch {torch_version}), and so is "
                      f"{', '.join(others)}: two CuPy packages cannot live side by side (import cupy fails, and the "
                      f"pack runs on PyTorch). Remove the other: pip uninstall {' '.join(o.split()[0] for o in others)}")
    if have:
        problem = nvrtc_problem()
        if problem is not None:
            nvrtc = NVRTC_FOR_CUDA_MAJOR[major]
            pin = _pinned(nvrtc, cuda)
            if installed_version(nvrtc) is None:
                return pin, (f"{want} {have} is installed for CUDA {cuda}, but it cannot load NVRTC ({problem}): "
                             f"installing {pin}.")
            return None, (f"{want} {have} and {nvrtc} {installed_version(nvrtc)} are installed for CUDA {cuda}, but "
                          f"CuPy cannot load NVRTC ({problem}). Install a CUDA {major} toolkit (its NVRTC on the "
                          f"library path), then restart ComfyUI; until then the pack runs on PyTorch.")
        problem = headers_problem()
        if problem is not None:
            runtime = HEADERS_FOR_CUDA_MAJOR[major]
            pin = _pinned(runtime, cuda)
            if installed_version(runtime) is None:
                return pin, (f"{want} {have} is installed for CUDA {cuda} and loads NVRTC, but the CUDA headers the "
                             f"kernels are compiled with are missing ({problem}): installing {pin}, which "
                             f"carries them.")
            return None, (f"{want} {have} and {runtime} {installed_version(runtime)} are installed for CUDA {cuda}, "
                          f"but the kernels do not find the CUDA headers ({problem}). Set CUDA_HOME to a CUDA "
                          f"{major} toolkit, then restart ComfyUI; until then the pack runs on PyTorch.")
        return None, f"{want} {have} is already installed for CUDA {cuda} (PyTorch {torch_version}). Nothing to do."
    if others:
        return None, (f"PyTorch {torch_version} is built for CUDA {cuda}, which needs {want}, but "
                      f"{', '.join(others)} is installed. Two CuPy packages cannot live side by side, so this "
                      f"script leaves it alone; to switch: pip uninstall {' '.join(o.split()[0] for o in others)} "
                      f"&& pip install {want}. Until then the pack runs on PyTorch.")
    return want, f"PyTorch {torch_version} is built for CUDA {cuda}: installing {want}."


def _pinned(dist: str, cuda: str) -> str:
    """NVIDIA's package `dist` held to torch's CUDA version `cuda` ("12.4": 12.4.*), not the newest of its major: a
    driver runs the CUDA torch was built for (or torch would not run), while an NVRTC newer than the driver makes
    PTX it refuses (CUDA_ERROR_UNSUPPORTED_PTX_VERSION; the kernels' PTX for cards NVRTC knows no cubin for)."""
    major, _, rest = cuda.partition(".")
    minor = rest.split(".")[0]
    return f"{dist}=={major}.{minor}.*" if minor.isdigit() else f"{dist}=={major}.*"


def _held_versions() -> str:
    """A pip constraints file that keeps torch and numpy exactly as they are."""
    lines = [f"{d}=={v}" for d in ("torch", "numpy") if (v := installed_version(d))]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    return f.name


def by_hand(command: list[str], package: str) -> str:
    """The command that installs `package` later, to paste into a terminal: into this Python, as `command` does
    (a bare `pip` may be another Python's, as on ComfyUI's Windows portable build, whose Python is its own)."""
    at = command.index("install") + 1 if "install" in command else len(command)
    words = command[:at] + [package] + [w for w in command[at:] if w != "--disable-pip-version-check"]
    return " ".join(f'"{w}"' if " " in w or "*" in w else w for w in words)


def install(package: str) -> bool:
    command = installer()
    if command is None:
        log.warning("neither pip nor uv is available to this Python (%s); install %s by hand. The pack runs "
                    "on PyTorch until then.", sys.executable, package)
        return False
    constraints = _held_versions()
    try:
        full = command + ["--constraint", constraints, package]
        log.info("running: %s", " ".join(full))
        try:
            done = subprocess.run(full, capture_output=True, text=True, errors="replace", timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("installing %s took over %d s (no network?); gave up. The pack runs on PyTorch; "
                        "install it later with: %s", package, PIP_TIMEOUT_S, by_hand(command, package))
            return False
        except OSError as e:  # the installer cannot be started (a broken uv on PATH: exec format, permission)
            log.warning("could not run %s (%s: %s); the pack runs on PyTorch; install it later with: pip install %s",
                        full[0], type(e).__name__, e, package)
            return False
    finally:
        os.unlink(constraints)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        log.warning("could not install %s (no network, or no wheel for this platform?):\n%s\nThe pack runs on "
                    "PyTorch; install it later with: %s", package, tail, by_hand(command, package))
        return False
    importlib.invalidate_caches()
    name = package.split("==")[0]
    log.info("installed %s %s", name, installed_version(name))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="only say what would be done")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stdout)  # ComfyUI-Manager shows the script's stdout
    handler.setFormatter(logging.Formatter("[qwen35-fast install] %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    for _ in range(4):  # CuPy, then (asked again once it is there) the NVRTC and the headers it may lack, a last look
        package, message = plan()
        log.info("%s", message)
        if package and args.dry_run:
            log.info("dry run: %s not installed (run without --dry-run to install it)", package)
        if not package or args.dry_run or not install(package):
            break
    return 0  # never fail the pack's install: without CuPy it runs on PyTorch


if __name__ == "__main__":
    sys.exit(main())
