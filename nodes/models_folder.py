"""Where ComfyUI keeps Qwen3.5 checkpoints, and the names the loader lists.

- `models/LLM/<name>/`: a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer
  files). Nested folders (`models/LLM/Qwen/Qwen3.5-4B/`) are listed by their relative path.
- `models/LLM/<file>.safetensors` and `models/text_encoders/<file>.safetensors`: one file with the
  configuration read from the tensors, as ComfyUI's own text encoders are kept.
`LLM` is not one of ComfyUI's standard folders everywhere, so it is registered when absent.
"""
from __future__ import annotations

import os
from pathlib import Path

import folder_paths

LLM = "LLM"
TEXT_ENCODERS = "text_encoders"
WEIGHT_SUFFIXES = (".safetensors",)
MAX_DEPTH = 3


def ensure_llm_folder() -> None:
    if LLM not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(LLM, os.path.join(folder_paths.models_dir, LLM))


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir())


def _scan_llm(base: Path, rel: Path = Path(), depth: int = 0):
    try:
        entries = sorted(os.scandir(base / rel), key=lambda e: e.name.lower())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        if entry.is_dir():
            if _is_checkpoint_dir(path):
                yield (rel / entry.name).as_posix(), path
            elif depth + 1 < MAX_DEPTH:
                yield from _scan_llm(base, rel / entry.name, depth + 1)
        elif depth == 0 and path.suffix in WEIGHT_SUFFIXES:
            yield (rel / entry.name).as_posix(), path


def available_models() -> dict[str, Path]:
    """Name shown in the loader -> checkpoint path. LLM folders come first and win a name clash."""
    ensure_llm_folder()
    found: dict[str, Path] = {}
    for base in folder_paths.get_folder_paths(LLM):
        for name, path in _scan_llm(Path(base)):
            found.setdefault(name, path)
    for name in folder_paths.get_filename_list(TEXT_ENCODERS):
        if name.endswith(WEIGHT_SUFFIXES) and name not in found:
            full = folder_paths.get_full_path(TEXT_ENCODERS, name)
            if full:
                found[name] = Path(full)
    return found


def weights_bytes(path: Path) -> int:
    """Bytes of weight files at `path`: a rough size of the model before it is loaded."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))
