"""Device memory as the engine sees it through a plugin: allocations whose out-of-memory failure
becomes one clear message, and what is left for the KV pool.

Every device allocation the engine and the loader make goes through :func:`alloc` or
:func:`place`: a plugin's :class:`~polychip.errors.DeviceOutOfMemoryError`, a plain
``MemoryError`` or ``torch.OutOfMemoryError`` turns into one DeviceOutOfMemoryError naming the
device, what was being allocated, the request, and what is free (and the largest free block).
"""
from __future__ import annotations

import torch

from polychip.devices import boundary
from polychip.devices.plugin import DevicePlugin
from polychip.devices.spec import fmt_bytes
from polychip.errors import DeviceOutOfMemoryError, PluginValueError, PolychipError

#: what a failed allocation may raise; the engine maps each to one DeviceOutOfMemoryError
OOM_ERRORS = (MemoryError, torch.OutOfMemoryError)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def free_report(plugin) -> str:
    """'81.3 MiB free of 600.0 MiB, largest free block 8.9 MiB' (what the plugin can still tell)."""
    try:
        free, total = boundary.mem_info(plugin)
    except Exception as e:  # the report must not hide the original failure
        why = e.args[0] if isinstance(e, PolychipError) else f"mem_info() raised {type(e).__name__}: {e}"
        return f"free memory unknown ({why})"
    text = f"{fmt_bytes(free)} free of {fmt_bytes(total)}"
    try:
        largest = boundary.largest_free_block(plugin)
    except Exception:  # optional figure; the free bytes were already said
        return text
    return f"{text}, largest free block {fmt_bytes(largest)}" if largest != free else text


def out_of_memory(plugin, what: str, nbytes: int, cause: BaseException) -> DeviceOutOfMemoryError:
    """The one message for a failed device allocation."""
    said = str(cause).removeprefix("[hardware] ").strip()
    err = DeviceOutOfMemoryError(
        f"{plugin.name}:{plugin.index} out of memory allocating {what}: requested {fmt_bytes(nbytes)}; "
        f"{free_report(plugin)}" + (f" (the plugin says: {said})" if said else ""), requested=nbytes)
    err.__cause__ = cause
    return err


def alloc(plugin, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``plugin.alloc`` with an out-of-memory failure mapped to one clear error, and its tensor checked: the
    shape and dtype asked for, or one PluginValueError naming the plugin."""
    try:
        t = plugin.alloc(tuple(shape), dtype)
    except OOM_ERRORS as e:
        raise out_of_memory(plugin, what, nbytes_of(shape, dtype), e) from None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        got = f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise PluginValueError(plugin.name, "alloc", "", f"{got} for {what}",
                               f"a {dtype} tensor of shape {tuple(shape)}")
    return t


def place(plugin, what: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``plugin.place_weight`` with an out-of-memory failure mapped to one clear error."""
    try:
        return plugin.place_weight(tensor, dtype)
    except OOM_ERRORS as e:
        raise out_of_memory(plugin, what, nbytes_of(tuple(tensor.shape), dtype), e) from None


def holds_reserve(plugin) -> bool:
    """Whether the plugin holds the activation reserve itself (it overrides reserve_for_activations)."""
    return type(plugin).reserve_for_activations is not DevicePlugin.reserve_for_activations


def pool_budget(plugin) -> tuple[int, int]:
    """(free bytes, largest allocatable block) left for the KV pool, after the activation reserve:
    excluded by the plugin if it holds the reserve, else subtracted here."""
    free, _total = boundary.mem_info(plugin)
    largest = min(boundary.largest_free_block(plugin), free)
    if not holds_reserve(plugin):
        reserve = getattr(plugin, "activation_reserve", 0)
        free, largest = max(0, free - reserve), max(0, largest - reserve)
    return free, largest
