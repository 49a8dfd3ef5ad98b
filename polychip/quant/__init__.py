"""Weight quantisation as a rewrite of the model (beside models/ and ops/; imports ops only)."""
from polychip.quant.int8 import QUANTIZATIONS, Int8Linear, quantize_int8

__all__ = ["QUANTIZATIONS", "Int8Linear", "quantize_int8"]
