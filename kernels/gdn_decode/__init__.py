from .reference import gdn_decode_step_ref

__all__ = ["gdn_decode_step_ref"]
