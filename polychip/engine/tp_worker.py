"""A tensor-parallel worker rank (1 .. N-1): ``python -m polychip.engine.tp_worker``.

It opens its device through the plugin, joins the world, loads its shard, sizes its KV pool from
its own device (the smallest rank's count wins), then runs the forward of every step rank 0
broadcasts until rank 0 says stop. A worker that fails writes its error into the rendezvous store
(rank 0 prints it) and exits non-zero; one that loses rank 0 exits at once.
"""
from __future__ import annotations

import json
import logging
import os
import sys

from polychip.config import EngineConfig, parse_host_port
from polychip.devices.discovery import open_device
from polychip.distributed import secret as dist_secret
from polychip.distributed.communicator import Communicator
from polychip.distributed.rendezvous import DuplicateRankError, Heartbeat, connect_store, join, report_failure
from polychip.distributed.world import World
from polychip.engine import step_wire
from polychip.engine.kv_pool import KVPool, resolve_kv_dtype
from polychip.engine.memory_plan import activation_bytes, size_pool
from polychip.engine.model_runner import ModelRunner, StepLimits
from polychip.engine.static_decode import static_decode_limit
from polychip.engine.tp import agree_on_pool, device_status, model_signature
from polychip.errors import PolychipError
from polychip.flags import Parser
from polychip.models.loader import load_model

log = logging.getLogger("polychip.tp_worker")

EXIT_LOST_RANK0 = 3


def serve_rank(config: EngineConfig, rank: int, device: str, host: str, port: int, store) -> None:
    world = World.from_config(config)
    node = world.node_of(rank)
    plugin = open_device(device, tuple(config.plugins), config.device_config, num_threads=config.num_threads)
    kv_bytes = [0]

    def lost(reason: str) -> None:
        log.error("rank %d: %s; exiting", rank, reason)
        os._exit(EXIT_LOST_RANK0)   # the main thread may sit in a collective that never returns

    join(store, rank, world.tp_size, world.facts(config), config.dist_init_timeout, world.node_of,
         dist_secret.resolve(None, None))     # from the environment rank 0 or run_node gave this process
    beat = Heartbeat(host, port, rank, lambda: device_status(plugin, rank, node, kv_bytes[0]), lost).start()
    comm = None
    try:
        comm = Communicator(plugin.communicator_backend(), rank, world.tp_size, store,
                            timeout_s=config.dist_timeout, plugin_name=plugin.name,
                            device=plugin.device_handle(), accumulate_fp32=config.allreduce_fp32)
        loaded = load_model(config.model_path, plugin, config.dtype, config.enable_fusion, config.cache_dir,
                            config.max_model_len, comm=comm)
        mc = loaded.config
        # the same memory plan as rank 0 (engine/memory_plan.py): buffers, reserve, then the pool
        max_model_len = config.max_model_len or mc.max_position_embeddings
        limits = StepLimits.of(config, max_model_len)
        static_bs, _ = static_decode_limit(config, plugin, loaded.resolutions)   # as rank 0 decides it
        runner = ModelRunner(loaded.model, plugin, limits, static_bs)
        plugin.reserve_for_activations(activation_bytes(mc, limits.max_tokens, limits.max_seqs, loaded.dtype))
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, plugin, loaded.dtype)
        per_page = KVPool.bytes_per_page(mc.num_layers, config.page_size, loaded.kv_heads, mc.head_dim, kv_dtype)
        pages, _ = agree_on_pool(comm, size_pool(config, plugin, per_page, config.page_size, max_model_len,
                                                 int(static_bs > 0)),
                                 model_signature(mc), device_status(plugin, rank, node))
        pool = KVPool(plugin, mc.num_layers, pages, config.page_size, loaded.kv_heads, mc.head_dim, kv_dtype,
                      scratch=static_bs > 0)
        runner.attach_pool(pool)
        runner.compile_decode(pool.scratch_page)
        kv_bytes[0] = pages * per_page
        log.info("rank %d ready on %s:%d: %d KV pages of %d KV head(s)", rank, plugin.name, plugin.index,
                 pages, loaded.kv_heads)
        steps = 0
        while True:
            message = comm.broadcast_ints()
            if message is None:
                break
            runner.execute(runner.to_device(step_wire.decode(message)))
            steps += 1
        log.info("rank %d: stopped by rank 0 after %d steps", rank, steps)
        runner.release_compiled()
        pool.release()
    finally:
        beat.stop()
        if comm is not None:
            comm.close()
        plugin.destroy()


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m polychip.engine.tp_worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--device", required=True, help="this rank's device, e.g. simxpu:1")
    p.add_argument("--store", required=True, help="HOST:PORT of node 0's rendezvous store")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [rank {args.rank}] %(name)s: %(message)s")
    store = None
    try:
        host, port = parse_host_port(args.store, "--store")
        store = connect_store(host, port, config.dist_init_timeout)
        serve_rank(config, args.rank, args.device, host, port, store)
        return 0
    except BaseException as e:  # report whatever it is to rank 0, then exit non-zero
        msg = str(e) if isinstance(e, PolychipError) else f"{type(e).__name__}: {e}"
        log.error("rank %d failed: %s", args.rank, msg)
        if store is not None and not isinstance(e, DuplicateRankError):   # the rank is another's
            try:
                report_failure(store, args.rank, msg)
            except Exception:  # rank 0 is gone too; the log line above is all we can do
                pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
