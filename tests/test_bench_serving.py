"""``bench serving`` against a tiny fake OpenAI-compatible server started inside the test."""
import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402

from polychip.bench import report, serving  # noqa: E402
from polychip.bench.datasets import BenchRequest  # noqa: E402
from polychip.commands import bench as bench_cmd  # noqa: E402

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)


class WordTokenizer:
    """Prompt words "w<id>" are token ids: the bench's datasets without a real tokenizer."""
    vocab_size = 1000
    encode = staticmethod(lambda text, add_special_tokens=True: [int(w[1:]) for w in text.split()])
    decode = staticmethod(lambda ids, skip_special_tokens=True: " ".join(f"w{i}" for i in ids))


def fake_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/server_info")
    async def server_info():
        if "server_info" not in state:
            return JSONResponse({"error": "not here"}, status_code=404)
        return state["server_info"]

    @app.get("/metrics")
    async def metrics():
        n = state["completions"]
        return PlainTextResponse(
            f'polychip_engine_stage_seconds_total{{model_name="fake-model",stage="forward"}} {0.9 * n}\n'
            f'polychip_engine_stage_seconds_total{{model_name="fake-model",stage="schedule"}} {0.1 * n}\n'
            f'polychip_engine_steps_total{{model_name="fake-model"}} {10 * n}\n')

    @app.post("/flush_cache")
    async def flush_cache():
        if state.get("no_flush"):
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        state["events"].append("flush")
        return PlainTextResponse("ok")

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        state["bodies"].append(body)
        state["events"].append(body["prompt"])
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        n = body["max_tokens"]
        state["completions"] += 1

        async def events():
            for i in range(n):
                await asyncio.sleep(0.002)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


