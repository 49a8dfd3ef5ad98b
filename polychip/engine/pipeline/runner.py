"""A stage's model runner: the step inputs of every micro-batch, this stage's layers, and the links.

Every stage packs the step's inputs (token ids, positions, KV slots, page tables) into its own
step-input buffers, as one device does (engine/model_runner.py), and runs its run of layers on the
hidden states the previous stage sent. Stage 0 (:class:`FirstStageRunner`) embeds the tokens
first, sends micro-batches on (``launch``) and, when the last stage returns the rows to sample,
turns them into logits (``land``). The static decode path is not used: every stage runs eager.
"""
from __future__ import annotations

import time

import torch

from polychip.distributed.stage_links import STOP, StageLinks
from polychip.engine import step_wire
from polychip.engine.model_runner import Batch, ModelRunner, StepLimits
from polychip.errors import IntegrityError
from polychip.models import stage as stage_model
from polychip.models.decoder import ForwardContext
from polychip.models.stage import StageSpan


class StageRunner(ModelRunner):
    def __init__(self, model, plugin, limits: StepLimits, links: StageLinks, span: StageSpan):
        super().__init__(model, plugin, limits, static_max_bs=0)
        self.links, self.span = links, span
        self.weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        self.busy_seconds = 0.0          # time spent computing (not waiting for a neighbour)
        self.micro_batches = 0
        self.last_seconds = 0.0

    def status(self) -> dict:
        """What /server_info and /metrics show of this stage."""
        return {"stage": self.span.index, "layers": [self.span.start, self.span.end], "weight_bytes": self.weight_bytes,
                "busy_seconds": self.busy_seconds, "micro_batches": self.micro_batches,
                "step_seconds": self.busy_seconds / self.micro_batches if self.micro_batches else 0.0,
                "last_step_seconds": self.last_seconds}

    @torch.inference_mode()
    def forward(self, batch: Batch, payload: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers on one micro-batch: from its tokens (stage 0) or the previous stage's
        ``payload`` ([2, tokens, hidden]: hidden states and residual)."""
        t0 = time.perf_counter()
        self.plugin.wait_event(batch.inputs.copied)
        ctx = ForwardContext(batch.meta, self.kv_caches, self.kv_scales)
        if payload is None:
            h, residual = stage_model.embed(self.model, batch.input_ids), None
        else:
            h, residual = payload[0], payload[1]
        out = stage_model.run_layers(self.model, h, residual, batch.positions, ctx)
        batch.inputs.consumed.record()
        self._count(time.perf_counter() - t0)
        return out

    def _count(self, seconds: float) -> None:
        self.busy_seconds += seconds
        self.last_seconds = seconds
        self.micro_batches += 1

    def serve(self, on_step=None) -> int:
        """A stage past 0: run every micro-batch the previous stage sends until the stop message;
        returns how many ran. The last stage sends back only the rows to sample."""
        steps = 0
        while True:
            msg = self.links.recv()
            if msg.kind == STOP:
                if not self.span.last:
                    self.links.send_stop()
                self.links.flush()
                return steps
            batch = self.to_device(step_wire.decode(msg.ints))
            h, residual = self.forward(batch, msg.payload)
            if self.span.last:
                rows = batch.sample_rows
                self.links.send(msg.seq, h[rows], residual[rows])
            else:
                self.links.send(msg.seq, h, residual, msg.ints)
            steps += 1
            if on_step is not None:
                on_step()


class FirstStageRunner(StageRunner):
    """Stage 0, in the engine's process: launches micro-batches and lands them as logits."""

    def launch(self, batch: Batch, seq: int) -> None:
        h, residual = self.forward(batch, None)
        self.links.send(seq, h, residual, step_wire.encode(batch.host))

    @torch.inference_mode()
    def land(self, seq: int, rows: int, timeout_s: float) -> torch.Tensor | None:
        """The logits of micro-batch ``seq``'s ``rows`` sampled rows, once the last stage returns them
        (None when it samples none: a prefill chunk before the prompt's end)."""
        msg = self.links.recv(timeout_s)
        if msg.kind == STOP or msg.seq != seq or msg.payload.shape[1] != rows:
            got = "stop" if msg.kind == STOP else f"micro-batch {msg.seq} with {msg.payload.shape[1]} rows"
            raise IntegrityError(f"the last stage returned {got}; stage 0 waits for micro-batch {seq} with "
                                 f"{rows} rows")
        if rows == 0:
            return None
        t0 = time.perf_counter()
        logits = stage_model.head(self.model, msg.payload[0], msg.payload[1])
        self.busy_seconds += time.perf_counter() - t0
        return logits
