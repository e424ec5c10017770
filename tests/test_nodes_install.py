"""install.py, the script ComfyUI-Manager runs after requirements.txt: CuPy for torch's CUDA, once."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def install():
    spec = importlib.util.spec_from_file_location("qwen35_install_script", ROOT / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_env(install, monkeypatch, cuda, installed, pip_ok=True, nvrtc_loads=lambda installed: True,
             headers_found=lambda installed: True):
    """torch built for `cuda`, the packages in `installed` {dist: version}; pip calls are recorded; CuPy loads
    NVRTC where nvrtc_loads(installed), the kernels find the CUDA headers where headers_found(installed)."""
    calls = []
    monkeypatch.setattr(install, "torch_cuda", lambda: ("2.14.1", cuda, ""))
    monkeypatch.setattr(install, "installed_version", lambda dist: installed.get(dist))
    monkeypatch.setattr(install, "cupy_distributions", lambda: sorted(d for d in installed if d.startswith("cupy")))
    monkeypatch.setattr(install, "installer", lambda: ["pip", "install"])
    monkeypatch.setattr(install, "cupy_cuda_major", lambda: None)  # (a `cupy` that cannot be asked, unless a test says)
    monkeypatch.setattr(install, "nvrtc_problem", lambda: None if nvrtc_loads(installed) else "libnvrtc not found")
    monkeypatch.setattr(install, "headers_problem",
                        lambda: None if headers_found(installed) else "KernelBuildError: CUDA headers not found")

    def run(cmd, **kwargs):
        calls.append((cmd, Path(cmd[cmd.index("--constraint") + 1]).read_text()))
        if pip_ok:
            installed[cmd[-1].split("==")[0]] = "14.2.0"
        return subprocess.CompletedProcess(cmd, 0 if pip_ok else 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(install.subprocess, "run", run)
    return calls


@pytest.mark.parametrize("cuda, package", [("13.0", "cupy-cuda13x"), ("12.8", "cupy-cuda12x"),
                                           ("12.4", "cupy-cuda12x")])
def test_picks_the_cupy_for_torchs_cuda_and_does_nothing_the_second_time(install, monkeypatch, capsys, cuda,
                                                                        package):
    installed = {"torch": "2.14.1", "numpy": "2.2.0"}
    calls = fake_env(install, monkeypatch, cuda, installed)
    assert install.main([]) == 0
    assert len(calls) == 1
    cmd, constraints = calls[0]
    assert cmd[-1] == package and "torch" not in cmd[-1]
    assert "torch==2.14.1" in constraints and "numpy==2.2.0" in constraints  # torch is never touched
    assert install.main([]) == 0
    assert len(calls) == 1, "the second run installed again"
    out = capsys.readouterr().out
    assert f"installing {package}" in out and "Nothing to do" in out


@pytest.mark.parametrize("cuda, package, pin", [("13.0", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc==13.0.*"),
                                                ("12.8", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc-cu12==12.8.*")])
def test_a_cupy_without_nvrtc_gets_nvidias_nvrtc_package(install, monkeypatch, capsys, cuda, package, pin):
    """CuPy there but NVRTC not loading (what the kernels' "NVRTC is not available" error says to fix): the NVRTC
    package of torch's CUDA major version is installed, once; where it is there and NVRTC still does not load,
    the script says to install a CUDA toolkit instead of "Nothing to do"."""
    cupy = "cupy-cuda13x" if cuda.startswith("13") else "cupy-cuda12x"
    installed = {"torch": "2.14.1", "numpy": "2.2.0", cupy: "14.2.0"}
    calls = fake_env(install, monkeypatch, cuda, installed, nvrtc_loads=lambda inst: package in inst)
    assert install.main([]) == 0
    assert [c[0][-1] for c in calls] == [pin]
    out = capsys.readouterr().out
    assert f"cannot load NVRTC (libnvrtc not found): installing {pin}" in out and "Nothing to do" in out
    assert install.main([]) == 0 and len(calls) == 1  # loads now: nothing more
    capsys.readouterr()
    # the package there, NVRTC still not loading: no second install, the toolkit named
    calls = fake_env(install, monkeypatch, cuda, dict(installed), nvrtc_loads=lambda inst: False)
    assert install.main([]) == 0 and calls == []
    out = capsys.readouterr().out
    assert "CuPy cannot load NVRTC (libnvrtc not found)" in out and f"CUDA {cuda.split('.')[0]} toolkit" in out
    assert "Nothing to do" not in out


def test_a_fresh_cupy_is_asked_for_nvrtc_in_the_same_run(install, monkeypatch, capsys):
    installed = {"torch": "2.14.1", "numpy": "2.2.0"}
    calls = fake_env(install, monkeypatch, "13.0", installed, nvrtc_loads=lambda inst: "nvidia-cuda-nvrtc" in inst)
    assert install.main([]) == 0
    assert [c[0][-1] for c in calls] == ["cupy-cuda13x", "nvidia-cuda-nvrtc==13.0.*"]
    assert "Nothing to do" in capsys.readouterr().out


@pytest.mark.parametrize("cuda, package, pin", [("13.0", "nvidia-cuda-runtime", "nvidia-cuda-runtime==13.0.*"),
                                                ("12.8", "nvidia-cuda-runtime-cu12",
                                                 "nvidia-cuda-runtime-cu12==12.8.*")])
def test_missing_cuda_headers_get_nvidias_runtime_package(install, monkeypatch, capsys, cuda, package, pin):
    """CuPy and NVRTC there but no cuda_bf16.h where the kernels look (torch's Windows wheels, no toolkit): the
    runtime package of torch's CUDA major version, which carries the headers, is installed once; where it is there
    and the headers are still not found, the script names CUDA_HOME and a toolkit instead of "Nothing to do"."""
    cupy = "cupy-cuda13x" if cuda.startswith("13") else "cupy-cuda12x"
    installed = {"torch": "2.14.1", "numpy": "2.2.0", cupy: "14.2.0"}
    calls = fake_env(install, monkeypatch, cuda, installed, headers_found=lambda inst: package in inst)
    assert install.main([]) == 0
    assert [c[0][-1] for c in calls] == [pin]
    out = capsys.readouterr().out
    assert f"the CUDA headers the kernels are compiled with are missing (KernelBuildError: CUDA headers not " \
           f"found): installing {pin}" in out and "Nothing to do" in out
    assert install.main([]) == 0 and len(calls) == 1
    capsys.readouterr()
    calls = fake_env(install, monkeypatch, cuda, dict(installed, **{package: "13.5.37"}),
                     headers_found=lambda inst: False)
    assert install.main([]) == 0 and calls == []
    out = capsys.readouterr().out
    assert "the kernels do not find the CUDA headers" in out and f"CUDA_HOME to a CUDA {cuda.split('.')[0]} " in out
    assert "Nothing to do" not in out


def test_a_fresh_install_gets_cupy_nvrtc_and_headers_in_one_run(install, monkeypatch, capsys):
    installed = {"torch": "2.14.1", "numpy": "2.2.0"}
    calls = fake_env(install, monkeypatch, "12.8", installed, nvrtc_loads=lambda inst: "nvidia-cuda-nvrtc-cu12" in inst,
                     headers_found=lambda inst: "nvidia-cuda-runtime-cu12" in inst)
    assert install.main([]) == 0
    assert [c[0][-1] for c in calls] == ["cupy-cuda12x", "nvidia-cuda-nvrtc-cu12==12.8.*",
                                          "nvidia-cuda-runtime-cu12==12.8.*"]
    assert "Nothing to do" in capsys.readouterr().out


def test_headers_problem_runs_the_kernels_own_search_in_a_fresh_python(install, monkeypatch):
    """Here (a CUDA toolkit and NVIDIA's runtime package) the kernels' search finds the headers; a failing search
    is reported by its error's last line."""
    assert install.headers_problem() is None
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nKernelBuildError: CUDA headers not found")
    monkeypatch.setattr(install.subprocess, "run", run)
    assert install.headers_problem() == "KernelBuildError: CUDA headers not found"
    cmd = seen[0]
    assert cmd[0] == sys.executable and cmd[-1] == str(ROOT / "kernels" / "cuda_build.py")
    assert "cuda_include_dir()" in cmd[2]


def test_nvrtc_problem_asks_a_fresh_python(install, monkeypatch):
    """The check runs in a new interpreter (a CuPy installed by this run is the one imported) and reports its
    error's last line."""
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        ok = cmd[-1].startswith("import torch;") and "nvrtc.getVersion()" in cmd[-1] and cmd[0] == sys.executable
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: libnvrtc.so.13: cannot open" if ok
                                           else "wrong command")
    monkeypatch.setattr(install.subprocess, "run", run)
    assert install.nvrtc_problem() == "RuntimeError: libnvrtc.so.13: cannot open"
    monkeypatch.setattr(install.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    assert install.nvrtc_problem() is None


def test_the_installed_nvrtc_is_logged_with_its_version(install, monkeypatch, capsys):
    installed = {}
    monkeypatch.setattr(install, "installer", lambda: ["pip", "install"])
    monkeypatch.setattr(install, "installed_version", lambda dist: installed.get(dist))

    def run(cmd, **kw):
        installed[cmd[-1].split("==")[0]] = "13.0.48"
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(install.subprocess, "run", run)
    install.main(["--dry-run"])  # the script's log handler, nothing done
    assert install.install("nvidia-cuda-nvrtc==13.*")
    assert "installed nvidia-cuda-nvrtc 13.0.48" in capsys.readouterr().out


@pytest.mark.parametrize("error", [subprocess.TimeoutExpired(["python"], 120), OSError(8, "Exec format error")])
def test_nvrtc_problem_when_the_check_cannot_run(install, monkeypatch, error):
    """A check that hangs or cannot start is a problem named, not NVRTC loading (nor a crash of the script)."""
    def run(cmd, **kw):
        raise error
    monkeypatch.setattr(install.subprocess, "run", run)
    problem = install.nvrtc_problem()
    assert problem is not None and problem.startswith(type(error).__name__)


def test_without_cuda_says_so_and_exits_0(install, monkeypatch, capsys):
    calls = fake_env(install, monkeypatch, None, {})
    assert install.main([]) == 0
    assert not calls
    assert "runs on PyTorch" in capsys.readouterr().out


def test_unknown_cuda_version_is_left_alone(install, monkeypatch, capsys):
    calls = fake_env(install, monkeypatch, "11.8", {})
    assert install.main([]) == 0
    assert not calls and "runs on PyTorch" in capsys.readouterr().out


def test_a_mismatched_cupy_is_reported_not_replaced(install, monkeypatch, capsys):
    calls = fake_env(install, monkeypatch, "13.0", {"cupy-cuda12x": "13.6.0"})
    assert install.main([]) == 0
    assert not calls
    out = capsys.readouterr().out
    assert "cupy-cuda12x 13.6.0" in out and "pip uninstall cupy-cuda12x" in out


def test_a_second_cupy_beside_the_right_one_is_reported(install, monkeypatch, capsys):
    """The right CuPy with another one beside it (another pack's requirements): import cupy fails, so the
    script says which to remove instead of 'nothing to do'."""
    calls = fake_env(install, monkeypatch, "13.0", {"cupy-cuda13x": "14.2.0", "cupy-cuda12x": "13.6.0"})
    assert install.main([]) == 0
    out = capsys.readouterr().out
    assert not calls and "Nothing to do" not in out and "pip uninstall cupy-cuda12x" in out


def test_any_cupy_distribution_counts_as_one(install, monkeypatch, capsys):
    """An older CuPy name (cupy-cuda117) is a CuPy too: no second one is installed beside it."""
    calls = fake_env(install, monkeypatch, "12.4", {"cupy-cuda117": "10.6.0"})
    assert install.main([]) == 0
    assert not calls and "pip uninstall cupy-cuda117" in capsys.readouterr().out


@pytest.mark.parametrize("runs, fits", [(12, True), (13, False), (None, False)])
def test_a_cupy_without_a_cuda_in_its_name_fits_where_it_runs_torchs_cuda(install, monkeypatch, capsys, runs, fits):
    """conda-forge's CuPy (and one built from source) is the distribution `cupy`: where it runs torch's CUDA major
    version it is the right one (checked for NVRTC and headers like cupy-cuda12x), else a mismatch to remove."""
    calls = fake_env(install, monkeypatch, "12.8", {"cupy": "13.6.0"}, nvrtc_loads=lambda installed: False)
    monkeypatch.setattr(install, "cupy_cuda_major", lambda: runs)
    assert install.main([]) == 0
    out = capsys.readouterr().out
    if fits:
        assert [c[0][-1] for c in calls] == ["nvidia-cuda-nvrtc-cu12==12.8.*"]
        assert "cupy 13.6.0 is installed for CUDA 12.8, but it cannot load NVRTC" in out and "uninstall" not in out
    else:
        assert not calls and "needs cupy-cuda12x, but cupy 13.6.0 is installed" in out
        assert "pip uninstall cupy && pip install cupy-cuda12x" in out


@pytest.mark.parametrize("stdout, code, want", [("12080\n", 0, 12), ("warning\n13000\n", 0, 13), ("", 1, None),
                                                ("not a number\n", 0, None), ("", 0, None), ("12080\n", 1, None)])
def test_cupy_cuda_major_asks_a_fresh_python(install, monkeypatch, stdout, code, want):
    """The version is the last line of a check that succeeds; no output, or a check that fails after printing it
    (a crash on exit), is no answer. The check is given up after a while and its output decoded whatever its
    bytes."""
    seen = []

    def run(cmd, **kwargs):
        seen.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, code, stdout, "Traceback ...")
    monkeypatch.setattr(install.subprocess, "run", run)
    assert install.cupy_cuda_major() == want
    cmd, kwargs = seen[0]
    assert cmd[0] == sys.executable and "import torch, cupy" in cmd[2]
    assert kwargs.get("timeout", 0) > 0 and kwargs.get("errors") == "replace"


@pytest.mark.parametrize("error", [subprocess.TimeoutExpired(["python"], 120), OSError(8, "Exec format error")])
def test_cupy_cuda_major_when_the_check_cannot_run(install, monkeypatch, error):
    """A check that hangs or cannot start is no answer (a `cupy` left as a mismatch), not a crash of the script."""
    def run(cmd, **kw):
        raise error
    monkeypatch.setattr(install.subprocess, "run", run)
    assert install.cupy_cuda_major() is None


def test_the_cuda_versions_install_py_serves_are_the_kernels(install):
    from qwen35_fast.kernels import cuda_build
    assert tuple(sorted(install.CUPY_FOR_CUDA_MAJOR)) == cuda_build.CUDA_MAJORS


def test_cupy_distributions_finds_what_provides_cupy(install, monkeypatch):
    class Dist:
        def __init__(self, name):
            self.metadata = {"Name": name}
    monkeypatch.setattr(install.metadata, "packages_distributions", lambda: {"cupy": ["cupy-rocm-5-0"]})
    monkeypatch.setattr(install.metadata, "distributions", lambda: [Dist("CuPy-CUDA117"), Dist("numpy"), Dist(None)])
    assert install.cupy_distributions() == ["cupy-cuda117", "cupy-rocm-5-0"]


def test_a_torch_that_fails_to_import_is_named_and_exits_0(install, monkeypatch, capsys):
    """A broken PyTorch (a DLL that does not load on Windows raises OSError, not ImportError): said, exit 0."""
    import builtins
    real = builtins.__import__

    def broken(name, *a, **k):
        if name == "torch":
            raise OSError('[WinError 126] Error loading "c10.dll"')
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", broken)
    assert install.main(["--dry-run"]) == 0
    assert "PyTorch could not be imported (OSError: [WinError 126]" in capsys.readouterr().out


def test_failed_install_says_how_to_retry_and_exits_0(install, monkeypatch, capsys):
    calls = fake_env(install, monkeypatch, "13.0", {}, pip_ok=False)
    assert install.main([]) == 0
    assert len(calls) == 1
    out = capsys.readouterr().out
    assert "could not install cupy-cuda13x" in out and "pip install cupy-cuda13x" in out


def test_dry_run_installs_nothing(install, monkeypatch, capsys):
    calls = fake_env(install, monkeypatch, "13.0", {})
    assert install.main(["--dry-run"]) == 0
    assert not calls


def test_without_network_for_real_it_exits_0(tmp_path):
    """The real script and the real pip, offline, in a fresh venv whose torch claims CUDA 12.4."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(textwrap.dedent("""
        __version__ = "2.6.0+cu124"
        class version:
            cuda = "12.4"
    """))
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty), "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([str(python), str(ROOT / "install.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "installing cupy-cuda12x" in done.stdout
    assert "could not install cupy-cuda12x" in done.stdout and "runs on PyTorch" in done.stdout


def test_a_pip_that_hangs_is_given_up_after_the_timeout(install, monkeypatch, capsys):
    """A network that never answers must not hang ComfyUI-Manager's install: pip runs under PIP_TIMEOUT_S."""
    fake_env(install, monkeypatch, "13.0", {})
    seen = {}

    def hang(cmd, **kwargs):
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))
    monkeypatch.setattr(install.subprocess, "run", hang)
    assert install.main([]) == 0
    assert seen["timeout"] == install.PIP_TIMEOUT_S > 0
    assert f"took over {install.PIP_TIMEOUT_S} s" in capsys.readouterr().out


