"""Typed errors. Each names its cause and the layer it came from."""
from __future__ import annotations

FRAMEWORK, PLUGIN, HARDWARE = "framework", "plugin", "hardware"


class PolychipError(Exception):
    """Base error: ``layer`` says where it came from (framework, plugin, hardware)."""

    layer = FRAMEWORK

    def __init__(self, message: str, *, layer: str | None = None):
        super().__init__(message)
        if layer is not None:
            self.layer = layer

    def __str__(self) -> str:
        return f"[{self.layer}] {super().__str__()}"


class ConfigError(PolychipError, ValueError):
    """An engine or CLI setting is invalid."""


class InvalidRequestError(PolychipError, ValueError):
    """A request (prompt or sampling params) cannot be served as asked."""


class ModelLoadError(PolychipError):
    """Weights, config or tokenizer cannot be loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one polychip implements."""


class PluginError(PolychipError):
    """A device plugin failed to load, initialise or run."""

    layer = PLUGIN


class DeviceSpecError(PolychipError, ValueError):
    """A device spec (YAML) file is missing, malformed or inconsistent."""


class OutOfPagesError(PolychipError):
    """The KV pool has no free page left (handled by preemption inside the engine)."""


class IntegrityError(PolychipError):
    """The page allocator or the prefix cache broke one of its own invariants (a framework bug)."""
