"""``polychip probe``: walk a device spec through discovery step by step, before serving.

:func:`run_probe` yields one :class:`Step` as each finishes, so the command prints as it goes.
The set-up steps (parse .. init) stop the probe when they fail; the checks after them all run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from polychip.devices import boundary
from polychip.devices.discovery import candidates, init_plugin, select
from polychip.devices.spec import check_against_devices, fmt_bytes, from_dict, read_yaml
from polychip.errors import PolychipError
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry
from polychip.pluginkit.numerics import check_registered_ops

LEAK_SLACK = 0.01     # of total memory: host free memory moves under us on the CPU


@dataclass
class Step:
    name: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0


class StepFailed(Exception):
    def __init__(self, summary: str, details: list[str] | None = None):
        super().__init__(summary)
        self.summary, self.details = summary, details or []


def _run(name: str, fn: Callable[[], tuple[str, list[str]]]) -> Step:
    t0 = time.perf_counter()
    try:
        summary, details = fn()
        ok = True
    except StepFailed as e:
        ok, summary, details = False, e.summary, e.details
    except PolychipError as e:
        ok, summary, details = False, str(e), []
    except Exception as e:  # a plugin may raise anything; it is the probe's job to say so
        ok, summary, details = False, f"{type(e).__name__}: {e}", []
    return Step(name, ok, summary, details, time.perf_counter() - t0)


def _torch_dtype(name: str):
    return None if name == "int4" else getattr(torch, name)


def _random(shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _each(devices: list, check: Callable) -> list[str]:
    """Run a per-device check on every device; fail with every device's problem."""
    details, problems = [], []
    for p in devices:
        try:
            details += check(p)
        except StepFailed as e:
            details += e.details
            problems.append(e.summary)
    if problems:
        raise StepFailed("; ".join(problems), details)
    return details


def check_alloc_free(p) -> list[str]:
    """Allocate and free the KV pool's size (the default fraction of free memory)."""
    free0, total = boundary.mem_info(p)
    nbytes = max(1, int(free0 * p.default_mem_fraction))
    t = p.alloc((nbytes,), torch.uint8)
    free1, _ = boundary.mem_info(p)
    p.free(t)
    del t
    free2, _ = boundary.mem_info(p)
    line = (f"{p.name}:{p.index}: pool {fmt_bytes(nbytes)}; free {fmt_bytes(free0)} -> {fmt_bytes(free1)} "
            f"after alloc -> {fmt_bytes(free2)} after free")
    if free2 < free0 - LEAK_SLACK * total:
        raise StepFailed(f"{p.name}:{p.index}: {fmt_bytes(free0 - free2)} not returned after free", [line])
    return [line]


def check_copy(p, dtypes: tuple[str, ...]) -> list[str]:
    """Host -> device -> host in every dtype, the way back non-blocking, must be bit-exact."""
    details, bad = [], []
    for name in dtypes:
        dtype = _torch_dtype(name)
        if dtype is None:
            details.append(f"{p.name}:{p.index} {name}: no torch dtype, skipped")
            continue
        host = _random((64, 33), dtype)
        dev = p.alloc(tuple(host.shape), dtype)
        p.copy(dev, host)
        back = torch.empty_like(host)
        p.copy(back, dev, non_blocking=True)
        p.synchronize()
        same = torch.equal(back.view(torch.uint8), host.view(torch.uint8))
        p.free(dev)
        details.append(f"{p.name}:{p.index} {name}: host -> device -> host {'equal' if same else 'DIFFERS'}")
        if not same:
            bad.append(name)
    if bad:
        raise StepFailed(f"{p.name}:{p.index}: round trip changed the data in {bad}", details)
    return details


def check_stream_event(p) -> list[str]:
    """Record an event after work on a stream; synchronising the event must complete it."""
    stream, event = p.stream(), p.event()
    host = _random((256,), torch.float32)
    dev = p.alloc((256,), torch.float32)
    with stream:
        p.copy(dev, host, non_blocking=True)
        event.record(stream)
    event.synchronize()
    if not event.query():
        raise StepFailed(f"{p.name}:{p.index}: event.query() is False after event.synchronize()")
    stream.synchronize()
    p.synchronize()
    p.free(dev)
    return [f"{p.name}:{p.index}: {type(stream).__name__} / {type(event).__name__}: record, synchronize, query ok"]


def check_ops(p, dtypes: tuple[str, ...]) -> tuple[list, object]:
    """Every op the plugin registers against the native reference; returns (checks, registry)."""
    registry = OpRegistry(p.name)
    register_native(registry)
    p.register_ops(registry)
    return check_registered_ops(registry, dtypes, p.to_device, lambda d: boundary.kv_cache_dtypes(p, d)), registry