def test_a_check_reports_its_error_output_before_its_other_output(install, monkeypatch):
    monkeypatch.setattr(install.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "some progress line", "Traceback ...\nKernelBuildError: CUDA headers not found"))
    assert install.headers_problem() == "KernelBuildError: CUDA headers not found"
    monkeypatch.setattr(install.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 3, "", ""))
    assert install.headers_problem() == "exit status 3"


def test_output_the_locale_cannot_decode_is_reported_not_a_crash(install, monkeypatch, capsys):
    """pip or a check writing bytes the locale's encoding does not decode (PYTHONIOENCODING=utf-8 under a Windows
    code page, a user folder's name in a path): the problem is reported and the script goes on, never a
    UnicodeDecodeError out of subprocess.run (the script must exit 0)."""
    bad = "import sys; sys.stderr.buffer.write(bytes([69, 58, 32, 0xff, 0xfe, 0x81, 10])); sys.exit(1)"
    problem = install._fresh_python_problem([sys.executable, "-c", bad])
    assert problem is not None and problem.startswith("E: ")
    monkeypatch.setattr(install, "installer", lambda: [sys.executable, "-c", bad])
    install.main(["--dry-run"])  # the script's log handler, nothing done
    assert install.install("cupy-cuda13x") is False
    assert "could not install cupy-cuda13x" in capsys.readouterr().out


