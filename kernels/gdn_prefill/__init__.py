from .reference import gate_and_beta, gdn_prefill_chunked, gdn_prefill_recurrent_f64, l2norm

__all__ = ["gdn_prefill_chunked", "gdn_prefill_recurrent_f64", "gate_and_beta", "l2norm"]
