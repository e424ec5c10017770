"""RMSNorm over the last dimension (Qwen3.5's zero-centred norm, and the GDN output's gated norm)."""
