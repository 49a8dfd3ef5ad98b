"""``polychip bench peers``: polychip and its peers on the same prompts in one process run, as
ratios and as percentages of the rooflines measured in that same run."""
from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import dataclass, replace

import torch

from polychip.bench import roofline as rl
from polychip.devices import boundary
from polychip.bench.peer_engines import LlamaCppPeer, PolychipPeer, TransformersPeer, WorkloadRun

log = logging.getLogger("polychip.bench")

# polychip-int8: the same engine with --quantization int8 (its rooflines are of its int8 weights);
# polychip-w8a8: with --quantization w8a8 (int8 activations too: its matmuls at the measured int8 rate)
ENGINES = ("polychip", "polychip-int8", "polychip-w8a8", "hf-naive", "hf-static", "llama.cpp")
QUANTIZED = {"polychip-int8": "int8", "polychip-w8a8": "w8a8"}
# the read measured just before and after each engine's single stream (MiB of one buffer for the run,
# repetitions): a shared machine's bandwidth can move between levels for tens of seconds at a time
# (docs/bench/perf-round4-cpu.md, Zen 4), and a one-second run falls in one of them
WINDOW_READ = (256, 3)


@dataclass
class PeersConfig:
    model_path: str | None = None
    input_len: int = 800
    output_len: int = 128
    concurrency: int = 16
    num_prompts: int | None = None          # None: one wave of ``concurrency``
    decode_tokens: int = 64                 # single-stream decode length
    shared_prefix_len: int = 700            # 0: skip the prefix-cache check
    engines: tuple[str, ...] = ENGINES
    seed: int = 0
    device: str = "cpu"                     # polychip, transformers and the rooflines run here
    kv_cache_dtype: str = "auto"            # polychip's --kv-cache-dtype (auto: float32, as its weights)


def random_prompts(n: int, length: int, vocab: int, rng: random.Random, prefix: list[int] = ()) -> list[list[int]]:
    hi = int(vocab * 0.9)
    return [list(prefix) + [rng.randrange(1, hi) for _ in range(length - len(prefix))] for _ in range(n)]


def _model_files(model_path: str | None) -> tuple[str, str | None]:
    """(HF folder for transformers, GGUF file for llama.cpp or None)."""
    import os
    from polychip.models import gguf
    from polychip.models.loader import resolve_model_dir
    folder, _ = resolve_model_dir(model_path)
    if model_path is None:
        return folder, gguf.default_gguf_path()
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return folder, model_path
    return folder, None


def _make(name: str, cfg: PeersConfig, folder: str, gguf_path: str | None, plugin):
    if name == "polychip":
        return PolychipPeer(cfg.model_path, cfg.device, max_running_requests=max(cfg.concurrency, 1),
                            kv_cache_dtype=cfg.kv_cache_dtype)
    if name in QUANTIZED:
        return PolychipPeer(cfg.model_path, cfg.device, max_running_requests=max(cfg.concurrency, 1),
                            quantization=QUANTIZED[name], kv_cache_dtype=cfg.kv_cache_dtype)
    if name in ("hf-naive", "hf-static"):
        return TransformersPeer(folder, name == "hf-static", plugin)
    if name == "llama.cpp":
        if gguf_path is None:
            raise RuntimeError("llama.cpp needs a .gguf --model-path")
        max_len = cfg.input_len + cfg.output_len + 8
        return LlamaCppPeer(gguf_path, max(cfg.concurrency, 1), max_len, torch.get_num_threads())
    raise ValueError(f"unknown engine {name!r}; known: {ENGINES}")


