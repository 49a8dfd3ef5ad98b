"""polychip bench serving | compare | peers | plot | ops

  serving  drive any OpenAI-compatible server over a concurrency sweep (JSON, markdown, PNG)
  compare  flag regressions of a new serving result against a baseline
  peers    polychip, transformers and llama.cpp on the same prompts, against the rooflines
  plot     one PNG from several serving results (one line per engine)
  ops      each op of a model's plan timed on a device, saved as a baseline or compared with one
           (the driver-upgrade gate, docs/upgrades.md)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from polychip.commands import bench_ops
from polychip.dtypes import KV_CACHE_DTYPES
from polychip.flags import Parser


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _serving_parser(sub) -> None:
    p = sub.add_parser("serving", help="benchmark an OpenAI-compatible server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000 (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per concurrency step (default: as many as the concurrency, one wave)")
    p.add_argument("--input-len", type=int, default=800)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--dataset", nargs="+", default=["synthetic"], metavar=("KIND", "FILE"),
                   help="synthetic | sharegpt-like FILE (JSON or JSONL)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens shared by all synthetic prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="model path whose tokenizer sizes prompts (default: embedded SmolLM2)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos/min_tokens")
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache (SGLang's) before each concurrency step: a run repeated with the same "
                        "--seed sends the same prompts and would start on their cached prefixes")
    p.add_argument("--label", default=None, help="engine name in tables and plots (default: the model name)")
    p.add_argument("--out-dir", default="bench_results", help="where the JSON, markdown and PNG go")
    p.add_argument("--name", default=None, help="file stem (default: serving-<label>-<time>)")
    p.add_argument("--plot-with", nargs="*", default=[], help="other serving JSONs to draw in the same plot")
    p.add_argument("--no-progress", action="store_true")


def _requests_factory(args):
    from polychip.bench import datasets
    tok = datasets.load_tokenizer(args.tokenizer)
    kind = args.dataset[0]
    cache: dict[int, list] = {}

    def requests_for(concurrency: int):
        n = args.num_prompts or concurrency
        if n not in cache:
            if kind == "synthetic":   # fresh prompts per step: no prefix-cache hits across steps
                cache[n] = datasets.synthetic(tok, n, args.input_len, args.output_len, args.seed * 7919 + n,
                                              args.shared_prefix_len)
            else:
                cache[n] = datasets.sharegpt_like(tok, args.dataset[1], n, args.input_len, args.output_len, args.seed)
        return cache[n]
    return requests_for


def run_serving(args) -> int:
    from polychip.bench import report, serving_roofline
    from polychip.bench.plot import plot_sweeps
    from polychip.bench.serving import ServingConfig, run_sweep
    kind = args.dataset[0]
    if kind not in ("synthetic", "sharegpt-like") or (kind == "sharegpt-like") != (len(args.dataset) == 2):
        print("error: --dataset is `synthetic` or `sharegpt-like FILE`", file=sys.stderr)
        return 2
    cfg = ServingConfig(args.base_url, args.model, args.api_key, not args.no_ignore_eos, progress=not args.no_progress,
                        flush_cache=args.flush_cache)
    roof, why = (None, "prompts of varying lengths (only --dataset synthetic has a roofline)") if kind != "synthetic" \
        else serving_roofline.prepare(args.base_url, args.api_key)
    if roof is not None:
        serving_roofline.measure(roof)
    result = run_sweep(cfg, _requests_factory(args), args.concurrency)
    if roof is not None:
        serving_roofline.measure(roof)
        result["roofline"] = serving_roofline.rate(result, roof, args.input_len, args.output_len)
    else:
        result["roofline"] = {"none": why}
    result.update(label=args.label or result["model"], base_url=args.base_url, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                  config={k: v for k, v in vars(args).items() if k not in ("api_key", "func")})
    stem = args.name or f"serving-{result['label'].replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
    base = os.path.join(args.out_dir, stem)
    report.save_json(result, base + ".json")
    others = [report.load_json(p) for p in args.plot_with]
    png = plot_sweeps([result] + others, base + ".png",
                      f"{args.input_len} in / {args.output_len} out ({kind})")
    text = f"## {result['label']} ({args.base_url})\n\n{report.serving_table(result)}\n\n{report.roofline_line(result)}\n"
    stages = report.stage_table(result)
    if stages:
        text += f"\nEngine time per stage (server /metrics):\n\n{stages}\n"
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    print(f"wrote {base}.json, {base}.md, {png}")
    return 1 if any(s["completed"] == 0 for s in result["steps"]) else 0


def run_compare(args) -> int:
    from polychip.bench import report
    from polychip.bench.compare import compare, format_changes
    old, new = report.load_json(args.old), report.load_json(args.new)
    changes = compare(old, new, args.threshold)
    if not changes:
        print("no concurrency step in common", file=sys.stderr)
        return 2
    print(format_changes(changes, only_flagged=args.only_regressions))
    bad = [c for c in changes if c.regression]
    print(f"\n{len(bad)} regression(s) beyond {100 * args.threshold:.0f}% "
          f"({old.get('label', args.old)} -> {new.get('label', args.new)})")
    return 1 if bad else 0


def _open_peers_device(device: str):
    """The plugin ``--device`` names, or None after printing why it cannot be opened."""
    from polychip.devices.discovery import open_device
    from polychip.errors import PolychipError
    try:
        return open_device(device)
    except PolychipError as e:
        print(f"error: --device {device!r} cannot be opened: {e}", file=sys.stderr)
        return None


def run_peers_cmd(args) -> int:
    import torch

    from polychip.bench import report
    from polychip.bench.peer_targets import targets_report
    from polychip.bench.peers import ENGINES, PeersConfig, peers_table, run_peers
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    unknown = set(engines) - set(ENGINES)
    if unknown:
        print(f"error: unknown engine(s) {sorted(unknown)}; known: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    cfg = PeersConfig(args.model_path, args.input_len, args.output_len, args.concurrency, args.num_prompts,
                      args.decode_tokens, args.shared_prefix_len, engines, args.seed, args.device,
                      args.kv_cache_dtype)
    plugin = _open_peers_device(args.device)
    if plugin is None:
        return 2
    try:
        res = run_peers(cfg, plugin)
    finally:
        plugin.destroy()
    text = f"{peers_table(res)}\n\nTargets:\n\n{targets_report(res)}\n"
    st = res["engines"].get("polychip", {}).get("stage_seconds")
    if st:
        total = sum(st.values())
        text += "\npolychip engine time by stage (workload run): " + ", ".join(
            f"{k} {v:.2f} s ({100 * v / total:.1f}%)" for k, v in st.items()) + "\n"
    print(text)
    if args.json:
        report.save_json(res, args.json)
        with open(os.path.splitext(args.json)[0] + ".md", "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.json}")
    return 0


def _peers_parser(sub) -> None:
    p = sub.add_parser("peers", help="polychip vs transformers and llama.cpp on the same prompts")
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2 GGUF)")
    p.add_argument("--input-len", type=int, default=800)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=None, help="default: one wave of --concurrency")
    p.add_argument("--decode-tokens", type=int, default=64, help="single-stream decode length")
    p.add_argument("--shared-prefix-len", type=int, default=700, help="prefix-cache check (0: skip)")
    p.add_argument("--engines", default="polychip,polychip-int8,hf-naive,hf-static,llama.cpp")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="where polychip, transformers and the rooflines run: cpu, cuda[:N] or a plugin name "
                        "(llama.cpp only runs on cpu)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                   help="polychip's KV pool dtype (its engines' --kv-cache-dtype; their rooflines count it)")
    p.add_argument("--json", default=None, help="write the result here (and a .md beside it)")


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    _serving_parser(sub)
    c = sub.add_parser("compare", help="flag regressions of NEW against OLD (serving JSONs)")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--threshold", type=float, default=0.10, help="relative change that counts (default 0.10)")
    c.add_argument("--only-regressions", action="store_true")
    _peers_parser(sub)
    pl = sub.add_parser("plot", help="one PNG from several serving JSONs")
    pl.add_argument("results", nargs="+")
    pl.add_argument("-o", "--output", required=True)
    pl.add_argument("--title", default="")
    bench_ops.add_parser(sub)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one line per request otherwise
    if args.cmd == "serving":
        return run_serving(args)
    if args.cmd == "compare":
        return run_compare(args)
    if args.cmd == "peers":
        return run_peers_cmd(args)
    if args.cmd == "ops":
        return bench_ops.run_ops(args)
    from polychip.bench import report
    from polychip.bench.plot import plot_sweeps
    print(plot_sweeps([report.load_json(f) for f in args.results], args.output, args.title))
    return 0
