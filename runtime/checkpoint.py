"""Finding, checking and reading Qwen3.5 checkpoints: a Hugging Face folder or one .safetensors file.

Weights are read with safetensors only (never pickle). Every file's header is checked against its
size before any tensor is read, so a truncated download is reported as such, by name. FP8 weights are
dequantized as they are read (the model computes in bf16 / fp16 / fp32).
"""
from __future__ import annotations

import json
import logging
import math
import re
import stat
import struct
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath, PureWindowsPath

from .config import FULL, LINEAR, TextConfig, expected_shapes, from_hf_dict, infer_from_shapes
from .errors import Qwen35Error

log = logging.getLogger(__name__)

# Where the text model's tensors live in the files people have, most specific first.
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")  # (ComfyUI lists .sft files as safetensors too)
SHARD_NAME = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")  # a Hugging Face shard: model-00001-of-00004.safetensors
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "language_model.", "model.", "")
MTP_PREFIXES = ("mtp.", "model.mtp.")  # the multi-token-prediction layer some checkpoints carry: never loaded
IGNORED_PREFIXES = ("model.visual.", "visual.", *MTP_PREFIXES)


@dataclass(frozen=True)
class Fp8Weight:
    """How one FP8 weight becomes real numbers: w = q * its scale (one for the tensor when block is None, else
    one per block of block[0] rows x block[1] columns), or w = q when it has no scale. (Also a bf16 / fp16 / fp32
    weight beside one scale_weight: older ComfyUI scaled_fp8 files give layers they kept in high precision one,
    which ComfyUI multiplies by.)"""
    scale: tuple[Path, str] | None  # (file, name in file) of its scale tensor
    block: tuple[int, int] | None
    view: str | None = None  # stored as bytes: the torch FP8 dtype to read them as


@dataclass(frozen=True)
class Checkpoint:
    """Where a model's text weights are: tensor name (without prefix) -> (file, name in file); and the checked
    header entries of the other tensors in its files (the vision tower's, MTP's, FP8 scales), name in file -> (file,
    entry), for the vision loader to take its own from."""
    path: Path
    config: TextConfig
    tensors: dict[str, tuple[Path, str]]
    tokenizer_dir: Path | None
    fp8: dict[str, Fp8Weight] = field(default_factory=dict)  # name in file -> its dequantization
    others: dict[str, tuple[Path, dict]] = field(default_factory=dict)


# Bytes per element of the dtypes a safetensors header can name (to check each tensor's extent).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# What the text model can be loaded from as stored: the three floating types it computes in (FP8: below).
LOADABLE_DTYPES = ("BF16", "F16", "F32")
# FP8 weights in the forms in circulation. A weight X.weight stored as FP8 may have one scale beside it:
#   X.weight_scale_inv  Hugging Face fine-grained FP8 (quantization_config quant_method "fp8"): one scale per
#                       block of weight_block_size weights (128 x 128 unless the config says otherwise)
#   X.weight_scale      one scale for the tensor, or one per output row
#   X.scale_weight      ComfyUI's scaled_fp8 files: one scale for the tensor
# w = q * scale; an FP8 weight without a scale is a plain cast (ComfyUI's fp8_e4m3fn files). What only a
# quantized matmul would use (activation scales, format notes, ComfyUI's scaled_fp8 marker) is skipped.
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP8_SCALES = ("weight_scale_inv", "weight_scale", "scale_weight")
FP8_SIDE = ("input_scale", "scale_input", "comfy_quant")
FP8_MARKERS = ("scaled_fp8",)
COMFY_FP8 = ("float8_e4m3fn", "float8_e5m2")  # comfy_quant formats that are FP8 with one scale a tensor
SCALE_DTYPES = ("F32", "BF16", "F16")
FP8_BLOCK = (128, 128)
LFS_POINTER = b"version https://git-lfs"  # how the text file git leaves in place of a Git LFS file starts


