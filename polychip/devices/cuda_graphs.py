"""CUDA graphs of the decode step: what ``CudaPlugin.compile`` returns.

The model runner calls the compiled step with the same input tensors for a batch-size bucket on
every call (only their values change), so one graph per bucket replays the whole forward with one
launch. The first call of a bucket runs the step once eagerly on a side stream (Triton compiles its
kernels, cuBLAS picks its algorithms: neither may happen inside a capture), then captures it, then
replays it. All graphs share one memory pool; a graph's outputs are overwritten by its next replay.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("polychip.devices.cuda")


def signature(args: tuple) -> tuple:
    """What must stay the same for a replay to be valid: each tensor's address, shape and dtype."""
    return tuple((a.data_ptr(), tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else id(a) for a in args)


class DecodeGraphs:
    """``fn`` captured once per input signature and replayed after that. A step that cannot be
    captured runs eager, and the log says why (it is never silently slow)."""

    def __init__(self, fn: Callable, device: torch.device, label: str = "decode step"):
        self.fn, self.device, self.label = fn, device, label
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any] | None] = {}
        self.pool = None

    def __call__(self, *args):
        key = signature(args)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(args)
            except RuntimeError as e:          # torch leaves capture mode before it raises
                log.warning("%s: no CUDA graph, running eager: %s", self.label, e)
                self.graphs[key] = None
        entry = self.graphs[key]
        if entry is None:
            return self.fn(*args)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, args: tuple):
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.fn(*args)                              # warm-up, outside the capture
        current.wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*args)
        log.info("%s: captured a CUDA graph", self.label)
        return graph, out
