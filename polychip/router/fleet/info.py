"""What a replica reports of itself (its ``/server_info``), as the router reads it: parsed strictly,
a missing or mistyped field named."""
from __future__ import annotations

from dataclasses import dataclass

from polychip.router.device_health import DeviceHealth, parse_device_health


@dataclass(frozen=True)
class ReplicaInfo:
    """The parts of a replica's ``/server_info`` the router uses."""

    model: str
    version: str
    plugin: str
    device_type: str
    device: str                      # e.g. "simxpu:1"
    dtype: str
    device_dtypes: tuple[str, ...]
    quantization: str | None
    tp_size: int
    max_running_requests: int
    num_waiting: int
    num_running: int
    kv_usage: float
    prefix_cache_hit_rate: float
    # a prefill/decode side (its /server_info "disaggregation" block): role, where decode sides reach
    # a prefill side, and the hand-off figures; None / empty for plain serving
    role: str | None = None
    bootstrap_port: int | None = None
    transfer_backend: str | None = None
    handoffs: tuple[tuple[str, float], ...] = ()
    # what each rank's plugin reports about its device (temperature, throttling, ...); () when none
    device_health: tuple[DeviceHealth, ...] = ()
    # a pipeline group (its /server_info "pipeline" block): each stage's (device, layers, mean step seconds)
    stages: tuple[tuple[str, str, float], ...] = ()
    startup: dict | None = None      # its "startup" block: load, compile and warm-up times (when it has one)
    # the compute figures its device declares (its spec's ``compute``: tflops_fp32, ...); () when none
    compute: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, data: dict) -> "ReplicaInfo":
        """From the JSON; a missing or mistyped field is a ValueError naming it."""
        def get(key, kind, default=None):
            value = data.get(key, default)
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise ValueError(f"/server_info field {key!r} should be {kind}, got {value!r}")
            return value
        device_type = get("device_type", str, data.get("plugin"))
        index = data.get("device_index", 0)
        return cls(model=get("model", str), version=str(data.get("version") or "default"),
                   plugin=get("plugin", str, device_type), device_type=device_type,
                   device=get("device", str, f"{device_type}:{index}"), dtype=get("dtype", str, "unknown"),
                   device_dtypes=tuple(get("device_dtypes", list, [])),
                   quantization=data.get("quantization"), tp_size=get("tp_size", int, 1),
                   max_running_requests=get("max_running_requests", int, 64),
                   num_waiting=get("num_waiting", int, 0), num_running=get("num_running", int, 0),
                   kv_usage=float(get("kv_usage", (int, float), 0.0)),
                   prefix_cache_hit_rate=float(get("prefix_cache_hit_rate", (int, float), 0.0)),
                   startup=data["startup"] if isinstance(data.get("startup"), dict) else None,
                   device_health=parse_device_health(data.get("device_health")),
                   stages=_stages(data.get("pipeline")), compute=_compute(data.get("device_compute")),
                   **_disaggregation(data.get("disaggregation")))


def _stages(block) -> tuple[tuple[str, str, float], ...]:
    """A pipeline group's stages from its "pipeline" block; ValueError naming a bad field."""
    if block is None:
        return ()
    rows = block.get("stages") if isinstance(block, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"/server_info field 'pipeline' should hold a list of stages, got {block!r}")
    out = []
    for st in rows:
        ok = isinstance(st, dict) and isinstance(st.get("device"), str) and isinstance(st.get("layers"), list) \
            and len(st["layers"]) == 2 and all(isinstance(v, int) for v in st["layers"]) \
            and isinstance(st.get("step_seconds"), (int, float)) and not isinstance(st["step_seconds"], bool)
        if not ok:
            raise ValueError(f"/server_info field 'pipeline.stages' has a malformed stage: {st!r}")
        out.append((st["device"], f"{st['layers'][0]}-{st['layers'][1] - 1}", float(st["step_seconds"])))
    return tuple(out)


def _compute(block) -> tuple[tuple[str, float], ...]:
    """``device_compute``: figure name -> a positive number; ValueError naming a bad one."""
    if block is None:
        return ()
    if not isinstance(block, dict):
        raise ValueError(f"/server_info field 'device_compute' should be an object, got {block!r}")
    for key, value in block.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"/server_info field 'device_compute.{key}' should be a positive number, got {value!r}")
    return tuple(sorted((str(k), float(v)) for k, v in block.items()))


HANDOFF_FIGURES = ("transfers_in_flight", "transfers_done", "transfers_failed", "fallbacks", "bytes",
                   "transfer_seconds")


def _disaggregation(block) -> dict:
    """A replica's role and hand-off figures from its "disaggregation" block; ValueError naming a bad field."""
    if block is None:
        return {}
    if not isinstance(block, dict) or block.get("mode") not in ("prefill", "decode"):
        raise ValueError(f"/server_info field 'disaggregation' should name mode prefill or decode, got {block!r}")
    port = block.get("bootstrap_port")
    if block["mode"] == "prefill" and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ValueError(f"/server_info field 'disaggregation.bootstrap_port' should be a port, got {port!r}")
    figures = []
    for key in HANDOFF_FIGURES:
        value = block.get(key, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"/server_info field 'disaggregation.{key}' should be a number, got {value!r}")
        figures.append((key, float(value)))
    return {"role": block["mode"], "bootstrap_port": port if block["mode"] == "prefill" else None,
            "transfer_backend": str(block.get("transfer_backend")), "handoffs": tuple(figures)}
