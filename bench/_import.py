"""Makes the repository importable as `qwen35_fast` for the scripts in bench/ when it is not pip-installed
(the GPU machine, CI): the same fallback as tests/conftest.py."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def qwen35_fast():
    if "qwen35_fast" not in sys.modules:
        try:
            import qwen35_fast  # noqa: F401  (pip install -e .)
        except ImportError:
            spec = importlib.util.spec_from_file_location("qwen35_fast", ROOT / "__init__.py",
                                                          submodule_search_locations=[str(ROOT)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["qwen35_fast"] = module
            spec.loader.exec_module(module)
    return sys.modules["qwen35_fast"]


qwen35_fast()


def host_cpu() -> str:
    """The host's CPU model (/proc/cpuinfo, else platform): the eager and first-token times follow the host,
    whose Python launches set the pace of a cold prompt, so the benchmarks' JSON names it."""
    import platform
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
