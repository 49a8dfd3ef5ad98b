"""A pipeline stage past 0: ``python -m polychip.engine.pipeline.worker``.

It opens its device through its plugin, joins the world, reads the plan rank 0 published (its
layers, the model dtype), loads only its layers' weights, sizes its KV pool for its layers from its
own device (the smallest stage's page count serves all), then runs every micro-batch the previous
stage sends until the stop message. A stage that fails writes its error into the rendezvous store
(rank 0 names it) and exits non-zero; one that loses rank 0 exits at once.
"""
from __future__ import annotations

import json
import logging
import os
import sys

from polychip.config import EngineConfig
from polychip.distributed import secret as dist_secret
from polychip.distributed.rendezvous import Heartbeat, join
from polychip.distributed.stage_links import StageLinks
from polychip.distributed.world import World
from polychip.engine.kv_pool import KVPool, resolve_kv_dtype
from polychip.engine.memory_plan import activation_bytes, size_pool
from polychip.engine.model_runner import StepLimits
from polychip.engine.pipeline.group import PLAN_KEY, agree_on_pool
from polychip.engine.pipeline.runner import StageRunner
from polychip.engine.pipeline.stages import open_stage_device
from polychip.engine.rank_group import device_status
from polychip.engine.rank_workers import worker_main
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
    return worker_main(argv, "polychip.engine.pipeline.worker", __doc__, "stage", serve_stage)


if __name__ == "__main__":
    sys.exit(main())
