"""CUDA graphs of the decode step: what ``CudaPlugin.compile`` returns.

The model runner calls the compiled step with the same input tensors for a batch-size bucket on
every call (only their values change), so one graph per bucket replays the whole forward with one
launch. The first call of a bucket runs the step once eagerly on a side stream (Triton compiles its
kernels, cuBLAS picks its algorithms: neither may happen inside a capture), then captures it, then
replays it. All of a plugin's graphs share one memory pool (``CudaPlugin.compile``); a graph's
outputs are overwritten by its next replay.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("polychip.devices.cuda")


class DecodeGraph:
    """``fn`` (no arguments: its inputs are static tensors) captured on the first call and replayed
    after that. A step that cannot be captured runs eager, and the log says why."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, pool, label: str = "decode step"):
        self.fn, self.device, self.pool, self.label = fn, device, pool, label
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None
        self.eager = False

    def __call__(self):
        if self.graph is None and not self.eager:
            try:
                self._capture()
            except RuntimeError as e:          # torch leaves capture mode before it raises
                log.warning("%s: no CUDA graph, running eager: %s", self.label, e)
                self.eager = True
        if self.eager:
            return self.fn()
        self.graph.replay()
        return self.out

    def _capture(self) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.fn()                                   # warm-up, outside the capture
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.out = self.fn()
        self.graph = graph
        log.info("%s: captured a CUDA graph", self.label)
