"""Plugin layer: the device-plugin API, the op contract and the built-in CPU and CUDA plugins.

What a plugin may import: this package's names (below), ``polychip.devices.plugin``,
``polychip.devices.ops``, ``polychip.devices.spec`` and ``polychip.errors``.
"""
from polychip.devices.plugin import (API_VERSION, Availability, DeviceHealth, DeviceInfo, DevicePlugin, Event, Stream,
                                     api_mismatch, parse_api_version)
from polychip.devices.ops import (ALLOC_DTYPES, CONTRACT_VERSION, FUSIONS, OPS, AttentionMetadata, OpRegistrar,
                                  OpSpec, PrefillSegment, QUANT_OPS, SCHEME_OPS, slot_of)
from polychip.errors import DeviceOutOfMemoryError, PluginError
from polychip.devices.discovery import get_plugin

__all__ = ["API_VERSION", "Availability", "DeviceHealth", "DeviceInfo", "DevicePlugin", "Event", "Stream", "api_mismatch",
           "parse_api_version", "get_plugin", "CONTRACT_VERSION", "OPS", "OpSpec", "FUSIONS", "ALLOC_DTYPES",
           "AttentionMetadata", "PrefillSegment", "OpRegistrar", "QUANT_OPS", "SCHEME_OPS", "slot_of", "DeviceOutOfMemoryError",
           "PluginError"]
