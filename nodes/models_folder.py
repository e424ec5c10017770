"""Where ComfyUI keeps Qwen3.5 checkpoints, and the names the loader lists.

- `models/LLM/<name>/`: a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer
  files). Nested folders (`models/LLM/Qwen/Qwen3.5-4B/`) are listed by their relative path.
- `models/LLM/<file>.safetensors` and `models/text_encoders/<file>.safetensors`: one file with the
  configuration read from the tensors, as ComfyUI's own text encoders are kept; in a folder without a
  config.json (`models/LLM/qwen/qwen3.5_2b.safetensors`), listed by its relative path.
`LLM` is not one of ComfyUI's standard folders everywhere, so it is registered when absent.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

import folder_paths

from ..runtime.checkpoint import SAFETENSORS_SUFFIXES

log = logging.getLogger(__name__)

LLM = "LLM"
TEXT_ENCODERS = "text_encoders"
MAX_DEPTH = 3


def ensure_llm_folder() -> None:
    """models/LLM registered with ComfyUI and, where the models folder is writable, created (a place to put
    checkpoint folders). Also where an `LLM:` key of extra_model_paths.yaml registered the name first (ComfyUI
    reads that file before it loads the pack): then models/LLM comes after those folders, as ComfyUI appends a
    yaml's folders to its own, and a name in both loads from the yaml's."""
    path = os.path.join(folder_paths.models_dir, LLM)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only models folder: registered all the same, listed when someone makes it
        pass
    folder_paths.add_model_folder_path(LLM, path)  # nothing where it is listed already


SHARD = re.compile(r"-\d+-of-\d+\.safetensors$|\.safetensors\.index\.json$")


def _is_checkpoint_dir(path: Path) -> bool:
    """A Hugging Face checkpoint folder: its config.json, or (one without it, listed so that loading it says what
    is missing) the shards of one. Other folders are searched: their single files are listed by their paths."""
    try:
        return (path / "config.json").is_file() or any(SHARD.search(p.name) for p in path.iterdir())
    except OSError:  # unreadable (lost+found, a permission, a symlink loop): not one we can load
        return False


def _other_model_type(folder: Path) -> bool:
    """Whether the folder's config.json says it is some other model (a broken one stays listed: loading it
    says what is wrong)."""
    try:
        cfg = json.loads((folder / "config.json").read_bytes())
        return isinstance(cfg, dict) and "model_type" in cfg and cfg["model_type"] not in ("qwen3_5", "qwen3_5_text")
    except (OSError, ValueError, RecursionError):
        return False


_header_verdicts: dict[tuple[str, int, int], bool] = {}


def _is_qwen35_file(path: Path) -> bool:
    """From the safetensors header alone, remembered per file version (the list is rebuilt on every refresh)."""
    try:
        st = path.stat()
    except OSError:
        return False
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _header_verdicts:
        try:
            from ..runtime.checkpoint import is_qwen35_file
            _header_verdicts[key] = is_qwen35_file(path)
        except Exception:  # noqa: BLE001 - a listing never raises; loading the file will say what is wrong
            log.exception("Qwen3.5: cannot check %s", path)  # once per file version: listed, as if it passed
            _header_verdicts[key] = True
    return _header_verdicts[key]


def _scan_llm(base: Path, rel: Path = Path(), depth: int = 0):
    try:
        entries = sorted(os.scandir(base / rel), key=lambda e: e.name.lower())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir:
            if _is_checkpoint_dir(path):
                if not _other_model_type(path):
                    yield (rel / entry.name).as_posix(), path
            elif depth + 1 < MAX_DEPTH:
                yield from _scan_llm(base, rel / entry.name, depth + 1)
        elif path.suffix.lower() in SAFETENSORS_SUFFIXES and _is_qwen35_file(path):
            yield (rel / entry.name).as_posix(), path


def available_models() -> dict[str, Path]:
    """Name shown in the loader -> checkpoint path. LLM folders come first and win a name clash.

    Only what holds Qwen3.5 is listed: single files by their safetensors header, folders unless their
    config.json names another model. Never raises: ComfyUI builds its node list from this.
    """
    found: dict[str, Path] = {}
    try:
        ensure_llm_folder()
        bases = list(folder_paths.get_folder_paths(LLM))
    except Exception:  # noqa: BLE001 - a broken extra_model_paths.yaml must not remove the node
        log.exception("Qwen3.5: cannot read the models/LLM folder list")
        bases = []
    for base in bases:
        for name, path in _scan_llm(Path(base)):
            found.setdefault(name, path)
    try:
        names = folder_paths.get_filename_list(TEXT_ENCODERS)
    except Exception:  # noqa: BLE001 - as above
        log.exception("Qwen3.5: cannot list models/text_encoders")
        names = []
    for name in names:
        if name.lower().endswith(SAFETENSORS_SUFFIXES) and name not in found:  # (ComfyUI's case-blind list)
            full = folder_paths.get_full_path(TEXT_ENCODERS, name)
            if full and _is_qwen35_file(Path(full)):
                found[name] = Path(full)
    return found


def find_model(name: str) -> Path | None:
    """The path of a model name: a listed one, or one in models/LLM or models/text_encoders that the list
    left out (not Qwen3.5 by its header), so that loading it can say what it is. Never outside those folders."""
    listed = available_models()
    if name in listed:
        return listed[name]
    from ..runtime.checkpoint import name_inside
    if not isinstance(name, str) or not name_inside(name):
        return None  # by name, not by where links lead: a model folder may link to another disk
    for base in folder_paths.get_folder_paths(LLM):
        path = Path(base) / name
        try:
            if path.exists():
                return path
        except (OSError, ValueError):
            continue
    full = folder_paths.get_full_path(TEXT_ENCODERS, name)
    return Path(full) if full else None


def weights_bytes(path: Path, element_bytes: int = 2, int8: bool = False) -> int:
    """Bytes the model's weights take once loaded with `element_bytes` per number (2: bf16 / fp16), from the
    safetensors headers (an FP8 file takes twice its size, an fp32 one half); with int8, the text model's
    matrices (2-D, outside the vision tower) at a byte a number; 0 for what cannot be read: loading it says why.
    The multi-token-prediction layer some checkpoints carry (mtp.*) is never loaded, so not counted."""
    from ..runtime.checkpoint import MTP_PREFIXES, read_header
    from ..runtime.errors import Qwen35Error
    try:
        from ..runtime.checkpoint import checkpoint_files
        files = [path] if path.is_file() else [p for p in checkpoint_files(path) if p.is_file()]
        return sum(math.prod(t["shape"]) * (1 if int8 and len(t["shape"]) == 2 and "visual." not in name
                                             else element_bytes)
                   for f in files for name, t in read_header(f).items()
                   if not name.startswith(MTP_PREFIXES))
    except (OSError, Qwen35Error):
        return 0