def read_header(file: Path) -> dict:
    """The safetensors header of `file`, checked against the file's size and for well-formed entries."""
    try:
        st = file.stat()
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
            raise Qwen35Error(f"{file}: not a regular file; a checkpoint's weights are files")
        with open(file, "rb") as f:
            start = f.read(len(LFS_POINTER))
            head = start[:8]
            f.seek(len(head))  # (the header's length is the first 8 bytes; LFS_POINTER is longer)
            if start == LFS_POINTER:
                raise Qwen35Error(f"{file}: a Git LFS pointer ({size} bytes), not the weights: the checkpoint was "
                                  "cloned with git without Git LFS. Run `git lfs install` and `git lfs pull` in its "
                                  "folder, or download the files with huggingface-cli / the browser")
            if len(head) < 8:
                raise Qwen35Error(f"{file}: {size} bytes is too short to be a safetensors file; re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise Qwen35Error(f"{file}: not a safetensors file, or truncated (header of {n} bytes in a "
                                  f"file of {size}); re-download it")
            raw = f.read(n)
    except OSError as e:
        raise Qwen35Error(f"{file}: cannot be read ({e.strerror or e}); check the file and its permissions") \
            from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise Qwen35Error(f"{file}: the safetensors header is not valid JSON; the file is corrupt, "
                          "re-download it") from None
    if not isinstance(header, dict):
        raise Qwen35Error(f"{file}: the safetensors header is a JSON {type(header).__name__}, not an object "
                          "of tensors; the file is corrupt or not a safetensors file, re-download it")
    header.pop("__metadata__", None)
    spans = []
    for name, t in header.items():
        ok = (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
              and all(type(d) is int and d >= 0 for d in t["shape"])
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and all(type(o) is int for o in t["data_offsets"])
              and 0 <= t["data_offsets"][0] <= t["data_offsets"][1])
        if not ok:
            raise Qwen35Error(f"{file}: the header entry of tensor {name!r} is malformed (it needs dtype, a shape "
                              f"of sizes and data_offsets [start, end]; found {str(t)[:120]}); the file is "
                              "corrupt, re-download it")
        start, end = t["data_offsets"]
        width = DTYPE_BYTES.get(t["dtype"])
        if width is not None and end - start != width * math.prod(t["shape"]):
            raise Qwen35Error(f"{file}: tensor {name!r} ({t['dtype']} {t['shape']}) needs "
                              f"{width * math.prod(t['shape'])} bytes but its data_offsets span {end - start}; "
                              "the file is corrupt, re-download it")
        spans.append((start, end, name))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise Qwen35Error(f"{file}: tensors {a!r} and {b!r} overlap in the file (data_offsets); the file is "
                              "corrupt, re-download it")
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise Qwen35Error(f"{file}: truncated: its header needs {8 + n + end} bytes, the file has {size}; "
                          "the download did not finish, re-download it")
    return header


def fp8_weights(entries: dict[str, tuple[Path, dict]], source: Path, block: tuple[int, int] | None,
                quantized: str | None = None) -> tuple[set[str], dict[str, Fp8Weight]]:
    """The names among `entries` (name in file -> (file, header entry)) that are FP8 scales or side data, not
    weights, and how each FP8 weight is dequantized. block: the config's weight_block_size, if it has one;
    quantized: the config's quant_method, if it has a quantization_config (then every FP8 weight has a scale)."""
    side, scale_of, notes = set(), {}, {}
    for name, (file, _) in entries.items():
        stem, _, suffix = name.rpartition(".")
        if suffix in FP8_MARKERS or suffix in FP8_SIDE:
            side.add(name)
            if suffix == "comfy_quant" and stem:  # ComfyUI's per-layer note of its weight's format
                notes[stem + ".weight"] = (file, name)
        elif suffix in FP8_SCALES and stem:
            side.add(name)
            weight = stem + ".weight"
            if weight not in entries:
                raise Qwen35Error(f"{source}: {name} is the FP8 scale of {weight}, which the checkpoint does not "
                                  "have; the file is incomplete or damaged, re-download it")
            if weight in scale_of:
                raise Qwen35Error(f"{source}: {weight} has two FP8 scales, {scale_of[weight]} and {name}; the "
                                  "file mixes quantization formats, re-download it")
            scale_of[weight] = name
    formats = _comfy_formats(notes, source)
    fp8 = {}
    for name, (_, meta) in entries.items():
        if name in side:
            continue
        scale, fmt, dtype = scale_of.get(name), formats.get(name), meta["dtype"]
        if fmt is not None and fmt not in COMFY_FP8:
            raise Qwen35Error(f"{source}: {name} is quantized as {fmt!r} (ComfyUI's comfy_quant); of the quantized "
                              "formats only FP8 loads: use the bf16 or FP8 release of this model")
        view = fmt if fmt in COMFY_FP8 and dtype == "U8" else None  # FP8 kept as bytes by older ComfyUI saves
        if dtype not in FP8_DTYPES and view is None:
            if scale is not None and dtype in ("U8", "I8"):
                raise Qwen35Error(f"{source}: {name} is {dtype} with a scale: int8 or 4-bit quantized weights are "
                                  "not supported: use the bf16 or FP8 release of this model")
            legacy = scale is not None and scale.endswith(".scale_weight") and dtype in LOADABLE_DTYPES \
                and math.prod(entries[scale][1]["shape"]) == 1  # an older ComfyUI scaled_fp8 file's bf16 layer
            if scale is not None and not legacy:
                raise Qwen35Error(f"{source}: {scale} is an FP8 scale but {name} is {dtype}, not FP8; the "
                                  "file mixes formats, re-download it")
            if scale is None:
                continue
        elif scale is None:
            if quantized is not None:
                raise Qwen35Error(f"{source}: {name} is FP8 without a scale beside it, but config.json's "
                                  f"quantization_config ({quantized}) gives every FP8 weight one; the download is "
                                  "incomplete or mixes files of two downloads: re-download the model's files")
            fp8[name] = Fp8Weight(None, None, view)
            continue
        sfile, smeta = entries[scale]
        if smeta["dtype"] not in SCALE_DTYPES:
            raise Qwen35Error(f"{source}: {scale} is {smeta['dtype']}; FP8 scales load from {', '.join(SCALE_DTYPES)} "
                              "(microscaling formats such as MXFP8 / NVFP4 are not supported): use the bf16 or "
                              "fine-grained FP8 release of this model")
        fp8[name] = Fp8Weight((sfile, scale), _fp8_block(name, meta["shape"], scale, smeta["shape"], block, source),
                              view)
    return side, fp8


def _comfy_formats(notes: dict[str, tuple[Path, str]], source: Path) -> dict[str, str]:
    """weight -> the "format" of its ComfyUI comfy_quant note (a uint8 tensor holding JSON), each file opened
    once."""
    from safetensors import SafetensorError, safe_open
    formats = {}
    with ExitStack() as stack:
        handles = {}
        for weight, (file, name) in notes.items():
            try:
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                note = handles[file].get_tensor(name)
            except SafetensorError as e:  # (what the header check passes and safetensors refuses: trailing bytes)
                raise Qwen35Error(f"{file}: safetensors cannot read it ({e}); the file is damaged or was written by "
                                  "another tool: re-download it") from None
            try:
                fmt = json.loads(note.numpy().tobytes()).get("format")
                if not isinstance(fmt, str):
                    raise TypeError("no format")
            except (ValueError, TypeError, AttributeError, RecursionError):
                raise Qwen35Error(f"{source}: {name} is not a comfy_quant note of a format (JSON with \"format\"); "
                                  "the file is damaged, re-download it") from None
            formats[weight] = fmt
    return formats


def _fp8_block(name: str, shape: list[int], scale: str, sshape: list[int], block, source: Path):
    """None for one scale per tensor, else (rows, columns) per scale of a matrix."""
    if math.prod(sshape) == 1:
        return None
    if len(shape) == 2 and sshape in ([shape[0]], [shape[0], 1]):
        return (1, shape[1])  # one scale per output row
    if len(shape) == 2 and len(sshape) == 2:
        for b in ([tuple(block)] if block else [FP8_BLOCK, (64, 64), (256, 256), (32, 32), (16, 16)]):
            if [-(-shape[0] // b[0]), -(-shape[1] // b[1])] == list(sshape):
                return b
    hint = f"blocks of {list(block)} (the config's weight_block_size)" if block else "blocks of 128 x 128"
    raise Qwen35Error(f"{source}: {scale} has shape {list(sshape)}, which is not one scale, one per row or one per "
                      f"{hint} of {name} {list(shape)}; the scales do not fit their weight, re-download it")


def dequantize(q, scale, block: tuple[int, int] | None, dtype, rows_per_step: int = 4096, device=None):
    """An FP8 tensor as `dtype` on `device` (default: q's): q * scale in fp32, rounded once, a few thousand rows
    at a time (a 1 GB FP8 embedding never exists as 4 GB of fp32), each step's FP8 rows moved there first."""
    import torch
    out = torch.empty(q.shape, dtype=dtype, device=device if device is not None else q.device)
    for r0, part in dequantized_rows(q, scale, block, out.device, rows_per_step):
        out[r0:r0 + part.shape[0]].copy_(part)
    return out


def dequantized_rows(q, scale, block: tuple[int, int] | None, device, rows_per_step: int = 4096):
    """(first row, rows of q * scale in fp32 on `device`), a few thousand rows at a time (q alone without a
    scale)."""
    s = None if scale is None else scale.to(device).float()
    step = rows_per_step if block is None else max(1, rows_per_step // block[0]) * block[0]
    for r0 in range(0, q.shape[0], step):
        r1 = min(q.shape[0], r0 + step)
        part = q[r0:r1].to(device).float()
        if s is not None and block is None:
            part.mul_(s.reshape(()))
        elif s is not None:
            sb = s.reshape(s.shape[0], -1)[r0 // block[0]:-(-r1 // block[0])].repeat_interleave(block[0], 0)[:r1 - r0]
            if sb.shape[1] > 1:
                sb = sb.repeat_interleave(block[1], 1)[:, :q.shape[1]]
            part.mul_(sb)
        yield r0, part


class WeightReader:
    """Reads a checkpoint's tensors, each file opened once, FP8 weights dequantized to the dtype asked for, on
    the device asked for (a GPU does it in a fraction of the CPU's time; a device without FP8 conversion in this
    torch leaves it to the CPU, said once); other tensors come as stored, on the CPU: the caller's copy converts
    and moves them."""

    def __init__(self, fp8: dict[str, Fp8Weight]):
        self.fp8, self._stack, self._handles = fp8, ExitStack(), {}
        self._on_device = True  # until the device turns out to have no FP8 conversion in this torch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _raw(self, file: Path, name: str, shape_only: bool = False):
        from safetensors import SafetensorError, safe_open
        try:
            if file not in self._handles:
                self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            if shape_only:
                return tuple(self._handles[file].get_slice(name).get_shape())
            return self._handles[file].get_tensor(name)
        except SafetensorError as e:  # what the header check passes and safetensors refuses (trailing bytes, ...)
            raise Qwen35Error(f"{file}: safetensors cannot read it ({e}); the file is damaged or was written by "
                              "another tool: re-download it") from None

    def shape(self, file: Path, name: str) -> tuple[int, ...]:
        """The shape of a tensor, from its file's header (nothing read)."""
        return self._raw(file, name, shape_only=True)

    def get(self, file: Path, name: str, dtype, device=None, out=None):
        """The tensor `name` of `file`: as stored, on the CPU, or, an FP8 weight, dequantized to `dtype` on `device`.
        out: a tensor of its shape to write it into instead (an FP8 weight then never exists whole in `dtype`
        beside it: its rows are dequantized straight into `out`)."""
        if name not in self.fp8:
            t = self._raw(file, name)
            return t if out is None else out.copy_(t)
        import torch
        for r0, part in self.rows(file, name, device if out is None else out.device):
            if out is None:  # where the rows come (the CPU where this torch cannot convert FP8 on `device`)
                out = torch.empty(self.shape(file, name), dtype=dtype, device=part.device)
            out[r0:r0 + part.shape[0]].copy_(part)
        return out if out is not None else torch.empty(self.shape(file, name), dtype=dtype)

    def rows(self, file: Path, name: str, device=None):
        """(first row, rows) of the tensor `name` of `file`: a tensor as stored comes whole, on the CPU; an FP8
        weight dequantized in fp32 on `device` (the CPU where this torch cannot convert FP8 there), a few thousand
        rows at a time."""
        how = self.fp8.get(name)
        t = self._raw(file, name)
        if how is None:
            yield 0, t
            return
        if how.view is not None:
            import torch
            t = t.view(getattr(torch, how.view))
        scale = None if how.scale is None else self._raw(*how.scale)
        if device is not None and str(device) != "cpu" and self._on_device:
            steps = dequantized_rows(t, scale, how.block, device)
            try:
                first = next(steps, None)
            except (RuntimeError, NotImplementedError, TypeError) as e:  # MPS: TypeError
                from .memory import is_out_of_memory  # (imported here: like torch, not needed to read headers)
                if is_out_of_memory(e):
                    raise
                self._on_device = False  # no FP8 conversion for this device in this torch: the rest on the CPU too
                log.warning("Qwen3.5: FP8 weights are dequantized on the CPU, not on %s, which cannot convert FP8 "
                            "in this PyTorch (%s: %s); loading takes longer", device, type(e).__name__, e)
            else:
                if first is not None:
                    yield first
                yield from steps
                return
        yield from dequantized_rows(t, scale, how.block, "cpu")


def _strip(name: str, prefixes: tuple[str, ...] = TEXT_PREFIXES) -> str | None:
    """Text-model name of a tensor, or None for tensors the text model does not use."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    beside = name[:-len("lm_head.weight")]
    if name.endswith("lm_head.weight") and any(beside in _roots(p) for p in prefixes):
        return "lm_head.weight"  # beside the text model's prefix (ComfyUI's own name: model.lm_head.weight)
    for p in prefixes:
        if name.startswith(p) and name[len(p):].split(".")[0] in ("embed_tokens", "layers", "norm"):
            return name[len(p):]
    return None


def _roots(prefix: str) -> set[str]:
    """Where a model's lm_head.weight may sit beside text weights under `prefix`: the prefix and each prefix left
    when its trailing "model." / "language_model." parts are taken off one at a time (vlm.model.language_model. ->
    vlm.model., vlm.; model.language_model. -> model., "")."""
    roots, rest = {prefix}, prefix
    while True:
        for part in ("model.", "language_model."):
            if rest.endswith(part) and (len(rest) == len(part) or rest[-len(part) - 1] == "."):
                rest = rest[:-len(part)]
                roots.add(rest)
                break
        else:
            return roots


def _prefixes_of(names) -> tuple[str, ...]:
    """The prefixes the text model's names may have in a file: TEXT_PREFIXES, or where none of those holds its
    embed_tokens, the one before it (ComfyUI's Save CLIP writes <encoder>.transformer.model.layers.*, with
    <encoder>.transformer.lm_head.weight beside it)."""
    embeds = sorted(n for n in names if n.endswith("embed_tokens.weight") and not n.startswith(IGNORED_PREFIXES))
    if not embeds or any(_strip(n) == "embed_tokens.weight" for n in embeds):
        return TEXT_PREFIXES
    return (embeds[0][:-len("embed_tokens.weight")],)


def _text_or_its_fp8(name: str, prefixes: tuple[str, ...] = TEXT_PREFIXES) -> bool:
    """A text-model tensor, an FP8 scale or note of one, or a scaled_fp8 marker."""
    stem, _, suffix = name.rpartition(".")
    if suffix in FP8_MARKERS:
        return True
    if suffix in FP8_SCALES or suffix in FP8_SIDE:
        return _strip(stem + ".weight", prefixes) is not None
    return _strip(name, prefixes) is not None


def _collect(files: list[Path], block: tuple[int, int] | None = None, quantized: str | None = None):
    """(tensors, shapes, others, fp8) of the text model in `files`, others: the header entries of the tensors
    that are not the text model's (name in file -> (file, entry)); block, quantized: the config's FP8 block size
    and quant_method (fp8_weights)."""
    entries: dict[str, tuple[Path, dict]] = {}
    for file in files:
        for name, meta in read_header(file).items():
            if name in entries:
                raise Qwen35Error(f"tensor {name!r} is in both {entries[name][0].name} and {file.name}; a checkpoint "
                                  "holds each tensor once, so the folder mixes files of two downloads: keep one")
            entries[name] = (file, meta)
    source = files[0] if len(files) == 1 else files[0].parent
    qwen35 = _is_qwen35(entries)
    prefixes = _prefixes_of(entries)
    side, fp8 = set(), {}
    if qwen35:  # the text model's FP8 scales (the vision tower's are the vision loader's business)
        side, fp8 = fp8_weights({n: e for n, e in entries.items() if _text_or_its_fp8(n, prefixes)}, source, block,
                                  quantized)
    tensors, shapes, other, dtypes = {}, {}, {}, {}
    for name, (file, meta) in entries.items():
        key = None if name in side else _strip(name, prefixes)
        if key is None:
            other[name] = (file, meta)
            continue
        if qwen35 and key in tensors:  # (one name each in every layout: two are two checkpoints' copies)
            file_a, a = tensors[key]
            raise Qwen35Error(f"{source}: the text model's {key} is there twice, as {a!r} in {file_a.name} and as "
                              f"{name!r} in {file.name}; a checkpoint holds each weight once, so these are two "
                              "checkpoints' weights (say a Hugging Face download and a single-file one): keep one")
        tensors[key] = (file, name)
        shapes[key] = tuple(meta["shape"])
        dtypes[key] = meta["dtype"]
    if not qwen35:
        return tensors, shapes, other, {}  # the caller says what this is instead
    for key, dtype in dtypes.items():
        if dtype not in LOADABLE_DTYPES and tensors[key][1] not in fp8:
            raise Qwen35Error(f"{source}: tensor {tensors[key][1]!r} is {dtype}; Qwen3.5 weights load from "
                              f"{', '.join(LOADABLE_DTYPES)} or FP8 ({' / '.join(FP8_DTYPES)}) only (integer or "
                              "4-bit quantized weights are not supported): use the bf16 release of this model")
    return tensors, shapes, other, fp8


def looks_like(names: list[str]) -> str:
    """A short guess at what model a list of tensor names belongs to, for an error message."""
    joined = "\n".join(names)
    def has(*parts):
        return any(p in joined for p in parts)
    if not names:
        return "an empty safetensors file (no tensors)"
    if has(".lora_A.", ".lora_B.", ".lora_down.", ".lora_up."):  # checked first: a LoRA's names hold its model's
        kind = ("a LoRA (adapter weights that change a base model and do not run alone; this pack does not apply "
                "LoRAs: load the base model, or a checkpoint with the LoRA merged into its weights)")
    elif has("diffusion_model.", "double_blocks.", "joint_blocks.", "transformer_blocks."):
        kind = "a diffusion model"
    elif has("first_stage_model.", "decoder.up.", "encoder.down."):
        kind = "a VAE"
    elif has("encoder.block.", "shared.weight"):
        kind = "a T5 text encoder"
    elif has("text_model.encoder.layers.", "text_projection"):
        kind = "a CLIP text encoder"
    elif has("linear_attn.") and has(".mlp.experts.", ".mlp.gate.weight"):
        kind = "a mixture-of-experts model with Gated DeltaNet layers (Qwen3.5 MoE or Qwen3-Next)"
    elif has(".mlp.experts."):
        kind = "a mixture-of-experts language model"
    elif has("linear_attn."):  # Gated DeltaNet layers, dense, without the embedding
        kind = ("Qwen3.5 layers without the token embedding (embed_tokens): a part of a checkpoint, such as one "
                "shard of a model split into several files; load the folder that holds all of them")
    elif has("visual.blocks.", "visual.merger.") and has("layers."):
        kind = "a vision-language model without Gated DeltaNet layers (Qwen2.5-VL or Qwen3-VL)"
    elif has("self_attn.q_norm."):
        kind = "a Qwen3-style language model (attention in every layer, no Gated DeltaNet layers)"
    elif has("self_attn.q_proj.bias"):
        kind = "a Qwen2-style language model (no Gated DeltaNet layers)"
    elif has("self_attn.q_proj."):
        kind = "a Llama-style language model (no Gated DeltaNet layers)"
    else:
        kind = "another kind of model"
    sample = ", ".join(sorted(names)[:3]) or "no tensors"
    return f"{kind}: {len(names)} tensors such as {sample}"


def _not_qwen35(source: Path, names: list[str]) -> Qwen35Error:
    return Qwen35Error(f"{source}: this is not a Qwen3.5 checkpoint: found {looks_like(names)}. Pick a Qwen3.5 "
                       "checkpoint folder (models/LLM/<name>/) or a Qwen3.5 text-encoder .safetensors file")


def _is_qwen35(names) -> bool:
    """Dense Qwen3.5 text weights: embeddings and Gated DeltaNet layers, no experts."""
    names = list(names)
    return (any(n.endswith("embed_tokens.weight") for n in names)
            and any(n.endswith("linear_attn.A_log") for n in names)
            and not any(".mlp.experts." in n for n in names))


def is_qwen35_file(file: Path) -> bool:
    """Whether a .safetensors file holds Qwen3.5 text weights, from its header alone (no tensor is read)."""
    try:
        return _is_qwen35(read_header(Path(file)))
    except Qwen35Error:
        return False


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
    unused = [k for k in shapes if k not in want and not k.endswith(".inv_freq")]  # (inv_freq: rotary buffers)
    if unused:  # a variant of the architecture (attention biases, say): it loads, but it will not answer as trained
        log.warning("%s: %d tensor%s under the text model's names %s no place in Qwen3.5 and %s not loaded: %s. A "
                    "model trained with them answers differently without them; load an unmodified Qwen3.5 "
                    "checkpoint if its answers look wrong", source, len(unused), "s" * (len(unused) > 1),
                    "have" if len(unused) > 1 else "has", "are" if len(unused) > 1 else "is", _some(unused))


def _all_names(tensors: dict[str, tuple[Path, str]], other: dict[str, tuple[Path, dict]]) -> list[str]:
    return [name for _, name in tensors.values()] + list(other)


def _infer(shapes: dict[str, tuple[int, ...]], source: Path) -> TextConfig:
    if not any(k.endswith("self_attn.q_proj.weight") for k in shapes):
        raise Qwen35Error(f"{source}: every layer is Gated DeltaNet, none has attention (self_attn) weights; a "
                          "Qwen3.5 model has both. The file is incomplete or another model")
    try:
        return infer_from_shapes(shapes, str(source))
    except Qwen35Error:
        raise
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, StopIteration) as e:
        raise Qwen35Error(f"{source}: the tensor shapes are not those of a Qwen3.5 text model (e.g. embed_tokens "
                          f"is {list(shapes.get('embed_tokens.weight', ()))}, it needs [vocab, hidden]; {e}); the "
                          "file is damaged or another model") from None


def _check_sizes(config: TextConfig, source: Path) -> None:
    """Every size in the config is a positive whole number (a string or a float would pass into the model)."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings"):
        value = getattr(config, name)
        if type(value) is not int or value < 1:
            raise Qwen35Error(f"{source}: {name} is {value!r}; it must be a whole number >= 1. Re-download "
                              "config.json")
    for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise Qwen35Error(f"{source}: {name} is {value!r}; it must be a number above 0. Re-download config.json")
    if len(config.mrope_section) != 3 or not all(type(s) is int and s >= 0 for s in config.mrope_section):
        raise Qwen35Error(f"{source}: mrope_section is {list(config.mrope_section)}; it must be three whole numbers "
                          "(the t, h, w sections). Re-download config.json")
    if not 0 < config.rotary_dim <= config.head_dim or config.rotary_dim % 2:
        raise Qwen35Error(f"{source}: partial_rotary_factor {config.partial_rotary_factor!r} gives a rotary width "
                          f"of {config.rotary_dim} of head_dim {config.head_dim}; it must be an even number of at "
                          "most head_dim dims. Re-download config.json")
    bad = [t for t in config.layer_types if t not in (LINEAR, FULL)]
    if bad:
        raise Qwen35Error(f"{source}: layer_types holds {bad[0]!r}; Qwen3.5 layers are {LINEAR!r} or {FULL!r}")
    if not {LINEAR, FULL} <= set(config.layer_types):
        raise Qwen35Error(f"{source}: every layer is {config.layer_types[0]!r}; a Qwen3.5 model mixes "
                          f"{LINEAR!r} and {FULL!r} layers. Re-download config.json")


def generation_eos(path: Path) -> tuple[int, ...]:
    """The end ids generation_config.json lists (transformers stops on them too: a fine-tune may add one there
    only); none where the file is absent or unreadable, which costs only those extra stops."""
    try:
        eos = json.loads(path.read_bytes().decode("utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if type(i) is int and i >= 0)


def read_json(file: Path, fix: str = "re-download it"):
    """A checkpoint's JSON file (config.json, the index, the processor files), read as UTF-8 whatever the locale (a
    byte order mark before it, as Windows' Notepad saved files, skipped); a Qwen35Error naming the file when it
    cannot be read or is not JSON, with `fix` as what to do about the file's content."""
    try:
        return json.loads(file.read_bytes().decode("utf-8-sig"))
    except OSError as e:
        raise Qwen35Error(f"{file}: cannot be read ({e.strerror or e}); check the file and its permissions") from None
    except UnicodeDecodeError as e:
        raise Qwen35Error(f"{file}: not UTF-8 text (byte {e.object[e.start]:#x} at {e.start}); the file is "
                          f"corrupt: {fix}") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise Qwen35Error(f"{file}: not valid JSON ({e}); {fix}") from None


def read_config(cfg_file: Path) -> dict:
    """A checkpoint's config.json as a dict (read_json); a Qwen35Error naming the file when it cannot be read, is
    not JSON or holds no object."""
    cfg = read_json(cfg_file)
    if not isinstance(cfg, dict):
        raise Qwen35Error(f"{cfg_file}: holds a JSON {type(cfg).__name__}, not an object of settings; "
                          "re-download it")
    if cfg.get("model_type") == "qwen3_5" and not isinstance(cfg.get("text_config", {}), dict):
        raise Qwen35Error(f"{cfg_file}: text_config is {cfg['text_config']!r}, not an object of settings; "
                          "re-download it")
    if cfg.get("quantization_config") is not None:  # (null: not quantized)
        what = _unloadable_quantization(cfg["quantization_config"])
        if what:
            raise Qwen35Error(f"{cfg_file}: a quantized checkpoint (quantization_config: {what}); of the quantized "
                              "formats only FP8 weights load (Hugging Face fp8, or compressed-tensors FP8 with one "
                              "scale per tensor or per row; dequantized at load), not GPTQ, AWQ or bitsandbytes: use "
                              "the bf16 or FP8 release of this model")
    return cfg


def _unloadable_quantization(q) -> str:
    """'' when the loader dequantizes the weights of this quantization_config (FP8 with the scales FP8_SCALES
    describes), else what it is."""
    method = _quant_method(q)
    if method == "fp8":
        return ""
    if method == "compressed-tensors":  # llm-compressor's FP8: F8_E4M3 weights, weight_scale per tensor or row
        groups = q.get("config_groups")
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
        if weights and all(isinstance(w, dict) and w.get("num_bits") == 8 and w.get("type") == "float"
                           and w.get("strategy") in ("tensor", "channel") for w in weights):
            return ""
        return "compressed-tensors, not 8-bit float weights with one scale per tensor or per row"
    return str(method)


def _quant_method(q) -> str:
    """The quant_method a quantization_config names, '?' where it names none."""
    return str(q.get("quant_method", "?") if isinstance(q, dict) else "?")


def quant_method_of(cfg: dict) -> str | None:
    """The quant_method of a config's quantization_config, or None without one."""
    q = cfg.get("quantization_config")
    return None if q is None else _quant_method(q)


def fp8_block_of(cfg: dict, cfg_file: Path) -> tuple[int, int] | None:
    """The weight_block_size of a config's FP8 quantization_config, or None."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("weight_block_size") is None:
        return None
    b = q["weight_block_size"]
    if not (isinstance(b, list) and len(b) == 2 and all(type(x) is int and x > 0 for x in b)):
        raise Qwen35Error(f"{cfg_file}: quantization_config.weight_block_size is {b!r}; it must be two whole "
                          "numbers (rows, columns per scale). Re-download config.json")
    return b[0], b[1]


def _index_files(path: Path, index: Path) -> list[Path]:
    """The weight files a model.safetensors.index.json names, each confined to the checkpoint folder."""
    fix = "re-download it, or delete it to load every *.safetensors file in the folder"
    index_map = read_json(index, fix)
    weight_map = index_map.get("weight_map") if isinstance(index_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise Qwen35Error(f"{index}: not a valid index (it needs a weight_map of tensor name -> file name): {fix}")
    files = set()
    for name in weight_map.values():
        file = path / name
        # by name, not by where links lead: a Hugging Face cache links its shards to blobs elsewhere
        if not name_inside(name) or not name.endswith(".safetensors"):
            raise Qwen35Error(f"{index}: names {name!r}, which is not a .safetensors file inside {path}; an index "
                              "may only point to weight files in its own folder")
        files.add(file)
    return sorted(files)


def name_inside(name: str) -> bool:
    """Whether a relative file name stays inside the folder it is joined to, by the rules of every platform: no
    root or drive (Windows' "C:x" and "\\x" too), no "..", no NUL."""
    if not name or "\0" in name:
        return False
    return not any(p.drive or p.root or ".." in p.parts for p in (PurePosixPath(name), PureWindowsPath(name)))


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder the loader reads: those its model.safetensors.index.json names (a
    consolidated file or older shards beside them are not read), else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    return _index_files(folder, index) if index.exists() else weight_files(folder)


def weight_files(folder: Path) -> list[Path]:
    """The *.safetensors files of a folder, without the "._" companions macOS writes beside files it copies to
    drives of other file systems (and other dot files)."""
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))


def _some(names: list[str]) -> str:
    """The first three of `names`, and how many more there are."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _check_shard_series(path: Path, files: list[Path]) -> None:
    """Without an index, the shards named <stem>-0000k-of-0000n.safetensors must all be there: one missing is an
    incomplete download (not a config that does not belong to the weights)."""
    series: dict[tuple[str, str], set[int]] = {}  # (stem, total as written) -> the numbers present
    for f in files:
        m = SHARD_NAME.search(f.name.lower())
        if m:
            series.setdefault((f.name[:m.start()], m[2]), set()).add(int(m[1]))
    for (stem, total), have in sorted(series.items()):
        absent = [f"{stem}-{k:0{len(total)}d}-of-{total}.safetensors"
                  for k in sorted(set(range(1, int(total) + 1)) - have)]
        if absent:
            raise Qwen35Error(f"{path}: the weights are split into {int(total)} files but {_some(absent)} "
                              f"{'is' if len(absent) == 1 else 'are'} missing (and so is model.safetensors.index."
                              "json); the download is incomplete: download the missing files again")


def locate(path: str | Path) -> Checkpoint:
    """Check `path` (a checkpoint folder or one .safetensors file) and map its text weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise Qwen35Error(f"model path {str(path)!r} does not exist; put a checkpoint folder under "
                          "models/LLM/ or a .safetensors file under models/text_encoders/, or fix the path")
    if not path.is_file() and not path.is_dir():
        raise Qwen35Error(f"{path}: not a regular file or a folder; point the loader at a checkpoint folder or a "
                          ".safetensors file")
    if path.is_file():
        if path.suffix.lower() not in SAFETENSORS_SUFFIXES:  # (ComfyUI lists them whatever the case)
            raise Qwen35Error(f"{path}: only .safetensors weights are loaded (never pickle .bin/.pt/.ckpt); "
                              "convert the file to safetensors")
        shard = SHARD_NAME.search(path.name.lower())
        if shard and int(shard[2]) > 1:
            where = (f"load the folder {path.parent} (ComfyUI's loader lists folders under models/LLM/: move it "
                     "there if it is elsewhere)" if (path.parent / "config.json").is_file() else
                     "put all of them and the model's config.json and tokenizer files in one folder under "
                     "models/LLM/ and load that folder")
            raise Qwen35Error(f"{path}: one shard of a checkpoint split into {int(shard[2])} files (shard "
                              f"{int(shard[1])}); it holds only part of the model's weights: {where}")
        tensors, shapes, other, fp8 = _collect([path])
        if not _is_qwen35(_all_names(tensors, other)):
            raise _not_qwen35(path, _all_names(tensors, other))
        config = _infer(shapes, path)
        _check_sizes(config, path)
        check_shapes(config, shapes, path)
        tok_dir = path.parent if (path.parent / "tokenizer.json").exists() else None
        return Checkpoint(path, config, tensors, tok_dir, fp8, other)

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        try:
            found = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
        except OSError as e:
            raise Qwen35Error(f"{path}: cannot be read ({e.strerror or e}); check the folder's permissions") \
                from None
        raise Qwen35Error(f"{path}: no config.json, so this is not a Hugging Face checkpoint folder "
                          f"(found: {found}); point the loader at the folder that holds config.json and "
                          "model*.safetensors")
    cfg = read_config(cfg_file)
    block = fp8_block_of(cfg, cfg_file)
    try:
        config = from_hf_dict(cfg, str(cfg_file))
    except Qwen35Error:
        raise
    except (TypeError, AttributeError, ValueError, ZeroDivisionError) as e:  # a list where a number goes, a 0...
        raise Qwen35Error(f"{cfg_file}: a setting has the wrong type or value ({type(e).__name__}: {e}); "
                          "re-download config.json") from None
    _check_sizes(config, cfg_file)
    extra = set(generation_eos(path / "generation_config.json")) - set(config.eos_token_ids)
    if extra:
        config = replace(config, eos_token_ids=tuple(sorted(set(config.eos_token_ids) | extra)))
    files = checkpoint_files(path)
    if (path / "model.safetensors.index.json").exists():
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise Qwen35Error(f"{path}: the index lists {_some(absent)}, "
                              f"{'which is' if len(absent) == 1 else 'which are'} missing; the download is "
                              "incomplete: download the missing files again")
    else:
        _check_shard_series(path, files)
    if not files:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found pickle files {', '.join(pickles[:3])}: convert them to safetensors)" if pickles else ""
        raise Qwen35Error(f"{path}: no .safetensors weights{hint}")
    tensors, shapes, other, fp8 = _collect(files, block, quant_method_of(cfg))
    if not _is_qwen35(_all_names(tensors, other)):
        raise _not_qwen35(path, _all_names(tensors, other))
    in_files = 1 + max((int(k.split(".")[1]) for k in shapes if k.split(".")[0] == "layers"
                        and k.split(".")[1].isdigit()), default=-1)
    if config.num_hidden_layers != in_files:
        raise Qwen35Error(f"{cfg_file}: the config has {config.num_hidden_layers} layers but the weights hold "
                          f"{in_files}; the config does not belong to these weights, re-download it")
    if config.tie_word_embeddings and "lm_head.weight" in shapes:
        # the weights hold their own output layer: transformers uses it where it differs from the embedding (and
        # the result is the same where it does not), so it is loaded rather than left unread
        log.info("%s: the config ties the output layer to the embedding, but the weights hold an lm_head.weight: "
                 "it is used", cfg_file)
        config = replace(config, tie_word_embeddings=False)
    check_shapes(config, shapes, path)
    return Checkpoint(path, config, tensors, path if (path / "tokenizer.json").exists() else None, fp8, other)