@pytest.fixture()
def fake_server():
    state = {"bodies": [], "completions": 0, "events": []}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            pytest.fail("fake server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def test_sweep_measures_each_step_and_reads_stage_metrics(fake_server):
    url, state = fake_server
    cfg = serving.ServingConfig(url + "/v1", progress=False)
    reqs = lambda c: [BenchRequest(f"p{i}", 3, 6) for i in range(2 * c)]  # noqa: E731
    res = serving.run_sweep(cfg, reqs, [1, 3])
    assert res["model"] == "fake-model"
    assert [s["concurrency"] for s in res["steps"]] == [1, 3]
    for step in res["steps"]:
        assert step["errors"] == 0 and step["completed"] == 2 * step["concurrency"]
        assert step["output_tokens"] == 6 * step["completed"]
        assert step["ttft_ms"]["p50"] > 0 and step["itl_ms"]["mean"] > 0 and step["tpot_ms"]["p99"] > 0
        assert step["stages"]["seconds"]["forward"] == pytest.approx(0.9 * step["completed"])
        assert step["stages"]["steps"] == 10 * step["completed"]
    body = state["bodies"][-1]
    assert body["stream"] and body["ignore_eos"] and body["min_tokens"] == 6 and body["model"] == "fake-model"
    assert "| 3 |" in report.serving_table(res) and "forward" in report.stage_table(res)


def test_flush_cache_empties_the_prefix_cache_before_each_step(fake_server):
    url, state = fake_server
    cfg = serving.ServingConfig(url, model="fake-model", progress=False, flush_cache=True)
    reqs = lambda c: [BenchRequest(f"c{c}-{i}", 3, 2) for i in range(c)]  # noqa: E731
    serving.run_sweep(cfg, reqs, [1, 2])
    # the warm-up, then each step's prompts right after a flush
    assert state["events"][1:] == ["flush", "c1-0", "flush", "c2-0", "c2-1"] or \
        state["events"][1:] == ["flush", "c1-0", "flush", "c2-1", "c2-0"]
    plain = serving.ServingConfig(url, model="fake-model", progress=False)
    state["events"].clear()
    serving.run_sweep(plain, reqs, [1])
    assert "flush" not in state["events"]


def test_flush_cache_on_a_server_without_it_fails_before_measuring(fake_server):
    url, state = fake_server
    state["no_flush"] = True
    cfg = serving.ServingConfig(url, model="fake-model", progress=False, flush_cache=True)
    with pytest.raises(RuntimeError, match=r"/flush_cache answered HTTP 404.*without --flush-cache"):
        serving.run_sweep(cfg, lambda c: [BenchRequest("p", 3, 2)], [1])
    assert state["events"] == ["Warm-up: count from one to ten."]


def test_errors_are_counted_not_raised(fake_server):
    url, _ = fake_server
    cfg = serving.ServingConfig(url, model="fake-model", progress=False)
    res = serving.run_sweep(cfg, lambda c: [BenchRequest("fail", 1, 4), BenchRequest("ok", 1, 4)], [2])
    step = res["steps"][0]
    assert step["errors"] == 1 and step["completed"] == 1 and "HTTP 400" in step["error_samples"][0]


def test_cli_writes_json_markdown_and_plot_then_compare(fake_server, tmp_path, monkeypatch):
    url, _ = fake_server
    from polychip.bench import datasets

    monkeypatch.setattr(datasets, "load_tokenizer", lambda path=None: WordTokenizer())
    common = ["serving", "--base-url", url, "--concurrency", "1,2", "--input-len", "12", "--output-len", "5",
              "--out-dir", str(tmp_path), "--no-progress"]
    assert bench_cmd.main(common + ["--name", "old", "--label", "old"]) == 0
    assert bench_cmd.main(common + ["--name", "new", "--label", "new", "--plot-with", str(tmp_path / "old.json")]) == 0
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"new.{ext}").stat().st_size > 0
    saved = report.load_json(str(tmp_path / "new.json"))
    assert saved["label"] == "new" and saved["steps"][1]["input_tokens"] == 2 * 12
    assert "no /server_info" in saved["roofline"]["none"]            # another engine: said, not guessed
    assert "No workload roofline: no /server_info" in (tmp_path / "new.md").read_text()
    # the same fake server twice: no regression at a generous threshold; a doctored one is flagged
    assert bench_cmd.main(["compare", str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--threshold", "5"]) == 0
    saved["steps"][0]["output_throughput"] /= 10
    report.save_json(saved, str(tmp_path / "worse.json"))
    assert bench_cmd.main(["compare", str(tmp_path / "old.json"), str(tmp_path / "worse.json")]) == 1
    assert bench_cmd.main(["plot", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                           "-o", str(tmp_path / "both.png")]) == 0


def test_cli_rates_each_step_against_the_servers_roofline(fake_server, tmp_path, monkeypatch, model_factory):
    """A server that reports its model folder, dtype and KV dtype gets a roofline per step: the
    machine measured before and after the sweep, each step against its own requests."""
    url, state = fake_server
    from polychip.bench import datasets, roofline

    monkeypatch.setattr(datasets, "load_tokenizer", lambda path=None: WordTokenizer())
    small = roofline.measure_machine
    calls = []

    def measure(shape, plugin=None, **kw):
        calls.append(plugin.name)
        return small(shape, 1, plugin, mib=2, **kw)
    monkeypatch.setattr(roofline, "measure_machine", measure)
    state["server_info"] = {"model_path": model_factory("llama", False), "dtype": "float32",
                            "kv_cache_dtype": "bfloat16", "quantization": None, "plugin": "cpu"}
    assert bench_cmd.main(["serving", "--base-url", url, "--concurrency", "1,2", "--input-len", "12",
                           "--output-len", "5", "--out-dir", str(tmp_path), "--no-progress", "--name", "r"]) == 0
    saved = report.load_json(str(tmp_path / "r.json"))
    assert calls == ["cpu", "cpu"] and len(saved["roofline"]["machine_measurements"]) == 2
    assert saved["roofline"]["storage"] == "float32 weights, bfloat16 KV"
    for step in saved["steps"]:
        assert step["pct_roofline"] == pytest.approx(100 * step["output_throughput"] / step["roofline_output_tok_s"])
        assert step["pct_roofline"] > 0 and step["pct_weights_only_roofline"] > 0
    assert "% roofline (old)" in (tmp_path / "r.md").read_text()
