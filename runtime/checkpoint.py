"""Finding, checking and reading Qwen3.5 checkpoints: a Hugging Face folder or one .safetensors file.

Weights are read with safetensors only (never pickle). Every file's header is checked against its
size before any tensor is read, so a truncated download is reported as such, by name.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .config import TextConfig, expected_shapes, from_hf_dict, infer_from_shapes
from .errors import Qwen35Error

# Where the text model's tensors live in the files people have, most specific first.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "model.", "")
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


@dataclass(frozen=True)
class Checkpoint:
    """Where a model's text weights are: tensor name (without prefix) -> (file, name in file)."""
    path: Path
    config: TextConfig
    tensors: dict[str, tuple[Path, str]]
    tokenizer_dir: Path | None


def read_header(file: Path) -> dict:
    """The safetensors header of `file`, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Qwen35Error(f"{file}: {size} bytes is too short to be a safetensors file; re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise Qwen35Error(f"{file}: not a safetensors file, or truncated (header of {n} bytes in a file "
                              f"of {size}); re-download it")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise Qwen35Error(f"{file}: the safetensors header is not valid JSON; the file is corrupt, "
                              "re-download it") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise Qwen35Error(f"{file}: truncated: its header needs {8 + n + end} bytes, the file has {size}; "
                          "the download did not finish, re-download it")
    return header


def _strip(name: str) -> str | None:
    """Text-model name of a tensor, or None for tensors the text model does not use."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for p in TEXT_PREFIXES:
        if name.startswith(p) and name[len(p):].split(".")[0] in ("embed_tokens", "layers", "norm"):
            return name[len(p):]
    return None


def _collect(files: list[Path]) -> tuple[dict[str, tuple[Path, str]], dict[str, tuple[int, ...]], list[str]]:
    tensors, shapes, other = {}, {}, []
    for file in files:
        for name, meta in read_header(file).items():
            key = _strip(name)
            if key is None:
                other.append(name)
                continue
            tensors[key] = (file, name)
            shapes[key] = tuple(meta["shape"])
    return tensors, shapes, other


def _not_qwen35(source: Path, other: list[str]) -> Qwen35Error:
    sample = ", ".join(sorted(other)[:3]) or "no tensors"
    return Qwen35Error(f"{source}: not a Qwen3.5 checkpoint: found {len(other)} tensors such as {sample}, but "
                       "no Qwen3.5 text-model weights (embed_tokens, layers.N.linear_attn...). Pick a Qwen3.5 "
                       "checkpoint folder (models/LLM/<name>/) or a Qwen3.5 text-encoder .safetensors file")


def check_shapes(config: TextConfig, shapes: dict[str, tuple[int, ...]], source: Path) -> None:
    """Every tensor the config needs is present with the shape the config gives."""
    want = expected_shapes(config)
    missing = [k for k in want if k not in shapes]
    if missing:
        raise Qwen35Error(f"{source}: {len(missing)} weights the config needs are missing, e.g. "
                          f"{', '.join(missing[:3])}; the checkpoint is incomplete or does not match its config")
    for k, s in want.items():
        if tuple(shapes[k]) != s:
            raise Qwen35Error(f"{source}: weight {k} has shape {list(shapes[k])} but the config needs {list(s)}; "
                              "the weights do not fit the config (wrong config.json or a different model size)")


def locate(path: str | Path) -> Checkpoint:
    """Check `path` (a checkpoint folder or one .safetensors file) and map its text weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise Qwen35Error(f"model path {str(path)!r} does not exist; put a checkpoint folder under "
                          "models/LLM/ or a .safetensors file under models/text_encoders/, or fix the path")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise Qwen35Error(f"{path}: only .safetensors weights are loaded (never pickle .bin/.pt/.ckpt); "
                              "convert the file to safetensors")
        tensors, shapes, other = _collect([path])
        if "embed_tokens.weight" not in shapes:
            raise _not_qwen35(path, other)
        config = infer_from_shapes(shapes, str(path))
        check_shapes(config, shapes, path)
        tok_dir = path.parent if (path.parent / "tokenizer.json").exists() else None
        return Checkpoint(path, config, tensors, tok_dir)

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
        raise Qwen35Error(f"{path}: no config.json, so this is not a Hugging Face checkpoint folder "
                          f"(found: {found}); point the loader at the folder that holds config.json and "
                          "model*.safetensors")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise Qwen35Error(f"{cfg_file}: not valid JSON ({e}); re-download it") from None
    config = from_hf_dict(cfg, str(cfg_file))
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise Qwen35Error(f"{path}: the index lists {', '.join(absent[:3])}, which is missing; the download "
                              "is incomplete")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found pickle files {', '.join(pickles[:3])}: convert them to safetensors)" if pickles else ""
        raise Qwen35Error(f"{path}: no .safetensors weights{hint}")
    tensors, shapes, other = _collect(files)
    if "embed_tokens.weight" not in shapes:
        raise _not_qwen35(path, other)
    check_shapes(config, shapes, path)
    return Checkpoint(path, config, tensors, path if (path / "tokenizer.json").exists() else None)
