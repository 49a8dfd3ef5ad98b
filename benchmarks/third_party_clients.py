"""Three benchmark clients against one server: GuideLLM and AIPerf (third parties, from the tool
virtualenv ``.venv-bench``: ``make bench-tools``) and our ``polychip bench serving``, on one workload:
the same prompts of exactly ``--input-len`` tokens (one list, written in each client's file format by
``client_workload.py``), the same request fields (greedy, ``ignore_eos`` and ``min_tokens`` for exactly
``--output-len`` tokens, streamed ``/v1/completions`` with usage), every client counting the server's
usage, and before each client run a warm-up request (a prompt of the same length that no client sends,
timed here: the server's own speed then) and a flushed prefix cache. Each client runs in its lightest mode, ``--repeats`` times per concurrency in
a balanced order (A B C C B A: the server's drift lands on every client alike, ``client_rounds.py``), and
each figure is the mean of what the client itself reported over its runs.

    .venv/bin/python benchmarks/third_party_clients.py --server polychip --server-cpus 0 --client-cpus 1
    .venv/bin/python benchmarks/third_party_clients.py --server llama.cpp --concurrency 1,4 --requests 1,4

``--server polychip`` starts ``polychip serve`` (the embedded SmolLM2 GGUF, int8 weights and a
bfloat16 KV cache unless ``--serve-args`` says otherwise); ``--server llama.cpp`` starts
llama-cpp-python's own OpenAI server (``polychip[llamacpp]``) on the same GGUF. ``--server-cpus`` and
``--client-cpus`` pin the two apart (on 2 cores a client next to the server slows what it measures).
Prints per concurrency and client the output tokens/s, mean TTFT and inter-token latency, the CPU the
client and the server used and the time the hypervisor took from the server's cores, then per client the
means over its runs, the spread of the clients' means (max / min - 1), and the runs paired by pass
(``client_rounds.paired``) beside the server's own drift.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from polychip.bench.datasets import load_tokenizer
from client_rounds import balanced_order, paired, paired_report, report, runs_table, summarise
from client_workload import (CpuSampler, busy_share, cpu_seconds, measured_and_warm_prompts, steal_seconds,
                             timed_request, write_datasets)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCH_BIN = os.path.join(ROOT, ".venv-bench", "bin")
MODEL_NAME = "smollm2"


def local_model() -> tuple[str, str]:
    """(the GGUF file, the HF folder converted from it: its tokenizer is what the clients count with)."""
    from polychip.models import gguf
    from polychip.models.loader import resolve_model_dir
    return gguf.default_gguf_path(), resolve_model_dir(None)[0]


def server_command(kind: str, port: int, gguf_path: str, serve_args: str, threads: int) -> list[str]:
    if kind == "polychip":
        args = shlex.split(serve_args)
        return [os.path.join(ROOT, ".venv", "bin", "polychip"), "serve", "--port", str(port),
                "--served-model-name", MODEL_NAME, *args, *([] if "--num-threads" in args else ["--num-threads", str(threads)])]
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path, "--model_alias", MODEL_NAME,
            "--port", str(port), "--n_ctx", "4096", "--n_threads", str(threads), "--n_batch", "512",
            # by default a new request cuts the one being served short: at concurrency > 1 the clients
            # would count truncated answers (aiperf saw 519 of 4,096 tokens at 16); queue them instead
            "--interrupt_requests", "False"]


def start_server(kind: str, port: int, gguf_path: str, serve_args: str, log, cpus: set[int] | None = None) -> subprocess.Popen:
    """The server, on ``cpus`` (all by default) with as many compute threads as it has cores there."""
    threads = len(cpus) if cpus else (os.cpu_count() or 1)
    cmd = server_command(kind, port, gguf_path, serve_args, threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
        except httpx.HTTPError:
            time.sleep(1)
            continue
        post(f"http://127.0.0.1:{port}", "/v1/completions", {"model": MODEL_NAME, "prompt": "Hello, hello.", "max_tokens": 8})
        return proc      # answered, and warmed: a first request's one-time costs are no client's figure
    proc.kill()
    raise SystemExit(f"{kind} server did not answer in 300 s")


def client_env() -> dict:
    # AIPerf in HF offline mode reads a tokenizer name as a hub id in the cache, never as a folder: the
    # clients get the folder's path with offline mode off (a local folder loads without the network)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["GUIDELLM__MAX_WORKER_PROCESSES"] = "1"     # its lightest mode: one worker process, async inside
    return env


SAMPLER: list[CpuSampler] = []       # the sampler of the client run in progress, if any


def run(cmd: list[str], log, env: dict | None = None) -> None:
    log.write(("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**client_env(), **(env or {})})
    if SAMPLER:
        SAMPLER[0].client_pid = proc.pid
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:      # interrupted: the client goes with the script
            proc.kill()
            proc.wait()
    if code:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def ours(url, tok, c, n, a, data, out, log) -> dict:
    run([os.path.join(ROOT, ".venv", "bin", "polychip"), "bench", "serving", "--base-url", url, "--model", MODEL_NAME,
         "--concurrency", str(c), "--num-prompts", str(n), "--input-len", str(a.input_len), "--output-len",
         str(a.output_len), "--dataset", "sharegpt-like", data["ours"], "--tokenizer", tok,
         "--out-dir", out, "--name", "ours", "--no-progress", "--seed", "0"], log)
    return ours_figures(json.load(open(os.path.join(out, "ours.json")))["steps"][0])


def ours_figures(step: dict) -> dict:
    # its tpot_ms is per request (latency - TTFT) / (tokens - 1), AIPerf's and GuideLLM's ITL definition; its
    # itl_ms pools every gap between chunks (the same at one token a chunk and equal lengths), kept beside
    return {"output_tok_s": step["output_throughput"], "ttft_ms": step["ttft_ms"]["mean"],
            "itl_ms": step["tpot_ms"]["mean"], "pooled_itl_ms": step["itl_ms"]["mean"], "completed": step["completed"],
            "output_tokens": step["output_tokens"], "input_tokens": step["input_tokens"], "duration_s": step["duration_s"]}


def aiperf_command(url, tok, c, n, a, data, out) -> list[str]:
    return [os.path.join(BENCH_BIN, "aiperf"), "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type",
         "completions", "--streaming", "--tokenizer", tok, "--concurrency", str(c), "--request-count", str(n),
         "--input-file", data["aiperf"], "--custom-dataset-type", "single_turn",
         "--dataset-sampling-strategy", "sequential",
         # the server's usage where it sends one (llama-cpp-python's streams carry none: AIPerf then
         # reports no throughput), else AIPerf re-tokenises the streamed text (2,027 of 2,048 in run A)
         *(["--use-server-token-count"] if getattr(a, "server_usage", True) else []),
         # greedy as ours sends it: without it the server samples at its default temperature (1.0), which
         # cost ~1 ms a token more at concurrency 1 and 16% more server CPU at 16 (run Q1 in docs/bench)
         "--extra-inputs", "temperature:0.0",
         "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{a.output_len}",
         # its lightest mode: one worker, one record processor, no polling of the server's /metrics
         "--workers-max", "1", "--record-processors", "1", "--no-server-metrics",
         "--random-seed", "0", "--output-artifact-dir", out, "--ui-type", "none"]


def aiperf(url, tok, c, n, a, data, out, log) -> dict:
    # AIPerf leaves its dataset's memory map (aiperf_mmap_<id>/) and its ipc sockets' folder (tmpXXX/aiperf/)
    # in the temp folder after every run: it gets a temp folder of its own, removed after the run
    scratch = tempfile.mkdtemp(prefix="aiperf-run-")     # short: ipc socket paths must fit in 107 bytes
    try:
        run(aiperf_command(url, tok, c, n, a, data, out), log,
            env={"TMPDIR": scratch, "AIPERF_DATASET_MMAP_BASE_PATH": scratch})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    found = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.endswith("aiperf.json")]
    return aiperf_figures(json.load(open(found[0])))


def aiperf_figures(m: dict) -> dict:
    """output_token_throughput = total output tokens / (last response - first request)."""
    avg = lambda name: m.get(name, {}).get("avg")  # noqa: E731
    return {"output_tok_s": avg("output_token_throughput"), "ttft_ms": avg("time_to_first_token"),
            "itl_ms": avg("inter_token_latency"), "completed": avg("request_count"),
            "output_tokens": avg("total_output_tokens"), "input_tokens": avg("total_isl"),
            "duration_s": avg("benchmark_duration")}      # its JSON gives seconds


def guidellm(url, tok, c, n, a, data, out, log) -> dict:
    path = os.path.join(out, "guidellm.json")
    run([os.path.join(BENCH_BIN, "guidellm"), "run",
         "--backend", f"kind=openai_http,target={url},model={MODEL_NAME},request_format=/v1/completions,validate_backend=false,"
                      f"extras.body.min_tokens={a.output_len},extras.body.temperature=0.0",    # greedy, as the others
         "--profile", f"kind=concurrent,streams[0]={c}", "--constraint", f"kind=max_requests,count={n}",
         "--data", f"kind=json_file,path={data['guidellm']}",
         "--tokenizer", f"kind=hf_auto,model={tok}", "--seed", "kind=static,value=0",
         "--output", f"kind=json,path={path}", "--disable-progress"], log)
    return guidellm_figures(json.load(open(path)))


def guidellm_figures(report: dict) -> dict:
    """output_tokens_per_second's mean is weighted by time: its output tokens / its measured window."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    mean = lambda name: metrics[name]["successful"]["mean"]  # noqa: E731
    total = lambda name: (metrics.get(name) or {}).get("successful", {}).get("total_sum")  # noqa: E731
    return {"output_tok_s": mean("output_tokens_per_second"), "ttft_ms": mean("time_to_first_token_ms"),
            "itl_ms": mean("inter_token_latency_ms"), "completed": metrics["request_totals"]["successful"],
            "output_tokens": total("output_token_count"), "input_tokens": total("prompt_token_count"),
            "duration_s": bench.get("duration")}


