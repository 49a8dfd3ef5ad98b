"""The built-in CPU plugin: ``plugin`` (the DevicePlugin), ``memory`` (huge-page host memory),
``kernels`` (builds and loads ``csrc/``), ``ops`` and ``row_ops`` (the float32 ops it registers)."""
from polychip.devices.cpu.plugin import CpuPlugin

__all__ = ["CpuPlugin"]