class _Probe:
    def __init__(self, path: str, plugins: tuple[str, ...]):
        self.path, self.plugins = path, plugins
        self.data = self.spec = self.record = None
        self.devices: list = []   # one initialised plugin instance per declared device

    def parse(self):
        self.data = read_yaml(self.path)
        keys = sorted(self.data) if isinstance(self.data, dict) else type(self.data).__name__
        return f"{self.path}: YAML read", [f"top-level keys: {keys}"]

    def validate(self):
        s = self.spec = from_dict(self.data, self.path)
        mem = f"{fmt_bytes(s.memory.total)} each"
        if s.memory.high_bandwidth is not None:
            mem += f" ({fmt_bytes(s.memory.high_bandwidth)} HBM + {fmt_bytes(s.memory.system)} system)"
        return f"{s.device_type}: {s.num_devices} device(s), {mem}", [
            f"device_ids: {s.device_ids}", f"supported_dtypes: {s.supported_dtypes}",
            f"compute: {s.compute}", f"topology: {s.topology.model_dump()}",
            f"custom_attributes: {s.custom_attributes}"]

    def plugin_load(self):
        rec, _ = select(candidates(self.plugins), self.spec.device_type)
        self.record = rec
        p = rec.plugin
        return (f"{p.name} {p.plugin_version} (API {p.api_version}) from {rec.source}",
                [f"torch device type: {p.torch_device_type}", f"collectives: {p.communicator_backend()}",
                 f"fusions: {list(boundary.fusions(p))}"])

    def device_check(self):
        infos = boundary.devices(self.record.plugin, self.spec, for_spec=True)
        check_against_devices(self.spec, self.record.plugin.name, infos)
        declared = [i for i in infos if i.index in self.spec.device_ids]
        return f"the declared devices are among the {len(infos)} that {self.record.plugin.name} reports", [
            f"[{i.index}] {i.name}: {fmt_bytes(i.total_memory)}, dtypes {list(i.dtypes)}" for i in declared]

    def init(self):
        cls = type(self.record.plugin)
        for dev in self.spec.device_ids:
            self.devices.append(init_plugin(cls(), self.spec, dev))
        details = []
        for p in self.devices:
            free, total = boundary.mem_info(p)
            details.append(f"{p.name}:{p.index}: {fmt_bytes(free)} free of {fmt_bytes(total)}")
        return f"{len(self.devices)} device(s) initialised", details

    def alloc_free(self):
        return "alloc and free of the KV pool size", _each(self.devices, check_alloc_free)

    def copy(self):
        dtypes = tuple(self.spec.supported_dtypes)
        return "host -> device -> host round trip exact", _each(self.devices, lambda p: check_copy(p, dtypes))

    def stream_event(self):
        return "stream and event synchronisation", _each(self.devices, check_stream_event)

    def ops(self):
        checks, registry = check_ops(self.devices[0], tuple(self.spec.supported_dtypes))
        details = [("ok   " if c.status == "pass" else f"{c.status.upper():<5}") + c.line() for c in checks]
        bad = [c for c in checks if not c.ok]
        if bad:
            raise StepFailed(f"{len(bad)} of {len(checks)} op checks disagree with native: " +
                             "; ".join(c.line() for c in bad), details)
        mine = {k[0] for k in registry.plugin_ops()}
        details.append(f"no plugin implementation, native in every dtype: "
                       f"{[n for n, _ in registry.native_ops() if n not in mine]}")
        details += [f"unavailable on this device: {n}: {why}" for n, why in registry.unavailable().items()]
        return f"{len(checks)} registered op(s) match the native reference", details

    def collective(self):
        from polychip.distributed.collective_check import run_collective_check
        res = run_collective_check(self.spec.device_type, self.spec.device_ids, self.plugins, self.path)
        if not res.ok:
            raise StepFailed("collective check failed: " + "; ".join(res.lines), res.lines)
        bus = ", ".join(f"{b.op} {b.busbw / 1e9:.2f} GB/s" for b in res.bandwidth)
        return (f"all_reduce and all_gather across {res.world_size} processes over {res.backend}; "
                f"bus bandwidth {bus}", res.lines + [b.line() for b in res.bandwidth])

    def close(self):
        for p in self.devices:
            try:
                p.destroy()
            except Exception:  # the probe already reported what matters
                pass


SETUP = ("parse", "validate", "plugin_load", "device_check", "init")
CHECKS = ("alloc_free", "copy", "stream_event", "ops")
TITLES = {"plugin_load": "plugin load", "device_check": "device check", "alloc_free": "alloc/free",
          "stream_event": "stream/event"}


def run_probe(path: str, plugins: tuple[str, ...] = ()) -> Iterator[Step]:
    """Yield each step's result as it finishes."""
    probe = _Probe(path, tuple(plugins))
    try:
        for name in SETUP:
            step = _run(TITLES.get(name, name), getattr(probe, name))
            yield step
            if not step.ok:
                return
        names = CHECKS + (("collective",) if probe.spec.num_devices > 1 else ())
        for name in names:
            yield _run(TITLES.get(name, name), getattr(probe, name))
    finally:
        probe.close()
