"""The vision tower's elementwise work: its 2-D rotary (q and k from the qkv projection) and its LayerNorms,
each fused with the residual add before it."""
from .reference import add_layer_norm_ref, layer_norm_ref, vision_rotary_ref

__all__ = ["add_layer_norm_ref", "layer_norm_ref", "vision_rotary_ref"]