def test_uv_installed_as_a_package_is_used_where_pip_is_missing(install, monkeypatch):
    """A venv made by uv has no pip; with uv installed into it but its scripts folder not on PATH (its python run
    without activating it), `python -m uv` installs, as ComfyUI-Manager falls back to it too."""
    real = install.importlib.util.find_spec
    monkeypatch.setattr(install.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pip" else object() if name == "uv" else real(name, *a))
    monkeypatch.setattr(install.shutil, "which", lambda name: None)
    assert install.installer() == [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable]
    monkeypatch.setattr(install.importlib.util, "find_spec", lambda name, *a: object())  # both: pip, as ever
    assert install.installer() == [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]


def test_an_installer_that_cannot_start_is_reported_and_exits_0(install, monkeypatch, capsys, tmp_path):
    """A uv on PATH that cannot be executed (a file without the exec bit, a binary for another platform): said,
    exit 0, not an OSError out of the script."""
    uv = tmp_path / "uv"
    uv.write_text("not a program")
    monkeypatch.setattr(install.importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(install.shutil, "which", lambda name: str(uv))
    monkeypatch.setattr(install, "torch_cuda", lambda: ("2.14.1", "13.0", ""))
    monkeypatch.setattr(install, "installed_version", lambda dist: None)
    monkeypatch.setattr(install, "cupy_distributions", lambda: [])
    assert install.main([]) == 0
    out = capsys.readouterr().out
    assert "installing cupy-cuda13x" in out and f"could not run {uv}" in out
    assert install.install("cupy-cuda13x") is False  # not installed: nothing goes on as if it were


def test_nvidias_packages_are_held_to_torchs_cuda_version(install):
    """NVRTC and the headers' package of torch's own CUDA version, not the newest of its major (an NVRTC newer than
    the driver makes PTX the driver refuses); a version without its minor holds the major only."""
    assert install._pinned("nvidia-cuda-nvrtc-cu12", "12.4") == "nvidia-cuda-nvrtc-cu12==12.4.*"
    assert install._pinned("nvidia-cuda-nvrtc-cu12", "12.8.1") == "nvidia-cuda-nvrtc-cu12==12.8.*"
    assert install._pinned("nvidia-cuda-nvrtc", "13.0") == "nvidia-cuda-nvrtc==13.0.*"
    assert install._pinned("nvidia-cuda-runtime-cu12", "12") == "nvidia-cuda-runtime-cu12==12.*"


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_the_metadata_says_where_the_kernels_run_and_where_pytorch_does():
    """The CUDA kernels run on NVIDIA GPUs and the same model on PyTorch everywhere else, the CPU included: the one
    accelerator classifier is NVIDIA CUDA (the one both PyPI and the Comfy registry know), and the description
    (one line, as the metadata's Summary) says what no classifier can."""
    project = _project()
    accelerators = [c for c in project["classifiers"] if c.startswith("Environment ::")]
    assert accelerators == ["Environment :: GPU :: NVIDIA CUDA"]
    description = project["description"]
    assert "\n" not in description
    assert all(word in description for word in ("NVIDIA", "CUDA kernels", "PyTorch", "CPU")), description


def test_every_classifier_is_one_pypi_takes():
    trove = pytest.importorskip("trove_classifiers")
    classifiers = _project()["classifiers"]
    assert len(set(classifiers)) == len(classifiers)
    assert set(classifiers) <= trove.classifiers, set(classifiers) - trove.classifiers
    assert not set(classifiers) & set(trove.deprecated_classifiers)