def prepare(url: str, kind: str, warm_prompt: str, probe_tokens: int) -> dict:
    """Every client run starts on an equally warm and equally cold server: one greedy request of a full-length
    prompt that no client sends (the long-context path runs just before, whatever ran last), then polychip's
    prefix cache is flushed; llama-cpp-python keeps only the last prompt's tokens, which that request replaced.
    That request is timed here, with no client in the way: its TTFT and TPOT are the server's own speed just
    before the client run (the drift beside each client's figures; nothing is corrected by it)."""
    probe = timed_request(url, MODEL_NAME, warm_prompt, probe_tokens)
    if kind == "polychip":
        post(url, "/flush_cache", {})
    return {"probe_ttft_ms": probe["ttft_ms"], "probe_tpot_ms": probe["tpot_ms"]}


def post(url: str, path: str, body: dict) -> bytes:
    r = httpx.post(url + path, json=body, timeout=120)
    r.raise_for_status()
    return r.content


def measured(fn, server_pid: int, server_cpus: set[int] | None, *args) -> dict:
    """The client's figures, its wall time, the CPU seconds it and the server spent meanwhile, and the
    seconds the hypervisor took from the server's cores (steal)."""
    before_client = resource.getrusage(resource.RUSAGE_CHILDREN)
    before_server, steal, t = cpu_seconds(server_pid), steal_seconds(server_cpus), time.time()
    with CpuSampler(server_pid) as sampler:
        SAMPLER[:] = [sampler]
        try:
            row = fn(*args)
        finally:
            SAMPLER.clear()
    after_client = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = lambda r: r.ru_utime + r.ru_stime  # noqa: E731
    server_cpu = cpu_seconds(server_pid) - before_server
    return {**row, "wall_s": round(time.time() - t, 1), "client_cpu_s": round(cpu(after_client) - cpu(before_client), 1),
            "server_cpu_s": round(server_cpu, 2),
            "server_cpu_ms_per_token": round(server_cpu * 1e3 / row["output_tokens"], 2) if row.get("output_tokens") else None,
            "server_steal_s": round(steal_seconds(server_cpus) - steal, 2),
            "while_server_busy": busy_share(sampler.samples)}


