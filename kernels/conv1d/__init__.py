from .reference import causal_conv1d_prefill_ref, causal_conv1d_update_ref

__all__ = ["causal_conv1d_prefill_ref", "causal_conv1d_update_ref"]
