"""polychip batch -i in.jsonl -o out.jsonl [--resume] [--concurrency N] [engine flags]

Runs an OpenAI batch file (lines of {custom_id, method: POST, url, body}, url /v1/chat/completions
or /v1/completions) through the engine in this process, as the server would answer each body.
Records go to the output file in input order as they finish, OpenAI's shape; a bad line becomes
an error record; duplicate custom_ids refuse the whole file before the model loads.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from polychip.commands.common import add_engine_args, engine_config_from_args, fail, setup_logging
from polychip.errors import ConfigError, PolychipError
from polychip.flags import Parser, add_config_args, config_from_args
from polychip.trust.options import PackageOptions, TrustOptions

log = logging.getLogger("polychip.batch")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="polychip batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    p.add_argument("-o", "--output-file", required=True, help="where the records go (JSONL)")
    p.add_argument("--resume", action="store_true",
                   help="append to an existing output file, skipping the custom_ids it already has")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at once (default: --max-running-requests)")
    p.add_argument("--check-only", action="store_true",
                   help="stream the file, report its problems with line numbers, load no model")
    p.add_argument("--max-tokens-default", type=int, default=None,
                   help="max_tokens of a body that sets none (default: the rest of the context)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    add_config_args(p, PackageOptions)
    add_config_args(p, TrustOptions)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    from polychip.router.batch.lines import check_file
    from polychip.server.batch_check import body_problem
    try:
        if not os.path.isfile(args.input_file):
            raise ConfigError(f"--input-file {args.input_file}: no such file")
        t0 = time.perf_counter()
        found = check_file(args.input_file, None, body_problem)
        print(f"[checked {found.total} lines in {time.perf_counter() - t0:.1f}s: {found.error_count} problem(s)]",
              file=sys.stderr)
        if found.duplicates:
            raise ConfigError(f"{args.input_file}: {found.duplicates} duplicate custom_id(s), every custom_id must "
                              f"be unique: {found.summary()}")
        if args.check_only:
            for err in found.errors:
                print(err.describe())
            return 1 if found.error_count else 0
        if os.path.exists(args.output_file) and not args.resume and os.path.getsize(args.output_file):
            raise ConfigError(f"--output-file {args.output_file} exists; pass --resume to continue it, or remove it")
        # the trust chain serve applies: a .pcpkg verified and extracted, an unsigned model refused
        # once a trust store is set, before anything of it loads
        from polychip.package.opening import engine_config_for
        config = engine_config_for(engine_config_from_args(args), config_from_args(args, PackageOptions),
                                   config_from_args(args, TrustOptions))
        return asyncio.run(_run(args, config, found.total))
    except PolychipError as e:
        return fail(e)


async def _run(args, config, total: int) -> int:
    from polychip.batch.inprocess import InProcessServer
    from polychip.batch.progress import BatchProgress
    from polychip.router.batch.lines import parsed_lines
    from polychip.router.batch.output import OrderedWriter, Written, read_written
    from polychip.router.batch.records import encode, is_success
    from polychip.router.batch.runner import Limits, run_batch
    from polychip.server.batch_check import body_problem

    try:
        done = read_written([args.output_file], is_success) if args.resume else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    already = len(done.custom_ids) + len(done.lines) if done else 0
    if done:
        print(f"[resuming: {already} line(s) already in {args.output_file}]", file=sys.stderr)
    concurrency = args.concurrency or config.max_running_requests
    async with InProcessServer(config, args.max_tokens_default, concurrency) as server:
        bar = BatchProgress(total, already)
        with open(args.output_file, "ab", buffering=0) as out:
            writer = OrderedWriter(lambda record: out, encode, bar.written)
            await run_batch(parsed_lines(args.input_file, body_problem), server.send, writer, done or Written(),
                            Limits(concurrency))
        line = bar.close()
    elapsed = bar.elapsed
    if not bar.tty:
        print(line, file=sys.stderr)
    print(f"[{bar.ok + bar.failed} lines in {elapsed:.1f}s ({(bar.ok + bar.failed) / max(elapsed, 1e-9):.2f} req/s): "
          f"{bar.ok} ok, {bar.failed} failed, {already} skipped as done; {bar.tokens} output tokens, "
          f"{bar.tokens_per_s:.1f} tok/s; concurrency {concurrency}]", file=sys.stderr)
    return 0
