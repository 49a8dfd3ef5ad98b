"""polychip coverage [--model-path M] --device D: which implementation each op of a model uses.

The op list comes from one real forward (a short prefill) with a recording registry: every op the
forward calls, the dtype it was resolved for, and plugin or native fallback with the reason.
"""
from __future__ import annotations

import json
import sys

from polychip.commands.common import fail
from polychip.config import QUANTIZATIONS
from polychip.devices.ops import QUANT_OPS
from polychip.engine.coverage import coverage_rows, unavailable_text
from polychip.errors import PolychipError
from polychip.flags import Parser

def format_table(rows: list[dict]) -> str:
    cols = ("op", "version", "dtype", "calls", "implementation", "reason")
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(cols), fmt(["-" * w for w in widths])] + [fmt(row) for row in cells])


def scheme_line(scheme: str, rows: list[dict], plugin) -> str:
    """Which implementation the quantisation scheme's ops get on this device, and why."""
    ops = [r for r in rows if r["op"] in QUANT_OPS]
    native = all(r["implementation"] != "native" for r in ops)
    head = f"quantization {scheme}: " + (f"run natively by {plugin.name}" if native else
                                         f"not all run by {plugin.name} (--strict refuses it)")
    return head + "; " + "; ".join(f"{r['op']} -> {r['implementation']} ({r['reason']})" for r in ops)


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip coverage", description=__doc__)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--device", required=True, help="auto | cpu | cuda | <plugin>[:index]")
    p.add_argument("--plugin", action="append", default=[], dest="plugins")
    p.add_argument("--device-config", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--disable-fusion", action="store_true")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="as serve's: a float model int8 or w8a8, else the checkpoint's own scheme (default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        rows, lm, plugin, registry = coverage_rows(args.model_path, args.device, args.plugins, args.device_config,
                                         args.dtype, not args.disable_fusion, args.quantization)
    except PolychipError as e:
        return fail(e)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    n_fb = sum(r["implementation"] == "native" for r in rows)
    print(f"model {lm.config.architecture} ({lm.model_dir}), dtype {str(lm.dtype).removeprefix('torch.')}, "
          f"device {plugin.name}:{plugin.index}, fusions {lm.fusions}")
    print(format_table(rows))
    if lm.quantization:
        print(scheme_line(lm.quantization, rows, plugin))
    if registry.unavailable():
        print(f"ops {plugin.name} cannot provide here: {unavailable_text(registry)}")
    print(f"{len(rows)} ops used by one forward: {len(rows) - n_fb} from the plugin, {n_fb} native fallback",
          file=sys.stderr)
    return 0
