"""Plugin layer: the device-plugin API, the op contract and the built-in CPU and CUDA plugins."""
from polychip.devices.plugin import API_VERSION, Availability, DeviceInfo, DevicePlugin, Event, Stream
from polychip.devices.ops import FUSIONS, OPS, AttentionMetadata, OpRegistrar, PrefillSegment
from polychip.devices.discovery import get_plugin

__all__ = ["API_VERSION", "Availability", "DeviceInfo", "DevicePlugin", "Event", "Stream", "get_plugin",
           "OPS", "FUSIONS", "AttentionMetadata", "PrefillSegment", "OpRegistrar"]
