"""Ops layer: named operators, their registry and the model rewrite passes."""
from polychip.ops.registry import OpRegistry, Resolution

__all__ = ["OpRegistry", "Resolution"]
