"""hostchip: a plugin written against plugin API 1.0 as released: polychip/devices/plugin.py and the
README's "A new chip is one package" paragraph at commit b012180, the last with API_VERSION = 1
(there was no docs/plugin-guide.md yet).

Two cards in host memory with a 512 MiB budget each; its own rms_norm and silu_mul; everything
else falls back to native. It declares ``api_version = 1`` (an int, as 1.0 did) and implements
only what 1.0 asked. FROZEN: see tests/compat/README.md.
"""
import torch
import torch.nn.functional as F

from polychip.devices.plugin import Availability, DeviceInfo, DevicePlugin, Event, Stream
from polychip.errors import PluginError

CARDS = 2
CAPACITY = 512 * 2**20


class HostStream(Stream):
    def synchronize(self):
        pass


class HostEvent(Event):
    def __init__(self):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        pass

    def query(self):
        return True


def rms_norm(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate, up):
    return F.silu(gate) * up


class HostChipPlugin(DevicePlugin):
    name = "hostchip"
    api_version = 1
    plugin_version = "1.0.0"
    torch_device_type = "cpu"
    default_mem_fraction = 0.2

    def __init__(self):
        super().__init__()
        self.used = 0
        self.sizes = {}

    def is_available(self):
        return Availability(True)

    def discover(self):
        return [DeviceInfo(index=i, name="HostChip-512M", total_memory=CAPACITY, free_memory=CAPACITY - self.used,
                           dtypes=("float32", "bfloat16"), compute={"tflops_fp32": 0.5},
                           topology={"p2p_enabled": False})
                for i in range(CARDS)]

    def device_handle(self, index=None):
        return torch.device("cpu")

    def alloc(self, shape, dtype):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self.used + nbytes > CAPACITY:
            raise MemoryError(f"hostchip: {nbytes} bytes requested, {CAPACITY - self.used} free")
        t = torch.empty(shape, dtype=dtype)
        self.used += nbytes
        self.sizes[t.data_ptr()] = nbytes
        return t

    def free(self, tensor):
        nbytes = self.sizes.pop(tensor.data_ptr(), None)
        if nbytes is None and tensor.numel():
            raise PluginError("hostchip: free() of a tensor it did not allocate")
        self.used -= nbytes or 0

    def mem_info(self):
        return CAPACITY - self.used, CAPACITY

    def synchronize(self):
        pass

    def stream(self):
        return HostStream()

    def event(self):
        return HostEvent()

    def register_ops(self, registry):
        for dtype in ("float32", "bfloat16"):
            registry.register("rms_norm", 1, dtype, rms_norm)
            registry.register("silu_mul", 1, dtype, silu_mul)
