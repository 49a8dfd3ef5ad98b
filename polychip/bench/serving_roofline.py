"""The workload roofline of a ``bench serving`` sweep (``polychip.bench.roofline``), for a polychip
server on this host: the model's shape from the folder its ``/server_info`` names, the weights and
KV cache as the server stores them (dtype, quantization, KV dtype), and the machine measured on
the server's device type before and after the sweep (the server idles meanwhile).

Each synthetic step is rated against the roofline of its own requests, concurrency, input and
output lengths. A server without ``/server_info`` (another engine), a model folder this host cannot
read, a quantization whose bytes ``roofline.polychip_storage`` does not model (group or block scales),
or a dataset of varying lengths gets no roofline, with the reason in the result.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import httpx

from polychip.bench import roofline as rl

log = logging.getLogger("polychip.bench")


@dataclass
class ServingRoofline:
    shape: rl.ModelShape
    storage: rl.Storage
    device: str                         # what the machine is measured on (the server's plugin)
    machine: rl.Machine | None = None
    measurements: tuple = ()


def storage_of_server(info: dict) -> rl.Storage:
    """The server's weights and KV cache as ``/server_info`` reports them."""
    dtype = info.get("dtype", "float32")
    return rl.polychip_storage(dtype, info.get("kv_cache_dtype") or dtype, info.get("quantization"))


def prepare(base_url: str, api_key: str | None = None) -> tuple[ServingRoofline | None, str]:
    """(the roofline's inputs, "") or (None, why there is none)."""
    from polychip.bench.serving import api_root
    from polychip.models.loader import read_config
    try:
        r = httpx.get(f"{api_root(base_url)}/server_info", timeout=30.0,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        r.raise_for_status()
        info = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return None, f"no /server_info from the server ({type(e).__name__}): not a polychip server?"
    folder = info.get("model_path")
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        return None, f"the model folder {folder!r} the server reports is not readable here"
    shape = rl.ModelShape.from_config(read_config(folder))
    try:
        storage = storage_of_server(info)
    except ValueError as e:      # group or block scales (w4a16, fp8, ...): bytes Storage does not model
        return None, str(e)
    return ServingRoofline(shape, storage, info.get("plugin") or "cpu"), ""


def measure(roof: ServingRoofline) -> None:
    """One measurement of the machine on the server's device type (call before and after the sweep)."""
    from polychip.devices.discovery import open_device
    plugin = open_device(roof.device)
    try:
        m = rl.measure_machine(roof.shape, plugin=plugin, int8=roof.storage.int8_matmuls)
    finally:
        plugin.destroy()
    roof.measurements += (m,)
    roof.machine = m if roof.machine is None else rl.best_of(roof.machine, m)


def rate(result: dict, roof: ServingRoofline, input_len: int, output_len: int) -> dict:
    """Adds each step's roofline and % of it; returns the roofline's summary for the result."""
    for step in result["steps"]:
        n = step["num_requests"]
        w = rl.workload_seconds(roof.shape, roof.storage, roof.machine, n, input_len, output_len, step["concurrency"])
        old = rl.weights_only_workload_seconds(roof.shape, roof.machine, n, input_len, output_len,
                                               step["concurrency"])
        step["roofline_output_tok_s"] = w["output_tok_s"]
        step["pct_roofline"] = 100 * step["output_throughput"] / w["output_tok_s"]
        step["pct_weights_only_roofline"] = 100 * step["output_throughput"] / old["output_tok_s"]
    return {"storage": roof.storage.label, "device": roof.device, "machine": roof.machine.as_dict(),
            "machine_measurements": [m.as_dict() for m in roof.measurements]}
