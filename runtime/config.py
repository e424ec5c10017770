"""The text model's configuration: read from config.json or inferred from tensor names and shapes."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Qwen35Error

LINEAR, FULL = "linear_attention", "full_attention"
# Qwen3.5 defaults for what a single .safetensors file cannot tell (all released sizes share them)
DEFAULT_ROPE_THETA = 10_000_000.0
DEFAULT_PARTIAL_ROTARY = 0.25
DEFAULT_MROPE_SECTION = (11, 11, 10)
DEFAULT_MAX_POSITIONS = 262_144
HF_DEFAULT_ROPE_THETA = 10_000.0  # transformers' for a config.json that names no rope_theta (its rope mixin's default)
DEFAULT_HEAD_DIM = 256  # transformers' Qwen3_5TextConfig default (hidden / heads is 128 for the 0.8B, 213 for the 27B)
DEFAULT_EOS = (248044, 248046)  # <|endoftext|>, <|im_end|>
MAX_LAYERS = 1024  # the largest Qwen3.5 has 64


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY
    mrope_section: tuple[int, ...] = DEFAULT_MROPE_SECTION
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = field(default=DEFAULT_EOS)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def from_hf_dict(cfg: dict, source: str = "config.json") -> TextConfig:
    """TextConfig from a Hugging Face config (Qwen3_5Config with text_config, or Qwen3_5TextConfig)."""
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3_5", "qwen3_5_text"):
        raise Qwen35Error(f"{source}: model_type is {model_type!r}, not a Qwen3.5 dense model ('qwen3_5'); "
                          "this node pack loads Qwen3.5 checkpoints only")
    text = cfg.get("text_config", cfg) if model_type == "qwen3_5" else cfg
    try:
        n_layers = text["num_hidden_layers"]
        if type(n_layers) is not int or not 1 <= n_layers <= MAX_LAYERS:  # before anything is sized by it
            raise Qwen35Error(f"{source}: num_hidden_layers is {n_layers!r}; Qwen3.5 models have 1 to "
                              f"{MAX_LAYERS} layers. Re-download config.json")
        layer_types = text.get("layer_types") or [
            LINEAR if (i + 1) % text.get("full_attention_interval", 4) else FULL for i in range(n_layers)]
        if len(layer_types) != n_layers:  # (transformers refuses it too; the loader would count layer_types)
            raise Qwen35Error(f"{source}: num_hidden_layers is {n_layers} but layer_types lists {len(layer_types)} "
                              "layers; they must agree. Re-download config.json, or fix the one that was edited")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in ("default", "mrope"):  # (mrope: Qwen2-VL's name for the plain one)
            raise Qwen35Error(f"{source}: rope_type is {kind!r}: a scaled rotary (as for contexts past 262,144 "
                              "tokens) changes every answer and is not implemented here, so it is not loaded as the "
                              "plain one. Set rope_type to \"default\" (and remove factor / "
                              "original_max_position_embeddings) in the config's rope_parameters")
        eos = text.get("eos_token_id", cfg.get("eos_token_id"))
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return TextConfig(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            layer_types=tuple(layer_types),
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim", DEFAULT_HEAD_DIM),  # (as transformers: not hidden / heads)
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", HF_DEFAULT_ROPE_THETA)),
            partial_rotary_factor=rope.get("partial_rotary_factor",
                                           text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)),
            mrope_section=tuple(rope.get("mrope_section", DEFAULT_MROPE_SECTION)),
            max_position_embeddings=text.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            tie_word_embeddings=bool(tie),
            eos_token_ids=tuple(sorted(set(eos) | set(DEFAULT_EOS))),
        )
    except KeyError as e:
        raise Qwen35Error(f"{source}: the Qwen3.5 configuration lacks {e.args[0]!r}; "
                          "the file looks incomplete, re-download the checkpoint's config.json") from None


UNTIED_WIDTHS = {4096: "9B", 5120: "27B"}  # the released sizes whose lm_head is not the embedding (0.8B to 4B tie them)


def infer_from_shapes(shapes: dict[str, tuple[int, ...]], source: str) -> TextConfig:
    """TextConfig from text-model tensor shapes keyed without prefix ('layers.0.linear_attn.A_log', ...)."""
    def shape(name):
        if name not in shapes:
            raise Qwen35Error(f"{source}: tensor {name!r} is missing, so the Qwen3.5 configuration cannot be "
                              "inferred; the file is not a complete Qwen3.5 text model")
        return shapes[name]

    vocab, hidden = shape("embed_tokens.weight")
    if hidden in UNTIED_WIDTHS and "lm_head.weight" not in shapes:
        raise Qwen35Error(f"{source}: a {hidden}-wide Qwen3.5 model ({UNTIED_WIDTHS[hidden]}) without lm_head.weight: "
                          "that size has an output layer of its own, so this file holds only the part that reads "
                          "text (a text-encoder export) and cannot write any; load the full checkpoint")
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    layer_types = []
    for i in range(n_layers):
        if f"layers.{i}.linear_attn.A_log" in shapes:
            layer_types.append(LINEAR)
        elif f"layers.{i}.self_attn.q_proj.weight" in shapes:
            layer_types.append(FULL)
        else:
            raise Qwen35Error(f"{source}: layer {i} has neither linear_attn nor self_attn weights (the file is cut "
                              "short or was saved without them); re-download it")
    lin = next(i for i, t in enumerate(layer_types) if t == LINEAR)
    full = next(i for i, t in enumerate(layer_types) if t == FULL)
    head_dim = shape(f"layers.{full}.self_attn.q_norm.weight")[0]
    n_heads = shape(f"layers.{full}.self_attn.q_proj.weight")[0] // (2 * head_dim)
    n_kv = shape(f"layers.{full}.self_attn.k_proj.weight")[0] // head_dim
    hv = shape(f"layers.{lin}.linear_attn.A_log")[0]
    dv = shape(f"layers.{lin}.linear_attn.norm.weight")[0]
    conv_dim, _, width = shape(f"layers.{lin}.linear_attn.conv1d.weight")
    dk = dv  # every Qwen3.5 size uses 128 for both; the key head count follows from the conv width
    key_dim = (conv_dim - hv * dv) // 2
    return TextConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=shape("layers.0.mlp.gate_proj.weight")[0],
        layer_types=tuple(layer_types), num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=head_dim, linear_num_key_heads=key_dim // dk, linear_num_value_heads=hv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=width,
        tie_word_embeddings="lm_head.weight" not in shapes,
    )


def expected_shapes(c: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor (names without prefix) and its shape."""
    h = c.hidden_size
    out = {"embed_tokens.weight": (c.vocab_size, h), "norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i, t in enumerate(c.layer_types):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                    p + "mlp.up_proj.weight": (c.intermediate_size, h),
                    p + "mlp.down_proj.weight": (h, c.intermediate_size)})
        if t == LINEAR:
            a = p + "linear_attn."
            hv = c.linear_num_value_heads
            out.update({a + "in_proj_qkv.weight": (c.conv_dim, h), a + "in_proj_z.weight": (c.value_dim, h),
                        a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                        a + "conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
                        a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (c.linear_value_head_dim,),
                        a + "out_proj.weight": (h, c.value_dim)})
        else:
            s = p + "self_attn."
            qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            out.update({s + "q_proj.weight": (2 * qd, h), s + "k_proj.weight": (kd, h),
                        s + "v_proj.weight": (kd, h), s + "o_proj.weight": (h, qd),
                        s + "q_norm.weight": (c.head_dim,), s + "k_norm.weight": (c.head_dim,)})
    return out


def describe(c: TextConfig) -> str:
    n_lin = sum(t == LINEAR for t in c.layer_types)
    return (f"{c.num_hidden_layers} layers ({n_lin} GDN, {c.num_hidden_layers - n_lin} attention), "
            f"hidden {c.hidden_size}, GDN heads {c.linear_num_key_heads}/{c.linear_num_value_heads}, "
            f"attention heads {c.num_attention_heads}/{c.num_key_value_heads}x{c.head_dim}")


__all__ = ["TextConfig", "from_hf_dict", "infer_from_shapes", "expected_shapes", "describe", "LINEAR", "FULL"]
