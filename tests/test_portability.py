"""What differs on Windows and macOS, checked on any machine: names that leave a folder by Windows' rules, the
"._" files macOS writes beside copied files, free RAM without Linux's sysconf / /proc, MPS refusing FP8 with a
TypeError, the CLI writing to a stream in a code page."""
import os
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from qwen35_fast.runtime import checkpoint as ck
from qwen35_fast.runtime import memory
from qwen35_fast.runtime.demo_checkpoint import make_checkpoint
from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.loader import load_model


@pytest.mark.parametrize("name, inside", [
    ("model-00001.safetensors", True), ("shards/a.safetensors", True), ("shards\\a.safetensors", True),
    ("C:evil.safetensors", False), ("C:..\\..\\x.safetensors", False), ("\\Users\\x.safetensors", False),
    ("//server/share/x.safetensors", False), ("/etc/x.safetensors", False), ("../x.safetensors", False),
    ("a/../../x.safetensors", False), ("a\\..\\..\\x.safetensors", False), ("", False), ("a\0b", False)])
def test_names_that_leave_the_folder_on_any_platform_are_refused(name, inside):
    assert ck.name_inside(name) is inside


def test_an_index_naming_a_drive_relative_file_is_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "ck")
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.language_model.embed_tokens.weight": "C:evil.safetensors"}}')
    with pytest.raises(Qwen35Error, match=r"names 'C:evil.safetensors', which is not a .safetensors file inside"):
        load_model(folder, dtype="fp32", device="cpu")


def test_macos_companion_files_beside_the_weights_are_not_read(tmp_path):
    folder = make_checkpoint(tmp_path / "ck")
    (folder / "._model.safetensors").write_bytes(b"\0\5\26\7" + bytes(4092))  # AppleDouble: Finder on exFAT / SMB
    assert [p.name for p in ck.weight_files(folder)] == ["model.safetensors"]
    assert load_model(folder, dtype="fp32", device="cpu").config.num_hidden_layers == 4


def test_free_ram_from_psutil_where_there_is_no_sysconf(monkeypatch):
    """Windows has no os.sysconf and macOS no SC_AVPHYS_PAGES (nor /proc): psutil, ComfyUI's own dependency,
    answers; without it a total that could be read is kept."""
    fake = types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(available=5 << 30, total=16 << 30))
    monkeypatch.setitem(sys.modules, "psutil", fake)
    assert memory.free_bytes(torch.device("cpu")) == (5 << 30, 16 << 30)
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed
    real = memory.os.sysconf

    def mac_sysconf(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real(name)
    monkeypatch.setattr(memory.os, "sysconf", mac_sysconf)
    monkeypatch.setattr(memory, "_mem_available", lambda: 0)
    free, total = memory.free_bytes(torch.device("cpu"))
    assert free == 0 and total > 0


def test_fp8_weights_fall_back_to_the_cpu_where_mps_refuses_them_with_a_type_error(tmp_path, monkeypatch):
    f = tmp_path / "model.safetensors"
    w = torch.randn(8, 16)
    s = w.abs().max() / 448
    save_file({"w": (w / s).to(torch.float8_e4m3fn), "w_scale": s.reshape(())}, str(f))
    real = ck.dequantize

    def on_mps(q, scale, block, dtype, rows_per_step=4096, device=None):
        if device is not None and torch.device(device).type == "mps":
            raise TypeError("Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for "
                            "that dtype.")
        return real(q, scale, block, dtype, rows_per_step, device)
    monkeypatch.setattr(ck, "dequantize", on_mps)
    with ck.WeightReader({"w": ck.Fp8Weight((f, "w_scale"), None)}) as reader:
        out = reader.get(f, "w", torch.float32, torch.device("mps"))
    assert out.shape == (8, 16) and float((out - w).abs().max()) < 0.1 * float(w.abs().max())


def test_the_cli_writes_an_answer_to_a_stream_in_a_code_page(tmp_path):
    """Redirected on Windows, stdout takes the locale's code page (cp1252): characters outside it come out
    replaced, not as a UnicodeEncodeError that ends the run."""
    folder = make_checkpoint(tmp_path / "ck", with_tokenizer=True)
    env = {"PYTHONPATH": os.pathsep.join(sys.path), "PYTHONIOENCODING": "cp1252", "PATH": os.environ.get("PATH", "")}
    script = ("import sys; from qwen35_fast.runtime import generate as g; "
              "g.pick = lambda logits, p, seed, n, backend=None, marks=None: __import__('torch').tensor([[100, 247359, "
              "101][n]]); from qwen35_fast.runtime.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", script, "run", "--model", str(folder), "--device", "cpu",
                          "--prompt", "hi", "--max-new-tokens", "3"], capture_output=True, env=env, timeout=300)
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 0, err
    assert "UnicodeEncodeError" not in err and "?" in out.stdout.decode("cp1252")
