"""Tensor parallelism, engine side: rank 0's worker processes, the step broadcast, and faults.

Rank 0 is the engine's own process. It opens its device through the plugin, schedules, broadcasts
each step's :class:`HostBatch` (as int64, engine/step_wire.py) on the communicator's control group, runs its shard of the forward
and samples; the sampled tokens reach the other ranks as the next step's input ids. Every other
rank is a ``python -m polychip.engine.tp_worker`` process on its own device (started here for this
node's ranks, by :func:`run_node` on the other nodes), which runs the same forward on its shard.

Faults end in a :class:`TensorParallelError` and :attr:`TensorParallel.fault`: a local worker's exit
(polled every 0.25 s), a rank's silent heartbeat, or a collective that fails (a peer's closed
connection at once, a hung peer after ``--dist-timeout``). Callbacks registered with
:meth:`TensorParallel.on_fault` run once, so the server can turn unhealthy and exit.
"""
from __future__ import annotations

import logging

from polychip.config import EngineConfig
from polychip.devices.discovery import open_device
from polychip.distributed.communicator import Communicator
from polychip.distributed.world import World, local_devices
from polychip.engine import step_wire
from polychip.engine.model_runner import Batch, ModelRunner, StepLimits
from polychip.engine.rank_group import RankGroup, agree_on_pool, device_status, model_signature
from polychip.errors import ConfigError, PolychipError
from polychip.models.loader import read_config, resolve_model_dir
from polychip.ops.tp_shard import ShardLayout

log = logging.getLogger("polychip.tp")


class TensorParallelError(PolychipError):
    """A rank died, hung or disagreed: the tensor-parallel group cannot run another step."""

    layer = "hardware"


def check_shardable(config: EngineConfig) -> None:
    """A ConfigError naming the counts when the model's heads cannot be split over tp_size ranks."""
    model_dir, _ = resolve_model_dir(config.model_path, config.cache_dir)
    ShardLayout.plan(read_config(model_dir), 0, config.tp_size)


class TensorParallel(RankGroup):
    """Rank 0's view of the group: its device, communicator, the local workers and the fault watch."""

    what = "tensor-parallel"
    error = TensorParallelError

    def __init__(self, config: EngineConfig):
        world = World.from_config(config)
        super().__init__(config, world)
        if world.node_rank != 0:
            raise ConfigError(f"node {world.node_rank} runs worker ranks only; rank 0 (the engine) is on node 0")
        self.comm = None
        devices = local_devices(config, world)
        check_shardable(config)        # before any process starts

        def say(store) -> None:
            log.info("tensor parallel: %d ranks on %d node(s); this node: %s", world.size, world.nnodes,
                     ", ".join(f"rank {r} on {d}" for r, d in zip(world.local_ranks, devices)))

        def connect(store) -> None:
            self.comm = Communicator(self.plugin.communicator_backend(), 0, world.size, store,
                                     timeout_s=config.dist_timeout, plugin_name=self.plugin.name,
                                     device=self.plugin.device_handle(), accumulate_fp32=config.allreduce_fp32)
        self.start(devices, "polychip.engine.tp_worker", "rank",
                   lambda d: open_device(d, tuple(config.plugins), config.device_config, num_threads=config.num_threads),
                   connect, say)

    # set-up, in the same order as every worker
    def agree_on_pool(self, pages: int, model_config, kv_bytes_per_page: int) -> int:
        try:
            pages, statuses = agree_on_pool(self.comm, pages, model_signature(model_config),
                                            device_status(self.plugin, 0, 0))
        except RuntimeError as e:
            raise self.failure(e) from None
        self.agreed(pages, kv_bytes_per_page, [dict(st, kv_pool_bytes=pages * kv_bytes_per_page) for st in statuses])
        return pages

    # the step
    def broadcast_step(self, host_batch) -> None:
        self.comm.broadcast_ints(step_wire.encode(host_batch))

    def say_stop(self) -> None:
        self.comm.broadcast_ints(None)

    def close_links(self) -> None:
        if self.comm is not None:
            self.comm.close()


class TPModelRunner(ModelRunner):
    """Rank 0's runner: broadcast the step, then run this rank's shard of the forward."""

    def __init__(self, model, plugin, limits: StepLimits, tp: TensorParallel, static_max_bs: int = 0):
        super().__init__(model, plugin, limits, static_max_bs)
        self.tp = tp

    def execute(self, batch: Batch):
        if self.tp.fault is not None:
            raise TensorParallelError(f"tensor-parallel group failed: {self.tp.fault}")
        try:
            self.tp.broadcast_step(batch.host)
            return super().execute(batch)
        except RuntimeError as e:   # gloo/nccl report a lost or hung peer as RuntimeError subclasses
            raise self.tp.failure(e) from None
