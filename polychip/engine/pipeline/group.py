"""Pipeline parallelism, rank 0's side: the plan, the stage processes, the links and the faults.

Rank 0 is stage 0 and the engine's process. Before any process starts or any weight loads it
plans the split (plan.py: ``--pp-layer-split`` or the planner's choice, refused when a stage cannot
hold its share), then hosts the rendezvous, publishes the plan in it (every stage, on any node,
reads its layers and the model dtype from there), starts this node's other stages
(``python -m polychip.engine.pipeline.worker``), opens its own device and joins. Faults (a stage
process gone, a silent heartbeat, a link that fails) end in :class:`PipelineError` naming the
stage and its device.
"""
from __future__ import annotations

import json
import logging

from polychip.config import EngineConfig
from polychip.distributed.rendezvous import PREFIX
from polychip.distributed.stage_links import StageLinks
from polychip.distributed.world import World
from polychip.engine.pipeline.plan import Plan, plan_pipeline
from polychip.engine.pipeline.runner import FirstStageRunner
from polychip.engine.pipeline.stages import open_stage_device, stage_devices
from polychip.engine.rank_group import RankGroup, device_status, model_signature
from polychip.errors import ConfigError, PolychipError
from polychip.models.stage import spans

log = logging.getLogger("polychip.pipeline")

WORKER_MODULE = "polychip.engine.pipeline.worker"
PLAN_KEY = f"{PREFIX}pipeline/plan"


class PipelineError(PolychipError):
    """A stage died, hung or disagreed: the pipeline cannot run another micro-batch."""

    layer = "hardware"


def agree_on_pool(links, pages: int, mc, page_bytes: int, status: dict) -> tuple[int, list[dict]]:
    """Every stage's KV page count (sized from its own device for its own layers), model and device,
    gathered on the control group: the smallest count serves all; each stage's pool bytes follow."""
    everyone = links.all_gather_json({"pages": pages, "model": model_signature(mc), "status": status,
                                      "page_bytes": page_bytes})
    for r, info in enumerate(everyone):
        if info["model"] != everyone[0]["model"]:
            diff = {k: (everyone[0]["model"][k], v) for k, v in info["model"].items() if everyone[0]["model"][k] != v}
            raise ConfigError(f"stage {r} loaded a different model than stage 0: {diff}")
    agreed = min(info["pages"] for info in everyone)
    for info in everyone:
        info["status"]["kv_pool_bytes"] = agreed * info["page_bytes"]
    fewest = min(range(len(everyone)), key=lambda r: everyone[r]["pages"])
    log.info("KV pool: %d pages on every stage (stage %d's memory holds the fewest)", agreed, fewest)
    return agreed, [info["status"] for info in everyone]


class PipelineGroup(RankGroup):
    what = "pipeline"
    error = PipelineError

    def __init__(self, config: EngineConfig):
        world = World.from_config(config)
        super().__init__(config, world)
        if world.node_rank != 0:
            raise ConfigError(f"node {world.node_rank} runs stages only; stage 0 (the engine) is on node 0")
        self.links = self.runner = None
        self.devices = stage_devices(config)
        self.plan: Plan = plan_pipeline(config)           # refused here, before any process or weight
        self.spans = spans(self.plan.counts)
        self.span = self.spans[0]
        self.depth = config.pp_micro_batches or config.pp_size
        log.info("pipeline: %s", "; ".join(f"stage {s.index} on {s.device}: layers {s.start}-{s.end - 1}"
                                          for s in self.plan.stages) + f" ({self.plan.chosen_by})")
        for note in self.plan.notes:
            log.warning("pipeline plan: %s", note)

        def connect(store) -> None:
            self.links = StageLinks(0, world.size, store, self.plugin.name, self.plugin.communicator_backend(),
                                    timeout_s=config.dist_timeout)
        plan = json.dumps({"counts": self.plan.counts, "dtype": self.plan.dtype})
        self.start([self.devices[r] for r in world.local_ranks], WORKER_MODULE, "stage",
                   lambda d: open_stage_device(config, d), connect, lambda store: store.set(PLAN_KEY, plan))

    def attach_runner(self, loaded, limits):
        """Stage 0's runner over its layers, and the link buffers (after the weights, before the reserve)."""
        self.runner = FirstStageRunner(loaded.model, self.plugin, limits, self.links, self.span)
        self.links.attach(self.plugin, loaded.dtype, loaded.config.hidden_size, limits.max_tokens, self.depth)
        return self.runner

    def link_failure(self, err: BaseException) -> PipelineError:
        if self.fault is not None:
            return PipelineError(f"pipeline group failed: {self.fault}")
        return self.failure(err, "a link failed on stage 0")

    def report(self, ranks, in_flight: int) -> dict:
        """/server_info's ``pipeline``: each stage's device, layers and step times; the plan."""
        plan = self.plan
        tput = plan.throughput()
        stages = [{"stage": r.rank, "device": f"{r.plugin}:{r.device}", "node": r.node,
                   "layers": [self.spans[r.rank].start, self.spans[r.rank].end], "weight_bytes": r.weight_bytes,
                   "micro_batches": r.micro_batches,
                   "step_seconds": r.step_seconds, "busy_seconds": r.busy_seconds, "kv_pool_bytes": r.kv_pool_bytes}
                  for r in ranks]
        busiest = max(stages, key=lambda st: st["busy_seconds"])
        return {"pp_size": len(self.devices), "micro_batches": self.depth, "in_flight": in_flight,
                "split": plan.counts, "chosen_by": plan.chosen_by, "stages": stages,
                "bottleneck_stage": busiest["stage"] if busiest["busy_seconds"] > 0 else plan.bottleneck.index,
                "planned_bottleneck_stage": plan.bottleneck.index,
                "predicted_output_tokens_per_s": None if tput is None else tput[0]}

    def name_rank(self, rank: int) -> str:
        return f"stage {rank} ({self.devices[rank]})"

    def agree_on_pool(self, pages: int, mc, page_bytes: int) -> int:
        try:
            pages, statuses = agree_on_pool(self.links, pages, mc, page_bytes, self.own_status())
        except RuntimeError as e:
            raise self.failure(e, "a link failed on stage 0") from None
        self.agreed(pages, page_bytes, statuses)
        return pages

    def own_status(self) -> dict:
        st = device_status(self.plugin, 0, 0, self.kv_pool_bytes)
        return {**st, **(self.runner.status() if self.runner is not None else {})}

    def say_stop(self) -> None:
        self.links.send_stop()

    def close_links(self) -> None:
        if self.links is not None:
            self.links.close()
