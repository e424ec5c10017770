"""Paged attention over the K/V block pool (runtime/kv_pool.py documents the block table): prefill (new
tokens causal over themselves and the cached prefix) and decode (1..16 tokens, keys split across blocks),
the new K/V stored in the pool in the same launch, Qwen3.5's sigmoid output gate fused."""
from .reference import gather_kv, paged_attention_ref, write_kv_ref

__all__ = ["gather_kv", "paged_attention_ref", "write_kv_ref"]
