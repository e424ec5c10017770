"""The page side of Generate's stream (web/qwen35.js) under Node.js: tests/js/stream_cases.mjs feeds the extension
the events nodes/text.py sends and checks what the node shows (a page reloaded mid-answer, lists of answers, a
past job's outputs, the workflows it lets go).
Skipped where Node.js is missing; the browser tests (tests/integration) cover the page in a real ComfyUI."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_the_streamed_answer_on_the_page(tmp_path):
    src = (ROOT / "web" / "qwen35.js").read_text(encoding="utf-8")
    mocked, n = re.subn(r'^import \{ (app|api) \} from "[^"]+";$', r"const { \1 } = globalThis.__mocks;", src,
                        flags=re.M)
    assert n == 2, "web/qwen35.js no longer imports app and api as the test expects"
    (tmp_path / "qwen35.mjs").write_text(mocked, encoding="utf-8")
    for name in ("harness.mjs", "stream_cases.mjs"):
        shutil.copy(ROOT / "tests" / "js" / name, tmp_path / name)
    run = subprocess.run([NODE, "--expose-gc", "stream_cases.mjs"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == 13, run.stdout
