"""Whether torch has a kernel for an op on a device type (the native ops pick torch's fast paths by it)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def has_kernel(op: str, device_type: str) -> bool:
    """Whether torch has a kernel for ``op`` on ``device_type``: a memo of torch's dispatch table
    (~9 us a query). A kernel registered later is seen after a restart; until then the
    dequantising path computes the same numbers."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, device_type.upper())
    except RuntimeError:    # not a dispatch key name torch knows
        return False
