"""Run by ComfyUI-Manager after requirements.txt: installs the CuPy that fits this PyTorch's CUDA.

CuPy must match the CUDA major version PyTorch was built with (cupy-cuda12x or cupy-cuda13x), so it
cannot be a plain requirement. This script:
- never installs, upgrades or removes torch (the versions of torch and numpy are held as they are);
- does nothing when the right CuPy is already there (a second run changes nothing);
- without CUDA, without a network, or with an unknown CUDA version, says so and exits 0: the pack
  then runs its GDN math on PyTorch instead of its CUDA kernels.

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
ALL_CUPY = ("cupy", "cupy-cuda11x", "cupy-cuda12x", "cupy-cuda13x")
PIP_TIMEOUT_S = 900


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def torch_cuda() -> tuple[str | None, str | None]:
    """(torch version, CUDA version torch was built with); None where absent."""
    try:
        import torch
    except ImportError:
        return None, None
    return torch.__version__, torch.version.cuda


def installer() -> list[str] | None:
    """The command that installs into this interpreter: pip if it has pip, else uv."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--python", sys.executable]
    return None


def plan() -> tuple[str | None, str]:
    """(package to install or None, what to tell the user)."""
    torch_version, cuda = torch_cuda()
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
    if have:
        return None, f"{want} {have} is already installed for CUDA {cuda} (PyTorch {torch_version}). Nothing to do."
    others = [f"{d} {installed_version(d)}" for d in ALL_CUPY if d != want and installed_version(d)]
    if others:
        return None, (f"PyTorch {torch_version} is built for CUDA {cuda}, which needs {want}, but "
                      f"{', '.join(others)} is installed. Two CuPy packages cannot live side by side, so this "
                      f"script leaves it alone; to switch: pip uninstall {others[0].split()[0]} && "
                      f"pip install {want}. Until then the pack runs on PyTorch.")
    return want, f"PyTorch {torch_version} is built for CUDA {cuda}: installing {want}."


def _held_versions() -> str:
    """A pip constraints file that keeps torch and numpy exactly as they are."""
    lines = [f"{d}=={v}" for d in ("torch", "numpy") if (v := installed_version(d))]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    return f.name


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
            done = subprocess.run(full, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("installing %s took over %d s (no network?); gave up. The pack runs on PyTorch; "
                        "install it later with: pip install %s", package, PIP_TIMEOUT_S, package)
            return False
    finally:
        os.unlink(constraints)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        log.warning("could not install %s (no network, or no wheel for this platform?):\n%s\nThe pack runs on "
                    "PyTorch; install it later with: pip install %s", package, tail, package)
        return False
    importlib.invalidate_caches()
    log.info("installed %s %s", package, installed_version(package))
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
    package, message = plan()
    log.info("%s", message)
    if package and not args.dry_run:
        install(package)
    return 0  # never fail the pack's install: without CuPy it runs on PyTorch


if __name__ == "__main__":
    sys.exit(main())
