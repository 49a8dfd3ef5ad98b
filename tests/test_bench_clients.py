"""GuideLLM and AIPerf, from the tool virtualenv ``make bench-tools`` builds, against ``polychip
serve``: each streams the prompts of one shared dataset through /v1/completions, gets exactly the
output tokens it asked for, and benchmarks/third_party_clients.py reads its report. Against a
recording server, the three clients send the same prompts in the same order with the same sampling
fields (a client that leaves the temperature to the server makes it sample instead of decoding greedily)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from conftest import make_hf_model

from polychip.bench.datasets import load_tokenizer
from polychip.http.launcher import ServerProcess

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import third_party_clients as clients  # noqa: E402  (benchmarks/ is not a package)
from client_workload import exact_prompts, write_datasets  # noqa: E402

pytestmark = pytest.mark.device_independent     # the server's API, on the cpu
if not os.path.exists(os.path.join(clients.BENCH_BIN, "guidellm")):
    pytest.skip("no .venv-bench: `make bench-tools` builds it (`make test` does)", allow_module_level=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_hf_model(str(tmp_path_factory.mktemp("clients")), "llama", tie=True)


@pytest.fixture(scope="module")
def served(model_path):
    with ServerProcess(["--model-path", model_path, "--served-model-name", clients.MODEL_NAME, "--device", "cpu",
                        "--max-total-tokens", "2048"]) as s:
        yield s


def dataset(model_path, folder, n, load) -> tuple[list[str], dict]:
    prompts = exact_prompts(load_tokenizer(model_path), n, load.input_len)
    return prompts, write_datasets(prompts, load.output_len, str(folder))


def aiperf_leftovers() -> set[str]:
    """What AIPerf runs leave in the temp folder: its datasets' memory maps (aiperf_mmap_<id>), its ipc
    sockets' folders (tmpXXXX/aiperf) and the script's own scratch folder for it (aiperf-run-XXXX)."""
    top = tempfile.gettempdir()
    return {name for name in os.listdir(top)
            if name.startswith("aiperf") or os.path.isdir(os.path.join(top, name, "aiperf"))}


@pytest.mark.parametrize("client", ["aiperf", "guidellm"])
def test_third_party_client_counts_what_it_asked_for_and_leaves_no_temp_files(served, model_path, client, tmp_path):
    load = SimpleNamespace(input_len=48, output_len=12)
    _, data = dataset(model_path, tmp_path / "data", 4, load)
    before = aiperf_leftovers()
    with open(tmp_path / "log.txt", "wb") as log:
        got = clients.CLIENTS[client](served.url, model_path, 2, 4, load, data, str(tmp_path), log)
    assert got["completed"] == 4, got
    assert got["output_tok_s"] > 0 and got["ttft_ms"] > 0 and got["itl_ms"] > 0 and got["duration_s"] > 0, got
    assert got["output_tokens"] == 4 * 12, got     # the server's usage, not a re-tokenization of the text
    assert aiperf_leftovers() - before == set()     # AIPerf's memory map and ipc folder went with its run


class Recorder(BaseHTTPRequestHandler):
    """An OpenAI completions stand-in: records each request body, streams max_tokens chunks and usage."""
    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []
    paths: list[str] = []

    def log_message(self, *args):
        pass

    def reply(self, content_type: str, payload: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        self.reply("application/json", json.dumps({"object": "list", "data": [{"id": clients.MODEL_NAME}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.bodies.append(body)
        Recorder.paths.append(self.path)
        chunk = lambda **kw: b"data: " + json.dumps({"id": "c", "object": "text_completion", "created": 0,  # noqa: E731
                                                     "model": clients.MODEL_NAME, **kw}).encode() + b"\n\n"
        n = body.get("max_tokens", 1)
        out = b"".join(chunk(choices=[{"index": 0, "text": " x", "finish_reason": None}]) for _ in range(n))
        out += chunk(choices=[], usage={"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1})
        self.reply("text/event-stream", out + b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def recorder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_three_clients_send_the_same_prompts_and_sampling_fields(recorder, model_path, tmp_path):
    load = SimpleNamespace(input_len=24, output_len=5)
    prompts, data = dataset(model_path, tmp_path / "data", 3, load)
    sent = {}
    with open(tmp_path / "log.txt", "wb") as log:
        for name, client in clients.CLIENTS.items():
            Recorder.bodies.clear()
            client(recorder, model_path, 1, 3, load, data, str(tmp_path / name.replace(" ", "_")), log)
            sent[name] = [b for b in Recorder.bodies if b.get("max_tokens") == load.output_len]  # not ours' warm-up
    fields = ("temperature", "max_tokens", "ignore_eos", "min_tokens", "stream")
    for name, bodies in sent.items():
        # aiperf and guidellm keep the file's order; ours samples a sharegpt-like file (same prompts, shuffled)
        got = [b["prompt"] for b in bodies]
        assert (sorted(got) == sorted(prompts)) if name == "polychip bench serving" else (got == prompts), name
        assert [{f: b.get(f) for f in fields} for b in bodies] == \
            [{"temperature": 0.0, "max_tokens": 5, "ignore_eos": True, "min_tokens": 5, "stream": True}] * 3, name
        assert all(b["stream_options"]["include_usage"] for b in bodies), name


def test_each_client_run_is_prepared_by_a_timed_warm_up_of_an_unmeasured_prompt_then_a_flush(recorder):
    Recorder.bodies.clear()
    Recorder.paths.clear()
    probe = clients.prepare(recorder, "polychip", "the warm-up prompt", 6)
    assert Recorder.paths == ["/v1/completions", "/flush_cache"]
    assert Recorder.bodies[0] == {"model": clients.MODEL_NAME, "prompt": "the warm-up prompt", "max_tokens": 6,
                                  "min_tokens": 6, "ignore_eos": True, "temperature": 0.0, "stream": True,
                                  "stream_options": {"include_usage": True}}
    # the server's own speed, timed by the script: a first chunk, then a time per token after it
    assert set(probe) == {"probe_ttft_ms", "probe_tpot_ms"} and probe["probe_ttft_ms"] > 0 and probe["probe_tpot_ms"] >= 0
    Recorder.bodies.clear()
    Recorder.paths.clear()
    clients.prepare(recorder, "llama.cpp", "the warm-up prompt", 6)     # no flush there: the request replaces its cache
    assert Recorder.paths == ["/v1/completions"]
