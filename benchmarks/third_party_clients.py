"""Three benchmark clients against one server: GuideLLM and AIPerf (third parties, from the tool
virtualenv ``.venv-bench``: ``make bench-tools``) and our ``polychip bench serving``, on the same
synthetic load (random prompts of ``--input-len`` tokens, exactly ``--output-len`` output tokens:
each client asks for it with ``ignore_eos`` and ``min_tokens``), at each ``--concurrency``.

    .venv/bin/python benchmarks/third_party_clients.py --server polychip --json docs/bench/clients-polychip.json
    .venv/bin/python benchmarks/third_party_clients.py --server llama.cpp --concurrency 1,4 --requests 8

``--server polychip`` starts ``polychip serve`` (the embedded SmolLM2 GGUF, int8 weights and a
bfloat16 KV cache unless ``--serve-args`` says otherwise); ``--server llama.cpp`` starts
llama-cpp-python's own OpenAI server (``polychip[llamacpp]``) on the same GGUF. Every client reads
the local tokenizer (no download) and streams ``/v1/completions``. Prints per concurrency and client
the output tokens/s, mean TTFT and mean inter-token latency, and the spread of the three clients'
throughputs (max / min - 1).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCH_BIN = os.path.join(ROOT, ".venv-bench", "bin")
MODEL_NAME = "smollm2"


def local_model() -> tuple[str, str]:
    """(the GGUF file, the HF folder converted from it: its tokenizer is what the clients count with)."""
    from polychip.models import gguf
    from polychip.models.loader import resolve_model_dir
    return gguf.default_gguf_path(), resolve_model_dir(None)[0]


def start_server(kind: str, port: int, gguf_path: str, serve_args: str, log) -> subprocess.Popen:
    if kind == "polychip":
        cmd = [os.path.join(ROOT, ".venv", "bin", "polychip"), "serve", "--port", str(port),
               "--served-model-name", MODEL_NAME, *shlex.split(serve_args)]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path, "--model_alias", MODEL_NAME,
               "--port", str(port), "--n_ctx", "4096", "--n_threads", str(os.cpu_count()), "--n_batch", "512",
               # by default a new request cuts the one being served short: at concurrency > 1 the clients
               # would count truncated answers (aiperf saw 519 of 4,096 tokens at 16); queue them instead
               "--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
        except OSError:
            time.sleep(1)
            continue
        warm = json.dumps({"model": MODEL_NAME, "prompt": "Hello, hello, hello.", "max_tokens": 8}).encode()
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", warm,
                                                      {"Content-Type": "application/json"}), timeout=120).read()
        return proc      # answered, and warmed: a first request's one-time costs are no client's figure
    proc.kill()
    raise SystemExit(f"{kind} server did not answer in 300 s")


def run(cmd: list[str], log) -> None:
    log.write(("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n").encode())
    log.flush()
    # AIPerf in HF offline mode reads a tokenizer name as a hub id in the cache, never as a folder: the
    # clients get the folder's path with offline mode off (a local folder loads without the network)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, env=env)


def ours(url, tok, c, n, a, out, log) -> dict:
    run([os.path.join(ROOT, ".venv", "bin", "polychip"), "bench", "serving", "--base-url", url, "--model", MODEL_NAME,
         "--concurrency", str(c), "--num-prompts", str(n), "--input-len", str(a.input_len), "--output-len",
         str(a.output_len), "--out-dir", out, "--name", "ours", "--no-progress", "--seed", "0"], log)
    step = json.load(open(os.path.join(out, "ours.json")))["steps"][0]
    return {"output_tok_s": step["output_throughput"], "ttft_ms": step["ttft_ms"]["mean"],
            "itl_ms": step["itl_ms"]["mean"], "completed": step["completed"], "output_tokens": step["output_tokens"]}


def aiperf(url, tok, c, n, a, out, log) -> dict:
    run([os.path.join(BENCH_BIN, "aiperf"), "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type",
         "completions", "--streaming", "--tokenizer", tok, "--concurrency", str(c), "--request-count", str(n),
         "--prompt-input-tokens-mean", str(a.input_len), "--prompt-input-tokens-stddev", "0",
         "--prompt-output-tokens-mean", str(a.output_len), "--prompt-output-tokens-stddev", "0",
         "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{a.output_len}",
         "--random-seed", "0", "--output-artifact-dir", out, "--ui-type", "none"], log)
    found = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.endswith("aiperf.json")]
    m = json.load(open(found[0]))
    return {"output_tok_s": m["output_token_throughput"]["avg"], "ttft_ms": m["time_to_first_token"]["avg"],
            "itl_ms": m["inter_token_latency"]["avg"], "completed": m["request_count"]["avg"],
            "output_tokens": m.get("total_output_tokens", {}).get("avg")}


def guidellm(url, tok, c, n, a, out, log) -> dict:
    path = os.path.join(out, "guidellm.json")
    run([os.path.join(BENCH_BIN, "guidellm"), "run",
         "--backend", f"kind=openai_http,target={url},model={MODEL_NAME},request_format=/v1/completions,validate_backend=false,"
                      f"extras.body.min_tokens={a.output_len}",
         "--profile", f"kind=concurrent,streams[0]={c}", "--constraint", f"kind=max_requests,count={n}",
         "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},output_tokens={a.output_len}",
         "--tokenizer", f"kind=hf_auto,model={tok}", "--seed", "kind=static,value=0",
         "--output", f"kind=json,path={path}", "--disable-progress"], log)
    return guidellm_figures(json.load(open(path)))


def guidellm_figures(report: dict) -> dict:
    metrics = report["benchmarks"][0]["metrics"]

    def mean(name):
        return metrics[name]["successful"]["mean"]
    return {"output_tok_s": mean("output_tokens_per_second"), "ttft_ms": mean("time_to_first_token_ms"),
            "itl_ms": mean("inter_token_latency_ms"), "completed": metrics["request_totals"]["successful"],
            "output_tokens": None}


CLIENTS = {"polychip bench serving": ours, "aiperf": aiperf, "guidellm": guidellm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("polychip", "llama.cpp"), default="polychip")
    ap.add_argument("--serve-args", default="--quantization int8 --kv-cache-dtype bfloat16 --max-running-requests 16")
    ap.add_argument("--port", type=int, default=31999)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=None, help="requests per concurrency (default: 2 x concurrency, 2 to 16, "
                    "at least 2)")
    ap.add_argument("--input-len", type=int, default=800)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gguf_path, tok = local_model()
    work = tempfile.mkdtemp(prefix="clients-")
    log = open(os.path.join(work, "log.txt"), "wb")
    print(f"log: {log.name}", flush=True)
    url = f"http://127.0.0.1:{a.port}"
    proc = start_server(a.server, a.port, gguf_path, a.serve_args, log)
    rows = []
    try:
        for c in map(int, a.concurrency.split(",")):
            n = a.requests or max(2, min(2 * c, 16))
            for name in a.clients.split(","):
                out = tempfile.mkdtemp(dir=work)
                load = os.getloadavg()[0]
                t = time.time()
                row = {"server": a.server, "client": name, "concurrency": c, "requests": n,
                       **CLIENTS[name](url, tok, c, n, a, out, log), "wall_s": round(time.time() - t, 1),
                       "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        proc.terminate()
        proc.wait(30)
    for c in sorted({r["concurrency"] for r in rows}):
        rates = [r["output_tok_s"] for r in rows if r["concurrency"] == c]
        print(f"concurrency {c}: client spread {max(rates) / min(rates) - 1:.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
