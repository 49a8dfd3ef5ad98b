"""memchip: a plugin written from docs/plugin-guide.md for API 1.1 as released (commit 7c2bad0), using
what 1.1 added to the memory contract: it holds the activation reserve itself
(``reserve_for_activations``, excluded from ``mem_info``), reports its ``largest_free_block`` (a card
cut into 64 MiB banks), keeps the KV pool in bfloat16 for float32 models (``kv_cache_dtypes``) and
names a version matrix. One card of 768 MiB in host memory. FROZEN: see tests/compat/README.md.
"""
import torch

from polychip.devices import Availability, DeviceInfo, DevicePlugin, Event, Stream
from polychip.errors import DeviceOutOfMemoryError

CAPACITY = 768 * 2**20
BANK = 64 * 2**20          # fragmentation: the largest free block is the free memory in whole 64 MiB banks


class MemStream(Stream):
    def synchronize(self):
        pass


class MemEvent(Event):
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class MemChipPlugin(DevicePlugin):
    name = "memchip"
    api_version = "1.1"
    plugin_version = "0.9.1"
    torch_device_type = "cpu"
    default_mem_fraction = 0.3

    def __init__(self):
        super().__init__()
        self.used = 0
        self.reserved = 0
        self.sizes = {}

    def is_available(self):
        return Availability(True)

    def discover(self):
        return [DeviceInfo(index=0, name="MemChip-768M", total_memory=CAPACITY, free_memory=CAPACITY - self.used,
                           dtypes=("float32", "bfloat16"), compute={"tflops_fp32": 0.8})]

    def device_handle(self, index=None):
        return torch.device("cpu")

    def alloc(self, shape, dtype):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        free = self.mem_info()[0]
        if nbytes > free:
            raise DeviceOutOfMemoryError(f"memchip: {nbytes} bytes requested, {free} free", requested=nbytes)
        t = torch.empty(shape, dtype=dtype)
        self.used += nbytes
        self.sizes[t.data_ptr()] = nbytes
        return t

    def free(self, tensor):
        self.used -= self.sizes.pop(tensor.data_ptr(), 0)

    def mem_info(self):
        return max(0, CAPACITY - self.used - self.reserved), CAPACITY

    def largest_free_block(self):
        free = self.mem_info()[0]
        return free - free % BANK if free >= BANK else free

    def reserve_for_activations(self, nbytes):
        self.reserved = max(0, int(nbytes))
        self.activation_reserve = self.reserved
        return self.reserved

    def kv_cache_dtypes(self, compute_dtype):
        return (compute_dtype, "bfloat16")

    def synchronize(self):
        pass

    def stream(self):
        return MemStream()

    def event(self):
        return MemEvent()

    def versions(self):
        return {"driver": "memchip 3.0.2", "runtime": "memrt 1.1"}
