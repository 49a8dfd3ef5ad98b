"""rowchip: a plugin written from docs/plugin-guide.md for API 1.1 as released (commit 7c2bad0,
where ``DeviceInfo.topology`` was a free dict, "e.g. {"p2p_enabled": False}").

Four cards on a ring in host memory (1 GiB each), no P2P. The vendor reports each card's distances
as its row of the matrix the spec YAML writes (``topology.distance``): ``[0, 1, 2, 1]`` for card 0.
It reports its software stack through ``versions()`` (1.1). FROZEN: see tests/compat/README.md.
"""
import torch
import torch.nn.functional as F

from polychip.devices import Availability, DeviceInfo, DevicePlugin, Event, Stream
from polychip.errors import DeviceOutOfMemoryError, PluginError

CARDS = 4
CAPACITY = 2**30


class RowStream(Stream):
    def synchronize(self):
        pass


class RowEvent(Event):
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def silu_mul(gate, up):
    return F.silu(gate) * up


class RowChipPlugin(DevicePlugin):
    name = "rowchip"
    api_version = "1.1"
    plugin_version = "2.3.0"
    torch_device_type = "cpu"
    default_mem_fraction = 0.2
    priority = 5

    def __init__(self):
        super().__init__()
        self.used = 0
        self.sizes = {}

    def is_available(self):
        return Availability(True)

    def discover(self):
        return [DeviceInfo(index=i, name="RowChip-1G", total_memory=CAPACITY, free_memory=CAPACITY,
                           dtypes=("float32", "bfloat16"), compute={"tflops_fp32": 1.0, "tflops_bf16": 4.0},
                           topology={"p2p_enabled": False,
                                     "distance": [min((i - j) % CARDS, (j - i) % CARDS) for j in range(CARDS)]})
                for i in range(CARDS)]

    def device_handle(self, index=None):
        return torch.device("cpu")

    def alloc(self, shape, dtype):
        if dtype == torch.float16:
            raise PluginError("rowchip has no float16")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self.used + nbytes > CAPACITY:
            raise DeviceOutOfMemoryError(f"rowchip:{self.index}: {nbytes} bytes requested, "
                                         f"{CAPACITY - self.used} free", requested=nbytes)
        t = torch.empty(shape, dtype=dtype)
        self.used += nbytes
        self.sizes[t.data_ptr()] = nbytes
        return t

    def free(self, tensor):
        self.used -= self.sizes.pop(tensor.data_ptr(), 0)

    def mem_info(self):
        return CAPACITY - self.used, CAPACITY

    def synchronize(self):
        pass

    def stream(self):
        return RowStream()

    def event(self):
        return RowEvent()

    def register_ops(self, registry):
        registry.register("silu_mul", 1, "float32", silu_mul)
        registry.register_unavailable("attention", "rowchip's attention kernel ships in 2.4")

    def versions(self):
        return {"driver": "rowchip-drv 5.1", "runtime": "ringrt 2.3", "firmware": "rfw 7"}
