"""What a new user meets on a fresh machine: the README's two commands, install.py's messages (a dry run, a retry by
hand into the right Python), the demo's output, and the registry fields of pyproject.toml. CPU, no network."""
# ruff: noqa: F811  (the fixture imported from test_nodes_install is a parameter of the tests)
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_nodes_install import install  # noqa: F401  (the fixture: install.py as a module)

ROOT = Path(__file__).resolve().parents[1]


def cuda_torch_without_cupy(install, monkeypatch, command, returncode=1):
    """torch 2.9.0 built for CUDA 13.0, no CuPy, `command` the installer; each install ends in `returncode` and is
    recorded."""
    calls = []
    monkeypatch.setattr(install, "torch_cuda", lambda: ("2.9.0+cu130", "13.0", ""))
    monkeypatch.setattr(install, "installed_version", lambda dist: {"torch": "2.9.0+cu130"}.get(dist))
    monkeypatch.setattr(install, "cupy_distributions", lambda: [])
    monkeypatch.setattr(install, "installer", lambda: list(command))

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(install.subprocess, "run", run)
    return calls


def test_a_dry_run_says_that_it_installed_nothing(install, monkeypatch, capsys):
    """--dry-run printed 'installing cupy-cuda13x.' and stopped there, as if it had."""
    calls = cuda_torch_without_cupy(install, monkeypatch, [sys.executable, "-m", "pip", "install"])
    assert install.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not calls
    assert "installing cupy-cuda13x" in out and "dry run: cupy-cuda13x not installed" in out


def test_a_dry_run_with_nothing_to_do_says_nothing_of_a_dry_run(install, monkeypatch, capsys):
    monkeypatch.setattr(install, "torch_cuda", lambda: ("2.13.0+cpu", None, ""))
    assert install.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Nothing to install" in out and "dry run" not in out


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"],
    [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable],
])
def test_a_failed_install_names_this_pythons_installer_for_the_retry(install, monkeypatch, capsys, command):
    """The retry the message offers installs into the Python ComfyUI runs on (a bare `pip` on PATH is another
    Python's on ComfyUI's Windows portable build)."""
    calls = cuda_torch_without_cupy(install, monkeypatch, command)
    assert install.main([]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 1 and "could not install cupy-cuda13x" in out
    retry = out.split("install it later with: ")[1].splitlines()[0]
    assert shlex.split(retry)[:command.index("install") + 2] == command[:command.index("install") + 1] + [
        "cupy-cuda13x"]
    assert "--disable-pip-version-check" not in retry and sys.executable in retry


def test_a_pip_that_hangs_names_this_pythons_installer_for_the_retry(install, monkeypatch, capsys):
    cuda_torch_without_cupy(install, monkeypatch, [sys.executable, "-m", "pip", "install"])

    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))
    monkeypatch.setattr(install.subprocess, "run", hang)
    assert install.main([]) == 0
    assert f"install it later with: {sys.executable} -m pip install cupy-cuda13x" in capsys.readouterr().out


def test_the_retry_command_pastes_into_a_shell(install):
    """A Python under a folder with a space (C:\\Program Files, a user name) and a pinned NVIDIA package come quoted."""
    python = "C:\\Program Files\\ComfyUI\\python_embeded\\python.exe"
    retry = install.by_hand([python, "-m", "pip", "install", "--disable-pip-version-check"], "nvidia-cuda-nvrtc==13.*")
    assert retry == f'"{python}" -m pip install "nvidia-cuda-nvrtc==13.*"'
    assert install.by_hand(["pip", "install"], "cupy-cuda12x") == "pip install cupy-cuda12x"
    assert install.by_hand(["installer"], "cupy-cuda12x") == "installer cupy-cuda12x"  # (any other command)


