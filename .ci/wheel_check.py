"""Builds the wheel the way `pip install .` does, installs it apart from the checkout and imports every
module of `qwen35_fast` from it. Exits non-zero, naming what is wrong, when:

- a file the checkout ships (a module of a package, a kernel's .cu / .cuh, a web/ or
  example_workflows/ file) is missing from the wheel, or the wheel carries something else (tests/,
  bench/, a virtual environment, build leftovers);
- a module fails to import from the installed copy, with the test-only packages (transformers, pytest,
  jinja2) made unimportable. Modules that import ComfyUI (nodes/) are imported too when COMFYUI_DIR
  names a ComfyUI checkout; without one they must fail on ComfyUI's modules alone;
- `python -m qwen35_fast demo` (the tiny checkpoint built from scratch, then a few tokens on the CPU)
  fails from the installed copy without the test-only packages.

    python .ci/wheel_check.py          # from the repository root, in the environment the tests use

The wheel is built from a copy of the files git knows (tracked, and untracked but not ignored), so
neither an old build/ folder nor ignored files in the checkout can hide a packaging mistake.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "qwen35_fast"
NOT_SHIPPED = {"tests", "bench", "build", "venv", ".venv", ".ci", "docs"}
DATA_SUFFIXES = {".cu", ".cuh"}
DATA_FOLDERS = {"web", "example_workflows"}
COMFYUI_MODULES = {"comfy", "comfy_api", "comfy_execution", "folder_paths", "server", "nodes"}
# Installed for the tests only (the test extra); the pack must run without them.
TEST_ONLY = ("transformers", "pytest", "jinja2")
BLOCK_TEST_ONLY = f"import sys\nfor name in {TEST_ONLY!r}:\n    sys.modules[name] = None\n"
DEMO = BLOCK_TEST_ONLY + (
    "import runpy\n"
    "sys.argv = ['qwen35_fast', 'demo', '--max-new-tokens', '4', '--device', 'cpu', '--backend', 'torch']\n"
    "runpy.run_module('qwen35_fast', run_name='__main__', alter_sys=True)\n")

# Run in a fresh interpreter whose path starts with the installed copy: imports each module, prints JSON.
IMPORTER = r"""
import importlib, json, sys, traceback
from pathlib import Path
site, comfy_dir, package = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
top = importlib.import_module(package)
where = Path(top.__file__).resolve().parent
if where != (site / package).resolve():
    print(json.dumps({"wrong_copy": str(where)}))
    sys.exit(0)
results = {}
for path in sorted(where.rglob("*.py")):
    parts = path.relative_to(where).with_suffix("").parts
    if parts[-1] == "__main__":
        continue  # runs the command line when imported
    name = ".".join((package,) + (parts[:-1] if parts[-1] == "__init__" else parts))
    try:
        importlib.import_module(name)
        results[name] = "ok"
    except ModuleNotFoundError as err:
        root = (err.name or "").split(".")[0]
        results[name] = f"needs:{root}" if root else traceback.format_exc()
        if not root or root == package:
            results[name] = traceback.format_exc()
    except BaseException:  # SystemExit too: importing a module must not end the process
        results[name] = traceback.format_exc()
print(json.dumps({"results": results}))
"""


def git_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def expected_files(files: list[str]) -> set[str]:
    """What the wheel must hold under qwen35_fast/: the modules of every package in the tree (a folder
    with __init__.py whose parents are packages too, down from the root), the kernels' CUDA sources,
    and the front end's and the example workflows' files."""
    present = set(files)

    def is_package(folder: Path) -> bool:
        parts = folder.parts
        if parts and parts[0] in NOT_SHIPPED:
            return False
        return all(str(Path(*parts[:i], "__init__.py")) in present for i in range(len(parts) + 1))

    want = set()
    for f in files:
        path = Path(f)
        if path.parts[0] in DATA_FOLDERS:
            want.add(f)
        elif is_package(path.parent) and (path.suffix == ".py" or path.suffix in DATA_SUFFIXES):
            if path.parent == Path(".") and path.name == "setup.py":
                continue
            want.add(f)
    return want


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="qwen35-wheel-check-"))
    try:
        source, dist, site = work / "source", work / "dist", work / "site"
        files = git_files()
        for f in files:
            (source / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, source / f)
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        subprocess.run(pip + ["wheel", "--no-deps", "-w", str(dist), str(source)], check=True)
        (wheel,) = dist.glob("*.whl")
        problems = []

        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")]
        outside = [n for n in names if not n.startswith(PACKAGE + "/")]
        if outside:
            problems.append(f"files outside {PACKAGE}/ in the wheel: {outside}")
        shipped = {n[len(PACKAGE) + 1:] for n in names if n.startswith(PACKAGE + "/")}
        want = expected_files(files)
        if missing := sorted(want - shipped):
            problems.append(f"in the checkout but not in the wheel: {missing}")
        if extra := sorted(shipped - want):
            problems.append(f"in the wheel but not meant to ship: {extra}")

        subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True)
        comfy_dir = os.environ.get("COMFYUI_DIR", "")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), comfy_dir) if p)}
        done = subprocess.run([sys.executable, "-c", BLOCK_TEST_ONLY + IMPORTER, str(site), comfy_dir, PACKAGE],
                              cwd=work, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            problems.append(f"importing {PACKAGE} from the wheel failed:\n{done.stderr}")
        else:
            report = json.loads(done.stdout.strip().splitlines()[-1])
            if "wrong_copy" in report:
                problems.append(f"{PACKAGE} was imported from {report['wrong_copy']}, not from the wheel in {site}")
            results = report.get("results", {})
            for name, result in sorted(results.items()):
                if result == "ok":
                    continue
                if result.startswith("needs:") and not comfy_dir and result[len("needs:"):] in COMFYUI_MODULES:
                    continue
                problems.append(f"{name} does not import from the wheel:\n{result}")
            imported = sum(r == "ok" for r in results.values())
            needs_comfy = sorted(n for n, r in results.items() if r.startswith("needs:"))
            print(f"wheel {wheel.name}: {len(shipped)} files; {imported} of {len(results)} modules imported "
                  f"from the installed copy" + (f"; without ComfyUI: {', '.join(needs_comfy)}" if needs_comfy
                                                 else ""))

        demo = subprocess.run([sys.executable, "-c", DEMO], cwd=work, capture_output=True, text=True,
                              env={**env, "XDG_CACHE_HOME": str(work / "cache")})
        if demo.returncode != 0 or "--- answer" not in demo.stdout:
            problems.append(f"`python -m {PACKAGE} demo` failed from the wheel (exit {demo.returncode}):\n"
                            f"{demo.stdout[-2000:]}\n{demo.stderr[-4000:]}")
        else:
            print(f"python -m {PACKAGE} demo from the wheel, without {', '.join(TEST_ONLY)}: "
                  + demo.stdout.strip().splitlines()[-1].strip())

        for p in problems:
            print(f"wheel check: {p}", file=sys.stderr)
        return 1 if problems else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
