"""The vision tower's kernels: its patch positions (the interpolated position grid and the rotary's angles), its
2-D rotary (q and k from the qkv projection), its LayerNorms, each fused with the residual add before it, and
its attention within each image or video slice."""
from .reference import add_layer_norm_ref, layer_norm_ref, vision_attention_ref, vision_positions_ref, vision_rotary_ref

__all__ = ["add_layer_norm_ref", "layer_norm_ref", "vision_attention_ref", "vision_positions_ref", "vision_rotary_ref"]
