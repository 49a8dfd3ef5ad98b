"""polychip bench ops: the time of each op a model's plan uses, on one device, against a baseline.

  polychip bench ops [--device D] [--model-path M] --save [FILE]      before a driver/SDK upgrade
  polychip bench ops [--device D] [--model-path M] --baseline [FILE]  after it: exit 1 on a regression

Each op the model calls is timed at the shapes of a prefill chunk and of decode batches 1 and 16, and so
are the whole prefill and decode steps; the run records the device's version matrix. --baseline runs the
same and names each op or step slower than --threshold (default 15%, or three times the baseline's own
spread when that is larger), with its ratio and the version keys that changed. Exit status: 0 no
regression, 1 a regression, 2 the run could not be compared (no baseline, another device or model).
Without a FILE, baselines live in $POLYCHIP_BASELINE_DIR (default ~/.cache/polychip/baselines); see
docs/upgrades.md.
"""
from __future__ import annotations

import argparse
import json

from polychip.errors import PolychipError

SAVE_DEFAULT = "<host baseline directory>"


def add_parser(sub) -> None:
    p = sub.add_parser("ops", help="time each op of a model's plan; save a baseline or compare against one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | <plugin>[:index]")
    p.add_argument("--plugin", action="append", default=[], dest="plugins")
    p.add_argument("--device-config", default=None, help="device spec YAML")
    p.add_argument("--num-threads", type=int, default=None,
                   help="host threads of a device that computes on them (as serve's --num-threads)")
    p.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--prefill-chunk", type=int, default=256, help="tokens of the prefill chunk (default 256)")
    p.add_argument("--decode-batches", default="1,16", help="decode batch sizes (default 1,16)")
    p.add_argument("--decode-context", type=int, default=256, help="tokens each decode sequence attends to")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per measure (default 9)")
    p.add_argument("--sample-ms", type=float, default=4.0,
                   help="the shortest timed sample of a measure in a round (default 4; longer on a busy host)")
    p.add_argument("--save", nargs="?", const=SAVE_DEFAULT, default=None, metavar="FILE",
                   help="write the run as a baseline (no FILE: the host's baseline directory); with --baseline, "
                        "only when no regression was found")
    p.add_argument("--baseline", nargs="?", const="", default=None, metavar="FILE",
                   help="compare with this baseline (no FILE: the newest for this device and model on this host)")
    p.add_argument("--threshold", type=float, default=0.15, help="slowdown that counts (default 0.15)")
    p.add_argument("--json", action="store_true", help="print the run as JSON instead of a table")


def _batches(text: str) -> tuple[int, ...]:
    from polychip.errors import ConfigError
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise ConfigError(f"--decode-batches: expected comma-separated positive integers, got {text!r}")
    return vals


def measure_run(args) -> dict:
    """Open the device, capture and time the model's ops, and return the run as a baseline dict."""
    from polychip.bench import op_baseline, op_capture, op_timing
    from polychip.devices.discovery import open_device
    from polychip.errors import ConfigError
    from polychip.ops.passes import dtype_name
    from polychip.package.compat import current_versions
    if (min(args.prefill_chunk, args.decode_context, args.rounds) < 1 or not 0 < args.threshold < 10
            or not 0 < args.sample_ms <= 10_000):
        raise ConfigError("--prefill-chunk, --decode-context and --rounds must be >= 1, --threshold in (0, 10), "
                          "--sample-ms in (0, 10000]")
    batches = _batches(args.decode_batches)
    plugin = open_device(args.device, tuple(args.plugins), args.device_config, num_threads=args.num_threads)
    try:
        work = op_capture.capture(plugin, args.model_path, args.dtype, args.prefill_chunk, batches,
                                  args.decode_context)
        try:
            measures = op_timing.measure(work, plugin.synchronize, args.rounds, args.sample_ms / 1e3)
        finally:
            op_capture.release(plugin, work)
        model = {"path": args.model_path, "architecture": work.model.config.architecture,
                 "dtype": dtype_name(work.model.dtype)}
        settings = {"prefill_chunk": args.prefill_chunk, "decode_batches": list(batches),
                    "decode_context": args.decode_context}
        return op_baseline.result(plugin, model, settings, current_versions(plugin), measures)
    finally:
        plugin.destroy()


def table(run: dict) -> list[str]:
    rows = [(("step " if m["kind"] == "step" else "") + (m["op"] if m["kind"] == "op" else ""), m["phase"],
             f"{m['median_s'] * 1e3:.3f}", f"{m['spread']:.0%}", str(m["calls"]), m["implementation"])
            for m in run["measures"]]
    cols = ("measure", "phase", "ms/forward", "spread", "calls", "implementation")
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    versions = ", ".join(f"{k}={v}" for k, v in run["versions"]["device"].items())
    return [f"{run['device']}  model {run['model']['architecture']} ({run['model']['path'] or 'embedded'}, "
            f"{run['model']['dtype']})  versions: {versions or '-'}", fmt(cols)] + [fmt(r) for r in rows]


def run_ops(args) -> int:
    from polychip.bench import op_baseline
    from polychip.commands.common import fail
    try:
        run = measure_run(args)
        base = None
        if args.baseline is not None:
            path = args.baseline or str(op_baseline.newest_for(run["device"], run["model"]["path"]))
            base = op_baseline.load(path)
            changes, versions, lonely = op_baseline.compare(base, run, args.threshold)
    except PolychipError as e:
        fail(e)
        return 2
    print(json.dumps(run, indent=2) if args.json else "\n".join(table(run)))
    regressed = False
    if base is not None:
        print(f"\ncompared with {path} (saved {base.get('created')} on {base.get('host')}):")
        print("\n".join(op_baseline.report(changes, versions, lonely, args.threshold)))
        regressed = any(c.regressed for c in changes)
    if args.save is not None and not regressed:
        saved = op_baseline.save(run, None if args.save == SAVE_DEFAULT else args.save)
        print(f"baseline saved: {saved}")
    elif args.save is not None:
        print("baseline not saved: this run regressed")
    return 1 if regressed else 0