CLIENTS = {"polychip bench serving": ours, "aiperf": aiperf, "guidellm": guidellm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("polychip", "llama.cpp"), default="polychip")
    ap.add_argument("--serve-args", default="--quantization int8 --kv-cache-dtype bfloat16 --max-running-requests 16")
    ap.add_argument("--port", type=int, default=31999)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", default=None, help="requests per concurrency: one number, or one per --concurrency "
                    "(default: 8, and 16 from concurrency 16)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each client per concurrency (A B C C B A ...)")
    ap.add_argument("--probe-tokens", type=int, default=64, help="output tokens of the timed warm-up before each run")
    ap.add_argument("--input-len", type=int, default=800)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--server-cpus", default=None, help="cores for the server, e.g. 0 (default: all)")
    ap.add_argument("--client-cpus", default=None, help="cores for the clients and this script, e.g. 1 (default: all): "
                    "on a small machine a client on the server's cores slows the server it measures")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # a `timeout` still stops the server it started
    cpus = lambda text: {int(c) for c in text.split(",")} if text else None  # noqa: E731
    server_cpus, client_cpus = cpus(a.server_cpus), cpus(a.client_cpus)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)       # the clients inherit it
    gguf_path, tok = local_model()
    work = tempfile.mkdtemp(prefix="clients-")
    log = open(os.path.join(work, "log.txt"), "wb")
    print(f"log: {log.name}", flush=True)
    url = f"http://127.0.0.1:{a.port}"
    concurrencies = [int(c) for c in a.concurrency.split(",")]
    counts = [int(n) for n in a.requests.split(",")] if a.requests else [16 if c >= 16 else 8 for c in concurrencies]
    counts = counts * len(concurrencies) if len(counts) == 1 else counts
    if len(counts) != len(concurrencies):
        raise SystemExit(f"--requests gives {len(counts)} counts for {len(concurrencies)} concurrencies")
    a.server_usage = a.server == "polychip"      # whether its streams end with a usage record
    prompts, warm_prompt = measured_and_warm_prompts(load_tokenizer(tok), max(counts), a.input_len)
    proc = start_server(a.server, a.port, gguf_path, a.serve_args, log, server_cpus)
    rows = []
    try:
        for c, n in zip(concurrencies, counts):
            data = write_datasets(prompts[:n], a.output_len, os.path.join(work, f"data-{c}"))
            for run_index, name in enumerate(balanced_order(a.clients.split(","), a.repeats)):
                out = tempfile.mkdtemp(dir=work)
                probe = prepare(url, a.server, warm_prompt, a.probe_tokens)
                load = os.getloadavg()[0]
                row = {"server": a.server, "client": name, "concurrency": c, "requests": n, "run": run_index, **probe,
                       **measured(CLIENTS[name], proc.pid, server_cpus, url, tok, c, n, a, data, out, log),
                       "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    except SystemExit as stop:      # a `timeout`: what ran so far is still summed up (an incomplete pass unpaired)
        print(f"stopped ({stop.code}) after {len(rows)} runs", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    summary, pairs = summarise(rows), paired(rows, len(a.clients.split(",")))
    print("\n".join([runs_table(rows), "", report(summary), "", paired_report(pairs)]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "paired": pairs}, f, indent=1)


if __name__ == "__main__":
    main()
