"""A pipeline stage past 0: ``python -m polychip.engine.pipeline.worker``.

It opens its device through its plugin, joins the world, reads the plan rank 0 published (its
layers, the model dtype), loads only its layers' weights, sizes its KV pool for its layers from its
own device (the smallest stage's page count serves all), then runs every micro-batch the previous
stage sends until the stop message. A stage that fails writes its error into the rendezvous store
(rank 0 names it) and exits non-zero; one that loses rank 0 exits at once.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys

from polychip.config import EngineConfig, parse_host_port
from polychip.distributed import secret as dist_secret
from polychip.distributed.rendezvous import DuplicateRankError, Heartbeat, connect_store, join, report_failure
from polychip.distributed.stage_links import StageLinks
from polychip.distributed.world import World
from polychip.engine.kv_pool import KVPool, resolve_kv_dtype
from polychip.engine.memory_plan import activation_bytes, size_pool
from polychip.engine.model_runner import StepLimits
from polychip.engine.pipeline.group import PLAN_KEY, agree_on_pool
from polychip.engine.pipeline.runner import StageRunner
from polychip.engine.pipeline.stages import open_stage_device
from polychip.engine.rank_group import device_status
from polychip.errors import PolychipError
from polychip.models.loader import load_model
from polychip.models.stage import spans

log = logging.getLogger("polychip.pipeline.worker")

EXIT_LOST_RANK0 = 3


def serve_stage(config: EngineConfig, rank: int, device: str, host: str, port: int, store) -> None:
    world = World.from_config(config)
    node = world.node_of(rank)
    plugin = open_stage_device(config, device)
    held = {"kv": 0, "runner": None}

    def lost(reason: str) -> None:
        log.error("stage %d: %s; exiting", rank, reason)
        os._exit(EXIT_LOST_RANK0)   # the main thread may wait on a link that never answers

    def status() -> dict:
        runner = held["runner"]
        return {**device_status(plugin, rank, node, held["kv"]), **(runner.status() if runner else {})}

    join(store, rank, world.size, world.facts(config), config.dist_init_timeout, world.node_of,
         dist_secret.resolve(None, None))     # from the environment rank 0 or run_node gave this process
    plan = json.loads(store.get(PLAN_KEY))
    span = spans(plan["counts"])[rank]
    beat = Heartbeat(host, port, rank, status, lost).start()
    links = None
    try:
        links = StageLinks(rank, world.size, store, plugin.name, plugin.communicator_backend(),
                           timeout_s=config.dist_timeout)
        loaded = load_model(config.model_path, plugin, plan["dtype"], config.enable_fusion, config.cache_dir,
                            config.max_model_len, quantization=config.quantization, stage=span)
        mc = loaded.config
        # the memory plan of every engine (engine/memory_plan.py): buffers, reserve, then the pool
        max_model_len = config.max_model_len or mc.max_position_embeddings
        limits = StepLimits.of(config, max_model_len)
        runner = StageRunner(loaded.model, plugin, limits, links, span)
        held["runner"] = runner
        links.attach(plugin, loaded.dtype, mc.hidden_size, limits.max_tokens, config.pp_micro_batches or world.size)
        plugin.reserve_for_activations(activation_bytes(mc, limits.max_tokens, 0, loaded.dtype))
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, plugin, loaded.dtype)
        page_bytes = KVPool.bytes_per_page(span.layers, config.page_size, mc.num_kv_heads, mc.head_dim, kv_dtype)
        pages, _ = agree_on_pool(links, size_pool(config, plugin, page_bytes, config.page_size, max_model_len),
                                 mc, page_bytes, status())
        pool = KVPool(plugin, span.layers, pages, config.page_size, mc.num_kv_heads, mc.head_dim, kv_dtype)
        runner.attach_pool(pool)
        held["kv"] = pages * page_bytes
        log.info("stage %d ready on %s:%d: layers %d-%d, %d KV pages", rank, plugin.name, plugin.index,
                 span.start, span.end - 1, pages)
        steps = runner.serve()
        log.info("stage %d: stopped by stage 0 after %d micro-batches", rank, steps)
        pool.release()
    finally:
        beat.stop()
        if links is not None:
            links.close()
        plugin.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polychip.engine.pipeline.worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True, help="this stage's number (1 .. pp_size - 1)")
    p.add_argument("--device", required=True, help="this stage's device, e.g. simxpu:0")
    p.add_argument("--store", required=True, help="HOST:PORT of node 0's rendezvous store")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1 PID`: where every thread is
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [stage {args.rank}] %(name)s: %(message)s")
    store = None
    try:
        host, port = parse_host_port(args.store, "--store")
        store = connect_store(host, port, config.dist_init_timeout)
        serve_stage(config, args.rank, args.device, host, port, store)
        return 0
    except BaseException as e:  # report whatever it is to rank 0, then exit non-zero
        msg = str(e) if isinstance(e, PolychipError) else f"{type(e).__name__}: {e}"
        log.error("stage %d failed: %s", args.rank, msg)
        if store is not None and not isinstance(e, DuplicateRankError):   # the rank is another's
            try:
                report_failure(store, args.rank, msg)
            except Exception:  # rank 0 is gone too; the log line above is all we can do
                pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
