"""Engine flags shared by commands (SGLang's names), mapped onto EngineConfig."""
from __future__ import annotations

import argparse
import logging
import sys

from polychip.config import DTYPES, POLICIES, QUANTIZATIONS, EngineConfig
from polychip.errors import PolychipError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="HF folder, .gguf file or .pcpkg package (default: embedded SmolLM2)")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="int8: weight-only int8 with per-output-channel scales for every linear layer and "
                        "the lm_head (a tied one gets an int8 copy; the embedding stays); default: as stored")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--cache-dir", default=None, help="where converted GGUF weights are cached")
    g = p.add_argument_group("device")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | <plugin>[:index]")
    g.add_argument("--plugin", action="append", default=[], dest="plugins",
                   help="extra device plugin: module.path or path/to/plugin.py (repeatable)")
    g.add_argument("--device-config", default=None, help="device spec YAML file")
    g.add_argument("--num-threads", type=int, default=None)
    g = p.add_argument_group("KV pool and scheduler")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--mem-fraction-static", type=float, default=None)
    g.add_argument("--chunked-prefill-size", type=int, default=512)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--schedule-policy", default="fcfs", choices=POLICIES)
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--disable-fusion", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    fields = dict(
        model_path=args.model_path, served_model_name=args.served_model_name, dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len, cache_dir=args.cache_dir, device=args.device,
        plugins=tuple(args.plugins), device_config=args.device_config, num_threads=args.num_threads,
        page_size=args.page_size, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests, schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache, enable_fusion=not args.disable_fusion,
        seed=args.seed, log_level=args.log_level)
    fields.update(extra)
    return EngineConfig(**fields)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def fail(err: Exception) -> int:
    """Print a polychip error as one line naming its layer; exit status 1."""
    if isinstance(err, PolychipError):
        print(f"error: {err}", file=sys.stderr)
    else:
        print(f"error: [framework] {type(err).__name__}: {err}", file=sys.stderr)
    return 1
