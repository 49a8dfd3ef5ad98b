"""Who is who under tensor or pipeline parallelism: ranks, nodes, and the device each rank of this
node opens.

As in SGLang, ``tp_size`` (or ``pp_size``: one rank per stage) counts ranks across all nodes; node
``k`` runs ranks ``k * per_node .. (k + 1) * per_node - 1``; rank 0 (on node 0) schedules and serves.
"""
from __future__ import annotations

from dataclasses import dataclass

from polychip.config import EngineConfig, parse_host_port
from polychip.devices import boundary
from polychip.devices.discovery import discover_plugins, parse_device, select
from polychip.devices.spec import load_spec
from polychip.errors import ConfigError

LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True)
class World:
    size: int              # ranks on all nodes: tp_size, or pp_size under pipeline parallelism
    nnodes: int
    node_rank: int

    @classmethod
    def from_config(cls, config: EngineConfig) -> "World":
        return cls(config.pp_size if config.pp_size > 1 else config.tp_size, config.nnodes, config.node_rank)

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_ranks(self) -> list[int]:
        first = self.node_rank * self.per_node
        return list(range(first, first + self.per_node))

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def facts(self, config: EngineConfig) -> dict:
        """What every rank must agree on before any collective (compared at join)."""
        facts = {"tp_size": config.tp_size, "nnodes": self.nnodes, "dtype": config.dtype,
                 "page_size": config.page_size, "max_model_len": config.max_model_len,
                 "allreduce_fp32": config.allreduce_fp32}
        if config.pp_size > 1:      # every stage sizes its buffers from these
            facts.update({name: getattr(config, name) for name in (
                "pp_size", "pp_devices", "pp_layer_split", "pp_micro_batches", "chunked_prefill_size",
                "max_running_requests", "kv_cache_dtype", "quantization")})
        return facts


def rendezvous_address(config: EngineConfig) -> tuple[str, int]:
    """Where node 0 hosts the store: ``--dist-init-addr``, else loopback on any free port (one node)."""
    if config.dist_init_addr is not None:
        return parse_host_port(config.dist_init_addr, "--dist-init-addr")
    return LOCAL_HOST, 0


def local_devices(config: EngineConfig, world: World) -> list[str]:
    """The ``--device`` string of each rank on this node, in rank order.

    The devices are the spec's ``device_ids`` (``--device-config``), else every device the plugin
    reports, starting at ``--device plugin:N`` when an index is given."""
    spec = load_spec(config.device_config) if config.device_config else None
    name, index = parse_device(config.device)
    if spec is not None and name == "auto":
        name = spec.device_type
    rec, _ = select(discover_plugins(tuple(config.plugins)), name if index is None else f"{name}:{index}")
    plugin = rec.plugin
    ids = list(spec.device_ids) if spec is not None and spec.device_type == plugin.name \
        else [i.index for i in boundary.devices(plugin)]
    if index is not None:
        if index not in ids:
            raise ConfigError(f"--device {config.device}: {plugin.name} has no device {index} here; it has {ids}")
        ids = ids[ids.index(index):]
    need = world.per_node
    if len(ids) < need:
        where = f"{need} rank(s) per node over {world.nnodes} nodes" if world.nnodes > 1 else f"{need} ranks"
        hint = "" if spec is not None else "; declare devices in a spec (--device-config, e.g. " \
            f"examples/specs/{plugin.name}-2.yaml)"
        raise ConfigError(f"--tp-size {world.size} needs {where}, but plugin {plugin.name!r} has only "
                          f"{len(ids)} device(s) available on this node ({ids}){hint}, or lower --tp-size")
    return [f"{plugin.name}:{i}" for i in ids[:need]]
