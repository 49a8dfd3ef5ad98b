"""polychip plan --model M --pp-devices cpu:0,simxpu:0 [--device-config SPEC] [--calibrate]: the
pipeline split over unlike devices, before anything is served.

It prints each stage's layers, weights, memory need against what its device has, KV capacity and
expected step times, the bottleneck stage and the predicted throughput of a reference workload
(``--streams``, ``--input-len``, ``--output-len``), from each device's declared compute, memory
and bandwidth, or, with ``--calibrate``, from a short measured run of one layer on each device.
``polychip serve`` with the same flags uses the same plan unless ``--pp-layer-split`` is given.
"""
from __future__ import annotations

import dataclasses
import json

from polychip.commands.common import add_engine_args, engine_config_from_args, fail, setup_logging
from polychip.devices.spec import fmt_bytes
from polychip.errors import ConfigError, PolychipError
from polychip.flags import Parser


def _ms(seconds: float, known: bool) -> str:
    return f"{seconds * 1e3:.2f} ms" if known else f"{seconds:g} units"


def format_plan(plan, model: str) -> str:
    wl, st0 = plan.workload, plan.stages[0]
    lines = [f"pipeline plan for {model}: {sum(plan.counts)} layers in {plan.dtype} over {len(plan.stages)} stages, "
             f"{plan.micro_batches} micro-batch(es) in flight",
             f"workload: {wl.streams} streams of {wl.input_len} prompt + {wl.output_len} output tokens"]
    cols = ("stage", "device", "layers", "weights", "need / have", "KV tokens", "decode step", "prefill chunk",
            "busy per round", "figures")
    rows = [[str(s.index), s.device, f"{s.start}-{s.end - 1}", fmt_bytes(s.memory["weights"]),
             f"{fmt_bytes(s.need)} / {fmt_bytes(s.have)}", str(s.kv_tokens), _ms(s.decode_seconds, plan.known),
             _ms(s.prefill_seconds, plan.known), _ms(s.round_seconds, plan.known), s.figures.source]
            for s in plan.stages]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()   # noqa: E731
    lines += [fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    b = plan.bottleneck
    lines.append(f"bottleneck: stage {b.index} ({b.device}), {_ms(b.round_seconds, plan.known)} busy per round; "
                 f"round trips (every stage's work and sends) {_ms(sum(s.trip_seconds for s in plan.stages), plan.known)}"
                 f" over {plan.micro_batches} micro-batch(es); round {_ms(plan.round_seconds, plan.known)}")
    tput = plan.throughput()
    lines.append("predicted throughput: " + (f"{tput[0]:.1f} output tokens/s ({tput[1]:.1f} tokens/s in all)"
                                             if tput else "unknown (no device declares its speed; --calibrate)"))
    lines.append(f"KV capacity of the group: {plan.kv_tokens} tokens; decode micro-batch "
                 f"{-(-wl.streams // plan.micro_batches)} rows")
    lines.append(f"split: --pp-layer-split {','.join(map(str, plan.counts))} ({plan.chosen_by}); stage 0 ({st0.device}) "
                 "also holds the embedding, the final norm and the lm_head")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_json(plan) -> dict:
    tput = plan.throughput()
    return {"counts": plan.counts, "dtype": plan.dtype, "chosen_by": plan.chosen_by, "known": plan.known,
            "micro_batches": plan.micro_batches, "workload": dataclasses.asdict(plan.workload),
            "bottleneck": plan.bottleneck.index, "round_seconds": plan.round_seconds, "kv_tokens": plan.kv_tokens,
            "throughput": None if tput is None else {"output_tokens_per_s": tput[0], "tokens_per_s": tput[1]},
            "notes": plan.notes,
            "stages": [{"stage": s.index, "device": s.device, "layers": [s.start, s.end], "memory": s.memory,
                        "need": s.need, "have": s.have, "kv_tokens": s.kv_tokens, "decode_seconds": s.decode_seconds,
                        "prefill_seconds": s.prefill_seconds, "round_seconds": s.round_seconds,
                        "trip_seconds": s.trip_seconds,
                        "figures": s.figures.source, "measured": s.figures.measured} for s in plan.stages]}


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip plan", description=__doc__)
    add_engine_args(p)
    p.add_argument("--model", dest="model_path", default=None, help="the same as --model-path")
    p.add_argument("--streams", type=int, default=16, help="reference workload: requests running together")
    p.add_argument("--input-len", type=int, default=800, help="reference workload: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="reference workload: generated tokens")
    p.add_argument("--json", action="store_true")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    from polychip.engine.pipeline.cost import Workload
    from polychip.engine.pipeline.plan import plan_pipeline
    try:
        if min(args.streams, args.input_len, args.output_len) < 1:
            raise ConfigError("--streams, --input-len and --output-len must be >= 1")
        config = engine_config_from_args(args)
        if config.pp_size < 2:
            raise ConfigError("polychip plan splits a model over pipeline stages: give --pp-size N (N >= 2) and "
                              "--pp-devices")
        workload = Workload(args.streams, args.input_len, args.output_len)
        plan = plan_pipeline(config, workload)      # --calibrate (config.pp_calibrate): measured first
    except PolychipError as e:
        return fail(e)
    print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan, config.model_path or "SmolLM2"))
    return 0