def gguf_weight_bytes(gguf_path: str) -> int:
    """Bytes of the weights llama.cpp reads per forward, as the file stores them (Q4_1 blocks and
    their scales, ...): every tensor, less the embedding when an output matrix of its own exists
    (a tied model's output matrix is the embedding)."""
    from gguf import GGUFReader
    tensors = GGUFReader(gguf_path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def storage_of(name: str, cfg: PeersConfig, gguf_path: str | None) -> rl.Storage:
    """How engine ``name`` stores its weights and KV cache: its own roofline's bytes."""
    from polychip.dtypes import KV_CACHE_DTYPES
    kv = KV_CACHE_DTYPES[cfg.kv_cache_dtype] or "float32"      # polychip runs float32: auto is float32
    if name == "polychip" or name in QUANTIZED:
        return rl.polychip_storage("float32", kv, QUANTIZED.get(name))
    if name == "llama.cpp" and gguf_path:
        nbytes = gguf_weight_bytes(gguf_path)
        return rl.Storage(f"GGUF weights as stored ({nbytes / 1e6:.1f} MB), float16 KV", kv_bytes=2,
                          file_weight_bytes=nbytes)
    return rl.Storage("float32 weights, float32 KV")           # transformers: its dtype for both


def device_label(plugin) -> str:
    """'cuda:0 (NVIDIA H200)': the torch device and, where the plugin names it, the hardware."""
    handle = str(plugin.device_handle())
    names = [i.name for i in boundary.devices(plugin) if i.index == plugin.index]
    return f"{handle} ({names[0]})" if names and names[0] else handle


def run_peers(cfg: PeersConfig, plugin=None) -> dict:
    """All engines on ``plugin`` (opened from ``cfg.device`` when None; llama.cpp only on the CPU)."""
    from polychip.devices.discovery import open_device
    own = plugin is None
    plugin = open_device(cfg.device) if own else plugin
    try:
        return _run_on(cfg, plugin)
    finally:
        if own:
            plugin.destroy()


def _skip_reason(name: str, plugin, gguf_path: str | None) -> str | None:
    if name != "llama.cpp":
        return None
    if plugin.name != "cpu":
        return f"a CPU peer; not run on --device {plugin.name}"
    return None if gguf_path else "needs a .gguf --model-path"


def _run_on(cfg: PeersConfig, plugin) -> dict:
    from polychip.models.loader import read_config
    folder, gguf_path = _model_files(cfg.model_path)
    mcfg = read_config(folder)
    shape = rl.ModelShape.from_config(mcfg)
    log.info("measuring %s (bandwidth, matmul at the model's shapes)", plugin.device_handle())
    int8 = "polychip-w8a8" in cfg.engines
    before = rl.measure_machine(shape, plugin=plugin, int8=int8)
    window = rl.read_buffer(WINDOW_READ[0], plugin=plugin)   # read around each single stream
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts or cfg.concurrency
    single = random_prompts(1, cfg.input_len, mcfg.vocab_size, rng)[0]
    prompts = random_prompts(n, cfg.input_len, mcfg.vocab_size, rng)
    engines, skipped = {}, {}
    for name in cfg.engines:
        why = _skip_reason(name, plugin, gguf_path)
        if why:
            skipped[name] = why
            log.warning("skipping %s: %s", name, skipped[name])
            continue
        log.info("engine %s: loading", name)
        try:
            eng = _make(name, cfg, folder, gguf_path, plugin)
        except ImportError as e:
            skipped[name] = f"not installed ({e.name or e}); `pip install polychip[llamacpp]`"
            log.warning("skipping %s: %s", name, skipped[name])
            continue
        try:
            row = {"engine": eng.name}
            log.info("engine %s: single stream (%d prompt, %d decode tokens)", name, cfg.input_len, cfg.decode_tokens)
            read_before = rl.measure_read(window, WINDOW_READ[1], plugin)
            row["prefill_tok_s"], row["decode_tok_s"] = eng.single_stream(single, cfg.decode_tokens)
            row["single_stream_read_gbs"] = max(read_before, rl.measure_read(window, WINDOW_READ[1], plugin))
            log.info("engine %s: %d x %d in / %d out at concurrency %d", name, n, cfg.input_len, cfg.output_len,
                     cfg.concurrency)
            run: WorkloadRun = eng.workload(prompts, cfg.output_len, cfg.concurrency)
            row.update(wall_s=run.wall_s, output_tokens=run.output_tokens, output_tok_s=run.output_tok_s,
                       mean_ttft_s=run.mean_ttft_s)
            if name == "polychip":
                row["stage_seconds"] = eng.stage_seconds()
                if cfg.shared_prefix_len:
                    row["shared_prefix"] = _shared_prefix_check(eng, cfg, mcfg.vocab_size, rng, run)
            engines[name] = row
            log.info("engine %s: %.1f output tok/s", name, run.output_tok_s)
        finally:
            eng.close()
            del eng
            gc.collect()
    del window
    after = rl.measure_machine(shape, plugin=plugin, int8=int8)
    # the machine's read ceiling: the best read of the run, the single streams' own reads included
    machine = rl.best_of(before, after)
    machine = replace(machine, bandwidth_gbs=max([machine.bandwidth_gbs] + [
        r["single_stream_read_gbs"] for r in engines.values() if r.get("single_stream_read_gbs")]))
    storages = {name: storage_of(name, cfg, gguf_path) for name in engines}
    res = _analyse(cfg, n, shape, machine, [before, after], engines, skipped, storages)
    res["device"] = device_label(plugin)
    return res


def _shared_prefix_check(eng, cfg: PeersConfig, vocab: int, rng, distinct: WorkloadRun) -> dict:
    """Two waves of prompts sharing one prefix (new suffixes each wave), against the distinct run:
    the cold wave computes the prefix once and shares it; the warm wave finds it already cached
    (a popular system prompt on a running server)."""
    k = min(cfg.shared_prefix_len, cfg.input_len - 1)
    prefix = random_prompts(1, k, vocab, rng)[0]
    waves = {}
    for wave in ("cold", "warm"):
        shared = random_prompts(len(distinct.ttft_s), cfg.input_len, vocab, rng, prefix)
        waves[wave] = eng.workload(shared, cfg.output_len, cfg.concurrency)
    cold, warm = waves["cold"], waves["warm"]
    return {"prefix_len": k, "distinct_mean_ttft_s": distinct.mean_ttft_s,
            "mean_ttft_s": cold.mean_ttft_s, "ttft_speedup": distinct.mean_ttft_s / cold.mean_ttft_s,
            "output_tok_s": cold.output_tok_s, "warm_mean_ttft_s": warm.mean_ttft_s,
            "warm_ttft_speedup": distinct.mean_ttft_s / warm.mean_ttft_s, "warm_output_tok_s": warm.output_tok_s}


def _analyse(cfg, n, shape, machine, measurements, engines, skipped, storages) -> dict:
    """Each engine against its own roofline (its storage), and against the weights-only one of before."""
    old = rl.weights_only_workload_seconds(shape, machine, n, cfg.input_len, cfg.output_len, cfg.concurrency)
    rooflines = {}
    for name, row in engines.items():
        st = storages.get(name, rl.FLOAT32)
        roof = rl.workload_seconds(shape, st, machine, n, cfg.input_len, cfg.output_len, cfg.concurrency)
        roof["single_stream_decode_tok_s"] = rl.single_stream_decode_ceiling(shape, st, machine, cfg.input_len,
                                                                             cfg.decode_tokens)
        roof["prefill_tok_s"] = rl.prefill_ceiling(shape, st, machine, cfg.input_len)
        rooflines[name] = roof
        row["pct_workload_roofline"] = 100 * row["output_tok_s"] / roof["output_tok_s"]
        row["pct_decode_roofline"] = 100 * row["decode_tok_s"] / roof["single_stream_decode_tok_s"]
        if row.get("single_stream_read_gbs"):   # the same run against the read of its own moment
            window = replace(machine, bandwidth_gbs=row["single_stream_read_gbs"])
            row["pct_decode_roofline_at_its_read"] = 100 * row["decode_tok_s"] / rl.single_stream_decode_ceiling(
                shape, st, window, cfg.input_len, cfg.decode_tokens)
        row["pct_prefill_roofline"] = 100 * row["prefill_tok_s"] / roof["prefill_tok_s"]
        row["pct_weights_only_workload_roofline"] = 100 * row["output_tok_s"] / old["output_tok_s"]
        row["pct_weights_only_decode_roofline"] = 100 * row["decode_tok_s"] / old["single_stream_decode_tok_s"]
    ratios = {}
    if "polychip" in engines:
        ours = engines["polychip"]["output_tok_s"]
        ratios = {k: ours / v["output_tok_s"] for k, v in engines.items() if k != "polychip"}
    return {"config": vars(cfg) | {"engines": list(cfg.engines), "num_prompts": n},
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "torch_threads": torch.get_num_threads(),
            "model": {"non_embedding_params": shape.non_embedding_params, "decode_params": shape.decode_params,
                      "decode_weight_bytes": shape.decode_weight_bytes},
            "machine": machine.as_dict(), "machine_measurements": [m.as_dict() for m in measurements],
            "rooflines": rooflines, "weights_only_roofline": old,
            "engines": engines, "ratios": ratios, "skipped": skipped}


def _f(x, d=1):
    return "-" if x is None else f"{x:.{d}f}"


def peers_table(res: dict) -> str:
    m, c = res["machine"], res["config"]
    device = res.get("device", m.get("device", "cpu"))      # results from before --device: the CPU
    old = res["weights_only_roofline"]
    windows = [r for r in res["engines"].values() if r.get("single_stream_read_gbs")]
    reads = len(res["machine_measurements"]) + 2 * len(windows)   # two reads around each single stream
    lines = [f"Machine ({device}, best of {len(res['machine_measurements'])} in this run, "
             f"{res['torch_threads']} threads; the read the best of {reads}): "
             f"read {m['bandwidth_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s, "
             f"matmul {m['matmul_gflops']:.1f} GFLOP/s at the model's shapes"
             + (f", W8A8 matmul {m['int8_gops']:.1f} int8 GOP/s" if m.get("int8_gops") else ""),
             f"Rooflines of {c['num_prompts']} x {c['input_len']} in / {c['output_len']} out at concurrency "
             f"{c['concurrency']}, each engine's own: every byte a step reads (weights as stored, the batch's KV "
             "at its length) and every FLOP (attention included), the slower limit per step:"]
    for key, roof in res["rooflines"].items():
        lines.append(f"- {res['engines'][key]['engine']} ({roof['storage']}): {roof['total_s']:.1f} s = "
                     f"{roof['output_tok_s']:.1f} out tok/s (prefill {roof['prefill_s']:.1f} s + decode "
                     f"{roof['decode_s']:.1f} s, {roof['bytes_read'] / 1e9:.1f} GB read); single-stream decode "
                     f"{roof['single_stream_decode_tok_s']:.1f} tok/s; prefill {roof['prefill_tok_s']:.0f} tok/s")
    lines += [f"- before issue 17 (float32 weights only, no KV, no attention FLOPs; the 'old' columns): "
              f"{old['output_tok_s']:.1f} out tok/s, single-stream decode {old['single_stream_decode_tok_s']:.1f} tok/s",
              "", "| engine | wall s | out tok/s | % workload roofline (old) | mean TTFT s | 1-stream prefill tok/s "
              "(% roof) | 1-stream decode tok/s (% roof, old) | polychip x |", "|" + "---|" * 8]
    for key, r in res["engines"].items():
        ratio = res["ratios"].get(key)
        lines.append(f"| {r['engine']} | {_f(r['wall_s'])} | {_f(r['output_tok_s'])} | "
                     f"{_f(r['pct_workload_roofline'])}% ({_f(r['pct_weights_only_workload_roofline'])}%) | "
                     f"{_f(r['mean_ttft_s'], 2)} | "
                     f"{_f(r['prefill_tok_s'], 0)} ({_f(r['pct_prefill_roofline'], 0)}%) | "
                     f"{_f(r['decode_tok_s'])} ({_f(r['pct_decode_roofline'], 0)}%, "
                     f"{_f(r['pct_weights_only_decode_roofline'], 0)}%) | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    for key, why in res["skipped"].items():
        lines.append(f"| {key} | skipped: {why} |||||||")
    if windows:
        lines += ["", f"Single-stream decode against the read measured just before and after each engine's run (the "
                      f"better of the two; the % columns above use this run's best, {m['bandwidth_gbs']:.1f} GB/s): "
                      + "; ".join(f"{r['engine']} {_f(r['decode_tok_s'])} tok/s at {r['single_stream_read_gbs']:.1f} "
                                  f"GB/s, {_f(r['pct_decode_roofline_at_its_read'], 0)}%" for r in windows)]
    if "polychip-int8" in res["engines"]:
        lines += ["", "polychip int8: weight-only int8 (--quantization int8); its % columns are of its own int8 "
                      "roofline, and the polychip x column is float32 over int8"]
    if "polychip-w8a8" in res["engines"]:
        lines += ["", "polychip w8a8: int8 weights and int8 activations quantised per token (--quantization w8a8, "
                      "not the float32 model's outputs); its roofline counts its matmuls at the W8A8 rate measured "
                      "above, and the polychip x column is float32 over w8a8"]
    return "\n".join(lines)
