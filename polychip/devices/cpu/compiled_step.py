"""The CPU plugin's ``compile()``: a static step recorded once, then replayed in C++.

On its first call a :class:`CompiledStep` runs the step function eagerly under a
``TorchDispatchMode`` that records every operator call (ATen's and the plugin's kernels, which
are torch operators while a step is recorded: ``KernelTable.as_operators``). The record becomes a
``StepProgram`` (``csrc/replay.cpp``): a list of boxed dispatcher calls in which the tensors the
step makes are numbered slots, freed after their last reader, and every other tensor (weights,
KV caches, the static inputs whose values the runner rewrites) is a constant. A replay is one
C++ loop over ~11 calls per layer: no Python frames, module calls or argument parsing.

What makes the record valid for later calls is the contract of ``DevicePlugin.compile``: the
same input tensors every call, static shapes, and no decision on the host that depends on their
values. Views of constants (a cache's flat view) are taken once at capture. A record holding an
operator the replay cannot repeat (a collective, a random draw, a host read of a value) is not
used: the step stays eager and the reason is logged.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("polychip.devices.cpu")

#: operator namespaces a replay may call: ATen's and the CPU kernels'
REPLAYABLE = ("aten", "polychip_cpu")


class NotReplayable(Exception):
    """The recorded step holds something a replay cannot repeat."""


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch.compile runs inside the record, so no dynamo guard around it: the guard would
        import torch._dynamo (seconds of start-up, and of exit) on the first call."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _flat_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _schema_args(func, args, kwargs) -> list:
    """Every schema argument's value, positional ones first, then keywords, then defaults."""
    values = []
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            values.append(args[i])
        elif a.name in kwargs:
            values.append(kwargs[a.name])
        elif a.has_default_value():
            values.append(a.default_value)
        else:
            raise NotReplayable(f"{func}: argument {a.name!r} missing from the record")
    return values


def _is_tensor_type(t) -> bool:
    """Tensor, Tensor? or Tensor[]: what a replay can hand on (anything else goes to the host)."""
    text = str(t)
    return text in ("Tensor", "Optional[Tensor]", "List[Tensor]", "Tensor?", "Tensor[]")


def _shares_storage(out: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    ptr = out.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in inputs)


def build_program(kernels_module, calls: list[tuple], result: torch.Tensor):
    """The ``StepProgram`` of a record; raises NotReplayable when it holds what a replay cannot repeat."""
    slot_of: dict[int, int] = {}        # id(tensor) -> slot, for the tensors the step makes
    entries = []                         # (func, encoded args, output slots, slots read)
    for func, args, kwargs, out in calls:
        if func.namespace not in REPLAYABLE:
            raise NotReplayable(f"{func} is not an operator the replay can call")
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise NotReplayable(f"{func} draws random numbers")
        if any(not _is_tensor_type(r.type) for r in func._schema.returns):
            raise NotReplayable(f"{func} hands a value to the host (.item(), a Python condition on a tensor)")
        values = _schema_args(func, args, kwargs)
        inputs = _flat_tensors(values)
        outs = _flat_tensors(out)
        if func.is_view and not any(id(t) in slot_of for t in inputs) and \
                all(_shares_storage(o, inputs) for o in outs):
            continue    # a view of constants: the captured view stays valid, so it is a constant too
        encoded, reads = [], []
        for v in values:
            tensors = _flat_tensors(v)
            mine = [id(t) in slot_of for t in tensors]
            if isinstance(v, torch.Tensor) and mine[0]:
                encoded.append(("s", slot_of[id(v)]))
                reads.append(slot_of[id(v)])
            elif isinstance(v, (list, tuple)) and any(mine):
                if not all(mine) or len(tensors) != len(v):
                    raise NotReplayable(f"{func}: a list mixing the step's tensors with others")
                encoded.append(("l", [slot_of[id(t)] for t in tensors]))
                reads += [slot_of[id(t)] for t in tensors]
            else:
                encoded.append(("c", v))
        in_ids = {id(t) for t in inputs}
        out_slots = []
        for t in outs:
            if id(t) in in_ids or id(t) in slot_of:   # an in-place op returns its input
                out_slots.append(-1)
            else:
                slot_of[id(t)] = len(slot_of)
                out_slots.append(slot_of[id(t)])
        entries.append((func, encoded, out_slots, reads))
    if id(result) not in slot_of:
        raise NotReplayable("the step's result is not a tensor the step computes")
    last = {}
    for i, (_, _, outs, reads) in enumerate(entries):
        for s in outs:
            if s >= 0:
                last[s] = i
        for s in reads:
            last[s] = i
    keep = slot_of[id(result)]
    release: dict[int, list[int]] = {}
    for s, i in last.items():
        if s != keep:
            release.setdefault(i, []).append(s)
    program = kernels_module.StepProgram(len(slot_of))
    for i, (func, encoded, outs, _) in enumerate(entries):
        program.add(func._schema.name, func._schema.overload_name, encoded, outs, release.get(i, []))
    program.set_results([keep])
    return program


class CompiledStep:
    """``compile(fn)``'s result: the first call records ``fn`` and returns its eager result; later
    calls replay the record. A step that cannot be replayed stays eager (logged once)."""

    def __init__(self, fn: Callable[[], torch.Tensor], kernels, label: str):
        self.fn, self.kernels, self.label = fn, kernels, label
        self.program = None
        self.eager = False      # the record could not be replayed: call fn

    def __call__(self) -> torch.Tensor:
        if self.program is not None:
            return self.program.run()[0]
        if self.eager:
            return self.fn()
        return self._capture()

    def _capture(self) -> torch.Tensor:
        t0 = time.perf_counter()
        recorder = _Recorder()
        with self.kernels.as_operators(), recorder:
            result = self.fn()
        try:
            if not isinstance(result, torch.Tensor):
                raise NotReplayable(f"the step returned {type(result).__name__}, not a tensor")
            program = build_program(self.kernels.module, recorder.calls, result)
            expect = result.clone()
            again = program.run()[0]       # the same inputs again: the replay must reproduce the record
            if not torch.equal(again, expect):
                raise NotReplayable("its replay differs from the eager run on the same inputs")
        except NotReplayable as e:
            log.warning("cpu: %s stays eager: %s", self.label, e)
            self.eager = True
            return result
        self.program = program
        log.debug("cpu: %s recorded as %d operator calls in %.2f s", self.label, len(program),
                  time.perf_counter() - t0)
        return again
