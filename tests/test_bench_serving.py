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


def fake_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        n = state["completions"]
        return PlainTextResponse(
            f'polychip_engine_stage_seconds_total{{model_name="fake-model",stage="forward"}} {0.9 * n}\n'
            f'polychip_engine_stage_seconds_total{{model_name="fake-model",stage="schedule"}} {0.1 * n}\n'
            f'polychip_engine_steps_total{{model_name="fake-model"}} {10 * n}\n')

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        state["bodies"].append(body)
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
    state = {"bodies": [], "completions": 0}
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


def test_errors_are_counted_not_raised(fake_server):
    url, _ = fake_server
    cfg = serving.ServingConfig(url, model="fake-model", progress=False)
    res = serving.run_sweep(cfg, lambda c: [BenchRequest("fail", 1, 4), BenchRequest("ok", 1, 4)], [2])
    step = res["steps"][0]
    assert step["errors"] == 1 and step["completed"] == 1 and "HTTP 400" in step["error_samples"][0]


def test_cli_writes_json_markdown_and_plot_then_compare(fake_server, tmp_path, monkeypatch):
    url, _ = fake_server
    from polychip.bench import datasets

    class WordTokenizer:
        vocab_size = 1000
        encode = staticmethod(lambda text, add_special_tokens=True: [int(w[1:]) for w in text.split()])
        decode = staticmethod(lambda ids, skip_special_tokens=True: " ".join(f"w{i}" for i in ids))
    monkeypatch.setattr(datasets, "load_tokenizer", lambda path=None: WordTokenizer())
    common = ["serving", "--base-url", url, "--concurrency", "1,2", "--input-len", "12", "--output-len", "5",
              "--out-dir", str(tmp_path), "--no-progress"]
    assert bench_cmd.main(common + ["--name", "old", "--label", "old"]) == 0
    assert bench_cmd.main(common + ["--name", "new", "--label", "new", "--plot-with", str(tmp_path / "old.json")]) == 0
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"new.{ext}").stat().st_size > 0
    saved = report.load_json(str(tmp_path / "new.json"))
    assert saved["label"] == "new" and saved["steps"][1]["input_tokens"] == 2 * 12
    # the same fake server twice: no regression at a generous threshold; a doctored one is flagged
    assert bench_cmd.main(["compare", str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--threshold", "5"]) == 0
    saved["steps"][0]["output_throughput"] /= 10
    report.save_json(saved, str(tmp_path / "worse.json"))
    assert bench_cmd.main(["compare", str(tmp_path / "old.json"), str(tmp_path / "worse.json")]) == 1
    assert bench_cmd.main(["plot", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                           "-o", str(tmp_path / "both.png")]) == 0
