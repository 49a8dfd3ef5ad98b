"""A test plugin whose "vendor library" registers its own torch.distributed backend, the way a chip
vendor's collective library (XCCL, HCCL) plugs into polychip's tensor parallelism.

The library here is gloo under another name: what matters is the path, not the transport.
"""
from __future__ import annotations

import torch.distributed as dist

from polychip.devices.cpu import CpuPlugin

BACKEND = "vendorccl"


def _create_process_group(store, rank, size, timeout):
    """What a vendor library's creator returns: a ProcessGroup backend for (store, rank, size)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# at import of the plugin module, so every worker process that discovers the plugin has it
if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create_process_group, devices=["cpu"])


class VendorChipPlugin(CpuPlugin):
    name = "vendorchip"
    plugin_version = "0.1"

    def communicator_backend(self) -> str:
        return BACKEND


class UnknownBackendPlugin(CpuPlugin):
    name = "nobackendchip"
    plugin_version = "0.1"

    def communicator_backend(self) -> str:
        return "nosuchccl"