class FakeRun:
    """load_model, prefill and generate of the runtime, faked: the command line's own output only."""

    def __init__(self, monkeypatch, tmp_path):
        import qwen35_fast.runtime as runtime
        self.demo = tmp_path / "demo-tiny-qwen35"
        self.loaded = []
        monkeypatch.setattr(runtime, "demo_checkpoint", lambda: self.demo)
        monkeypatch.setattr(runtime, "load_model", self.load_model)
        monkeypatch.setattr(runtime, "prefill", lambda model, prompt, **kw: SimpleNamespace(
            new_tokens=5, ms=1.0, tokens_per_s=5000.0, cached_tokens=0, vision=None))
        monkeypatch.setattr(runtime, "generate", self.generate)

    def load_model(self, path, **kwargs):
        self.loaded.append(Path(path))
        return SimpleNamespace(path=Path(path), backend=SimpleNamespace(name="torch", reason="model on cpu"),
                               int8=False, dtype="torch.float32", weight_bytes=lambda: 2 ** 27)

    def generate(self, model, pf, on_token=None, **kwargs):
        on_token("xq", 1, 1)
        return SimpleNamespace(text="xq", thinking="", first_token_ms=1.0, n_tokens=1, decode_tokens_per_s=10.0,
                               finish_reason="length")


def test_the_demos_answer_is_said_to_be_noise(monkeypatch, tmp_path, capsys):
    """The demo's random weights write gibberish; the header says so, or a new user takes it for a broken install."""
    from qwen35_fast.runtime.cli import main
    fake = FakeRun(monkeypatch, tmp_path)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert fake.loaded == [fake.demo]
    header = next(line for line in out.splitlines() if line.startswith("--- answer"))
    assert "demo-tiny-qwen35" in header and "random weights" in header and "noise" in header
    assert "decode " in out and "kernel backend" in out


@pytest.mark.parametrize("command", ["demo", "run"])
def test_a_real_models_answer_is_not_called_noise(monkeypatch, tmp_path, capsys, command):
    from qwen35_fast.runtime.cli import main
    model = tmp_path / "Qwen3.5-9B"
    fake = FakeRun(monkeypatch, tmp_path)
    assert main([command, "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert fake.loaded == [model]
    assert "--- answer (Qwen3.5-9B) ---" in out and "noise" not in out


def test_the_demos_help_says_how_its_checkpoint_comes(capsys):
    """It is made on first use and cached, not embedded in the pack."""
    from qwen35_fast.runtime.cli import main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "embedded" not in text and "random weights" in text and "made on first use" in text


def readme_commands() -> list[str]:
    """The one-line commands of the README's quick start, the demo's first."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("\n## ")[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick, re.S)]


def test_the_readmes_commands_are_the_setup_ci_runs():
    """Both commands make the venv and pin the torch .ci/run installs; the test command installs the test extra and
    runs pytest as CI does; the demo's is a subcommand of the command line."""
    demo, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    torch_pin = re.search(r"pip install -q (torch==\S+)", ci).group(1)
    for command in (demo, tests):
        steps = [s.strip() for s in command.split("&&")]
        assert steps[:3] == ["python3 -m venv .venv", ". .venv/bin/activate", f"pip install {torch_pin}"]
    assert demo.split("&&")[-2:] == [" pip install -e . ", " python -m qwen35_fast demo"]
    assert tests.split("&&")[-2:] == [' pip install -e ".[test]" ', " python -m pytest -q"]
    assert 'pip install -q -e ".[test]"' in ci and re.search(r"^python -m pytest -q$", ci, re.M)
    from qwen35_fast.runtime.cli import _args
    assert _args(["demo"]).command == "demo"


def test_the_registry_fields_are_complete_and_valid():
    """[tool.comfy] as the Comfy registry reads it: a publisher, a display name, an icon that exists in this
    repository at the URL's path, a requires-comfyui of the form it accepts; classifiers of the OS and accelerator
    values it knows (an unknown one makes it drop the whole list)."""
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    comfy, project = data["tool"]["comfy"], data["project"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    repo = project["urls"]["Repository"].removeprefix("https://github.com/")
    icon = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(repo)}/main/(.+\.(svg|png|jpg))",
                        comfy["Icon"])
    assert icon and (ROOT / icon.group(1)).is_file(), comfy["Icon"]
    assert re.fullmatch(r"(==|>=|<=|~=|>|<)?\d+\.\d+\.\d+", comfy["requires-comfyui"])
    assert all(isinstance(f, str) and not f.startswith("/") for f in comfy.get("includes", []))
    accelerators = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                    "GPU :: Apple Metal"}
    for c in project["classifiers"]:
        if c.startswith("Operating System :: "):
            assert c.split(" :: ")[1] in {"Microsoft", "POSIX", "MacOS", "OS Independent"}, c
        elif c.startswith("Environment :: "):
            assert c.removeprefix("Environment :: ") in accelerators, c
