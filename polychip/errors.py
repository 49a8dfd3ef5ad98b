"""Typed errors. Each names its cause and the layer it came from."""
from __future__ import annotations

FRAMEWORK, PLUGIN, HARDWARE, CONFIG = "framework", "plugin", "hardware", "config"


class PolychipError(Exception):
    """Base error: ``layer`` says where it came from (framework, plugin, hardware, config: the
    user's settings or files)."""

    layer = FRAMEWORK

    def __init__(self, message: str, *, layer: str | None = None):
        super().__init__(message)
        if layer is not None:
            self.layer = layer

    def __str__(self) -> str:
        return f"[{self.layer}] {super().__str__()}"


class ConfigError(PolychipError, ValueError):
    """An engine or CLI setting is invalid."""

    layer = CONFIG


class InvalidRequestError(PolychipError, ValueError):
    """A request (prompt or sampling params) cannot be served as asked."""


class ModelLoadError(PolychipError):
    """Weights, config or tokenizer cannot be loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one polychip implements."""


class PluginError(PolychipError):
    """A device plugin failed to load, initialise or run."""

    layer = PLUGIN


class DeviceOutOfMemoryError(PluginError, MemoryError):
    """A device cannot satisfy an allocation. Plugins raise it from ``alloc`` (a plain ``MemoryError``
    or ``torch.OutOfMemoryError`` is taken as the same); the engine re-raises it as one message
    naming the device, what it was allocating, the request and what is free. Layer: hardware."""

    layer = HARDWARE

    def __init__(self, message: str, *, layer: str | None = None, requested: int | None = None):
        super().__init__(message, layer=layer)
        self.requested = requested


class DeviceSpecError(PolychipError, ValueError):
    """A device spec (YAML) file is missing, malformed or inconsistent: the user's file, so layer config."""

    layer = CONFIG


class OutOfPagesError(PolychipError):
    """The KV pool has no free page left (handled by preemption inside the engine)."""


class IntegrityError(PolychipError):
    """The page allocator or the prefix cache broke one of its own invariants (a framework bug)."""


class KVTransferError(PolychipError):
    """A KV hand-off between a prefill and a decode engine failed: the message names both sides and
    the phase (handshake, reserve, send, ack)."""


class KVMismatchError(KVTransferError):
    """The two sides of a KV hand-off cannot work together (another model, tokenizer or layer count);
    refused at the handshake, before any byte moves."""
