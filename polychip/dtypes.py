"""The dtype vocabulary: every dtype name polychip knows, in one leaf module (imports nothing).

Names are torch's attribute names (``getattr(torch, name)``), except ``int4``, which torch has no
dtype for and which a device spec may still declare.
"""
from __future__ import annotations

FLOAT_DTYPES = ("float32", "bfloat16", "float16")            # compute dtypes a model may run in
MODEL_DTYPES = ("auto",) + FLOAT_DTYPES                       # what --dtype accepts
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
KNOWN_DTYPES = FLOAT_DTYPES + ("int8", "int4") + FP8_DTYPES   # what a spec may declare
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                 "float": "float32", "fp8": "float8_e4m3fn"}
#: --quantization (polychip/quant): each scheme -> the dtype its stored weights need the device to declare
#: (a spec's supported_dtypes); the router checks replicas against it without importing torch
QUANTIZATION_DTYPES = {"int8": "int8", "w8a8": "int8", "w8a16": "int8", "w4a16": "int4",
                       "fp8": "float8_e4m3fn", "fp8_block": "float8_e4m3fn"}


def quantization_dtype(scheme: str | None) -> str | None:
    """The device dtype a quantisation scheme needs (None for none)."""
    return QUANTIZATION_DTYPES.get(scheme, scheme) if scheme else None


#: --disaggregation-wire-dtype -> the torch dtype a prefill/decode hand-off quantises the KV to on the wire
#: (a float32 scale per token and head; engine/disagg/wire_quant); "auto" moves the pools' own dtypes.
KV_WIRE_DTYPES = {"auto": None, "int8": "int8", "fp8_e4m3": "float8_e4m3fn"}

#: --kv-cache-dtype (vLLM's and SGLang's names) -> the torch dtype name the KV pool is stored in;
#: "auto" is the model's compute dtype. Every float and fp8 dtype a plugin may declare in
#: ``kv_cache_dtypes`` has a name here (the torch names are accepted too), so each is selectable.
KV_CACHE_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                   "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                   "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
