"""The web console in headless Chromium (Debian's, through Playwright) against a real router with two
real replicas: one it launches on the CPU (v1) and one on a simxpu card run by hand with an API key
and reached by URL (v2), the shape of examples/deploy/two-hosts.yaml; a second router without a key
over the same two; and one `polychip serve` on its own.

Every view is opened with and without the key, at 1280x800 and at phone width, with a screenshot of
each (in $POLYCHIP_CONSOLE_SCREENS or the test's tmp folder); a chat is streamed and its text and
device checked against the API; a canary weight is changed through the page and read back from
/admin/rollout; a batch is uploaded, followed and its output downloaded; a workload is submitted, followed to
ready, its log tailed, and deleted through the confirmation. Any browser console error, failed request or unexpected HTTP error fails the test.
"""
from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from console_helpers import DESKTOP, PHONE, VIEWS, ConsoleBrowser, missing_routes, screens_dir
from polychip.router.settings import HealthConfig, RouterConfig
from polychip.http.launcher import ServerProcess
from router_helpers import RouterProcess, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # names its devices: cpu and simxpu:0

KEY = "console-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
REPLICA_ARGS = ["--num-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "8",
                "--chunked-prefill-size", "256", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def sim(model_factory):
    """A simxpu replica started by hand (version v2), with the API key."""
    model = model_factory("qwen3", True)
    with ServerProcess(["--model-path", model, "--device", "simxpu:0", "--api-key", KEY, *REPLICA_ARGS],
                       env={"POLYCHIP_VERSION_LABEL": "v2"}) as s:
        yield s


@pytest.fixture(scope="module")
def fleet(model_factory, sim, tmp_path_factory):
    """The router with the key: it launches cpu-a (v1) and fronts sim-0 (v2) by URL."""
    model = model_factory("qwen3", True)
    text = f"""
    replicas:
      - {{name: cpu-a, model: tiny, version: v1, device: cpu, model_path: {model}, args: {json.dumps(REPLICA_ARGS)}}}
      - {{name: sim-0, model: tiny, version: v2, url: "{sim.url}"}}
    models:
      - name: tiny
        versions: {{v1: 1, v2: 1}}
    router:
      health_check: {{interval: 0.5, timeout: 5, failure_threshold: 2, success_threshold: 1}}
      canary_guard: {{min_samples: 1000, window: 1000}}
    """
    path = tmp_path_factory.mktemp("console-deploy") / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    files = tmp_path_factory.mktemp("console-files")
    router = RouterProcess(["--deployment", str(path), "--api-key", KEY, "--replica-api-key", KEY,
                            "--files-dir", str(files)])
    try:
        router.wait_ready(2)
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def open_router(fleet):
    """A second router, without a key, over the same two replicas (given by URL)."""
    urls = [r["url"] for r in httpx.get(fleet.url + "/admin/replicas", headers=AUTH).json()["replicas"]]
    cfg = RouterConfig(replica_api_key=KEY, health=HealthConfig(interval=0.5, success_threshold=1))
    server, router = start_router(cfg, urls)
    try:
        wait_for(lambda: httpx.get(server.url + "/health").json()["replicas_up"] == 2, 60, "2 replicas up")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    b = ConsoleBrowser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def screens(tmp_path_factory):
    return screens_dir(tmp_path_factory)


def chat_via_api(url: str, version: str, device_type: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """The same streamed request the Chat view sends, straight to the router: (text, headers)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "preferred_device_types": [device_type],
            "stream_options": {"include_usage": True}}
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={**AUTH, "x-polychip-version": version}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
                text += delta.get("content") or ""
        return text, dict(r.headers)


def send_chat(page, prompt: str, version: str = "", device: str = "", max_tokens: int = 12):
    """Ask in the Chat view; returns the last answer's element once its figures are shown."""
    for name, value in (("version", version), ("device", device)):
        if value:      # the options come from /admin/rollout and /admin/replicas
            page.wait_for_selector(f'select[name="{name}"] option[value="{value}"]', state="attached")
            page.select_option(f'select[name="{name}"]', value)
            assert page.eval_on_selector(f'select[name="{name}"]', "e => e.value") == value
    page.fill('input[name="max_tokens"]', str(max_tokens))
    page.fill('textarea[name="prompt"]', prompt)
    page.click('button[data-action="send"]')
    page.wait_for_function("() => { const t = [...document.querySelectorAll('.turn.assistant')].pop();"
                           " return t && !t.classList.contains('pending'); }", timeout=120_000)
    answer = page.locator(".turn.assistant").last
    assert answer.locator("[data-error]").count() == 0, answer.inner_text()
    return answer


def test_without_the_key_the_page_loads_and_shows_nothing(fleet, browser, screens):
    missing = missing_routes(fleet.url, KEY)
    cp = browser.page(fleet.url)
    page = cp.open("room")
    for view in VIEWS:
        cp.show(view)
        if view == "room":
            page.wait_for_selector(".notice.locked")
        else:
            page.wait_for_selector("main .notice")
        assert page.locator("tr[data-replica], [data-model], button[data-action]").count() == 0
        cp.shot(screens, f"nokey-{view}")
    cp.assert_clean(missing, locked=True)
    cp.close()


@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_every_view_with_the_key(fleet, browser, screens, size):
    missing = missing_routes(fleet.url, KEY)
    assert "/admin/live" not in missing and "/admin/replicas" not in missing
    cp = browser.page(fleet.url, DESKTOP if size == "desktop" else PHONE)
    page = cp.open("room")
    cp.set_key(KEY)
    rows = page.locator("tr[data-replica]")
    rows.first.wait_for()
    wait_for(lambda: rows.count() == 2, 20, "two replica rows")
    assert {page.locator(f'tr[data-replica="{n}"] .chip').inner_text() for n in ("cpu-a", "sim-0")} == {"cpu", "simxpu"}
    assert page.locator('tr[data-replica="sim-0"] .status').inner_text() == "up"
    _expect_missing_or_shown(page, missing, "/admin/devices", "[data-host]")
    cp.shot(screens, f"{size}-room")

    for i in range(3):       # something for Live to show, on both device types
        chat_via_api(fleet.url, "v2", "simxpu", f"warm the live view {i}", 6)
        chat_via_api(fleet.url, "v1", "cpu", f"warm the live view {i}", 6)
    live = httpx.get(fleet.url + "/admin/live", headers=AUTH).json()
    for device in ("cpu", "simxpu"):
        s = next(x for x in live["series"] if (x["model"], x["device_type"]) == ("tiny", device))
        assert sum(s["requests_per_s"]) * live["step_s"] >= 3
        assert sum(s["output_tokens_per_s"]) * live["step_s"] >= 18      # 3 x 6 tokens, from the usage
    measured = {r["name"]: r for r in httpx.get(fleet.url + "/admin/replicas", headers=AUTH).json()["replicas"]}
    assert measured["sim-0"]["speed"]["measured"] and measured["sim-0"]["weight"] == 1
    cp.show("room")         # the speed learnt from those answers, and the placement weight
    speed = page.locator('tr[data-replica="sim-0"] .speed')
    wait_for(lambda: "ms/tok" in speed.inner_text() and "expect TTFT" in speed.inner_text(), 20, "the speed shown")
    assert page.locator('tr[data-replica="sim-0"] .weight').inner_text().startswith("1")
    cp.show("live")
    page.wait_for_selector(".chart canvas")
    assert page.locator(".chart").count() == 6
    for device in ("cpu", "simxpu"):
        assert page.locator("select option", has_text=f"tiny on {device}").count() == 1
    page.wait_for_function("() => [...document.querySelectorAll('.tile b')].some(b => parseFloat(b) > 0 "
                           "|| parseFloat(b.textContent) > 0)")
    cp.shot(screens, f"{size}-live")

    cp.show("rollout")
    page.wait_for_selector('[data-model="tiny"] tr[data-version="v2"]')
    assert page.locator('[data-model="tiny"] tr[data-version]').count() == 2
    cp.shot(screens, f"{size}-rollout")

    for view, route, shown in (("workloads", "/admin/workloads", "table"), ("batches", "/v1/batches", "table")):
        cp.show(view)
        _expect_missing_or_shown(page, missing, route, f"main {shown}")
        cp.shot(screens, f"{size}-{view}")

    cp.show("chat")
    answer = send_chat(page, "Hello there", version="v2", device="simxpu")
    assert answer.locator("[data-device]").inner_text() == "simxpu:0"
    cp.shot(screens, f"{size}-chat")
    cp.assert_clean(missing)
    cp.close()


def _expect_missing_or_shown(page, missing: set[str], route: str, selector: str):
    if route in missing:       # not on this router yet: the view says so, for the route that answered 404
        page.wait_for_selector(f'.notice.missing:has-text("{route} answered 404")')
    else:
        page.wait_for_selector(selector)


@pytest.mark.parametrize("version,device,replica", [("v2", "simxpu", "sim-0"), ("v1", "cpu", "cpu-a")])
def test_chat_streams_and_shows_where_it_ran(fleet, browser, version, device, replica):
    missing = missing_routes(fleet.url, KEY)
    cp = browser.page(fleet.url)
    page = cp.open("chat")
    cp.set_key(KEY)
    prompt = f"Tell me about {device}"
    answer = send_chat(page, prompt, version=version, device=device, max_tokens=12)
    expected, headers = chat_via_api(fleet.url, version, device, prompt, 12)
    assert headers["x-polychip-device"].startswith(device)
    assert answer.locator("[data-answer]").text_content() == expected
    assert answer.locator("[data-replica]").inner_text() == replica == headers["x-polychip-replica"]
    assert answer.locator("[data-device]").inner_text() == headers["x-polychip-device"]
    assert answer.locator("[data-tokens]").inner_text() == "12"
    assert re.fullmatch(r"[0-9.]+ ms", answer.locator("[data-ttft]").inner_text())
    assert float(answer.locator("[data-rate]").inner_text()) > 0
    cp.assert_clean(missing)
    cp.close()


def test_rollout_weight_change_needs_confirmation(fleet, browser, screens):
    missing = missing_routes(fleet.url, KEY)
    weight = lambda: httpx.get(fleet.url + "/admin/rollout", headers=AUTH).json()["models"]["tiny"]["versions"]["v2"]["weight"]
    assert weight() == 1
    cp = browser.page(fleet.url)
    page = cp.open("rollout")
    cp.set_key(KEY)
    field = page.locator('input[name="weight-v2"]')
    field.wait_for()
    field.fill("3")
    page.click('button[data-action="apply-weights"]')
    page.wait_for_selector("dialog.confirm[open]")
    cp.shot(screens, "rollout-confirm")
    page.click("dialog.confirm button.quiet")             # Cancel: nothing changes
    assert weight() == 1
    page.click('button[data-action="apply-weights"]')
    page.click('dialog.confirm button[data-confirm="yes"]')
    page.wait_for_selector("[data-result].ok")
    assert weight() == 3
    page.wait_for_selector('tr[data-version="v2"] td:nth-child(3):has-text("75%")')    # 3 of 1 + 3
    cp.assert_clean(missing)
    cp.close()
    httpx.post(fleet.url + "/admin/rollout", json={"model": "tiny", "weights": {"v2": 1}}, headers=AUTH)


def test_batch_submitted_followed_and_downloaded(fleet, browser, screens, tmp_path):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": f"batch {i}"}], "max_tokens": 4}}
             for i in range(2)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cp = browser.page(fleet.url)
    page = cp.open("batches")
    cp.set_key(KEY)
    page.wait_for_selector("main table")
    page.set_input_files('input[type="file"]', str(requests))
    page.click('form.form button[type="submit"]')
    page.wait_for_selector("form.form .ok")
    row = page.locator("tr[data-batch]").first
    row.locator(".st-completed").wait_for(timeout=120_000)
    assert "2/2 done" in row.inner_text()
    cp.shot(screens, "batch-done")
    with page.expect_download() as got:
        row.locator("button", has_text="Output").click()
    out = [json.loads(x) for x in Path(got.value.path()).read_text().splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["q0", "q1"]
    assert all(x["response"]["status_code"] == 200 for x in out)
    cp.assert_clean(missing_routes(fleet.url, KEY))
    cp.close()


def test_workload_submitted_followed_and_deleted_with_confirmation(fleet, browser, screens, model_factory):
    model = model_factory("qwen3", True)
    listed = lambda: {w["id"]: w for w in httpx.get(fleet.url + "/admin/workloads", headers=AUTH).json()["data"]}
    before = set(listed())
    cp = browser.page(fleet.url)
    page = cp.open("workloads")
    cp.set_key(KEY)
    page.wait_for_selector("main table")
    page.fill('input[name="model"]', model)
    page.fill('input[name="device_type"]', "cpu")
    page.fill('input[name="serve_args"]', "--num-threads 1 --max-total-tokens 4096 --max-running-requests 4")
    page.click('form.form button[type="submit"]')
    page.wait_for_selector("form.form .ok")
    (wid,) = set(listed()) - before
    assert f"Submitted {wid}" in page.inner_text("form.form .ok")
    row = page.locator(f'tr[data-workload="{wid}"]')
    row.locator(".st-ready").wait_for(timeout=120_000)       # the list polls it to ready
    assert listed()[wid]["devices"] == ["cpu:0"]
    row.click()
    page.click('button:has-text("Log tail")')
    page.wait_for_selector("pre.logs")
    assert "polychip ready:" in page.inner_text("pre.logs")  # the replica's own log, from the router
    cp.shot(screens, "workload-detail")
    page.click('button:has-text("Delete")')
    page.wait_for_selector("dialog.confirm[open]")
    page.click("dialog.confirm button.quiet")                 # Cancel: it keeps running
    assert listed()[wid]["status"] == "ready"
    page.click('button:has-text("Delete")')
    page.click('dialog.confirm button[data-confirm="yes"]')
    wait_for(lambda: listed()[wid]["status"] == "stopped", 60, f"workload {wid} stopped")
    page.locator(f'tr[data-workload="{wid}"] .st-stopped').wait_for(timeout=30_000)
    cp.assert_clean(missing_routes(fleet.url, KEY))
    cp.close()


def test_router_without_a_key(open_router, browser, screens):
    missing = missing_routes(open_router.url, None)
    cp = browser.page(open_router.url)
    page = cp.open("room")
    rows = page.locator("tr[data-replica]")
    rows.first.wait_for()
    wait_for(lambda: rows.count() == 2, 20, "two replica rows")
    cp.shot(screens, "nokeyrouter-room")
    cp.show("chat")
    answer = send_chat(page, "Hi", device="simxpu")
    assert answer.locator("[data-device]").inner_text() == "simxpu:0"
    cp.assert_clean(missing)
    cp.close()


def test_serve_console_shows_its_one_replica(sim, browser, screens):
    missing = missing_routes(sim.url, KEY)
    assert {"/admin/replicas", "/admin/rollout"} <= missing
    assert "/server_info" not in missing and "/admin/live" not in missing
    assert httpx.get(sim.url + "/console").status_code == 200     # the page needs no key; its data does
    cp = browser.page(sim.url)
    page = cp.open("room")
    page.wait_for_selector(".notice.locked")
    cp.set_key(KEY)
    page.wait_for_selector('tr[data-replica="this server"]')
    assert "simxpu:0" in page.locator('tr[data-replica="this server"]').inner_text()
    cp.shot(screens, "serve-room")
    cp.show("chat")
    # one live bin after every earlier request to this replica (another test's chat), so that the bins
    # counted from sent_at hold this chat alone
    time.sleep(httpx.get(sim.url + "/admin/live", headers=AUTH).json()["step_s"])
    sent_at = time.time()
    answer = send_chat(page, "Hello", max_tokens=8)
    assert answer.locator("[data-tokens]").inner_text() == "8"
    cp.shot(screens, "serve-chat")
    _serve_live_shows_the_chat(cp, sim.url, sent_at)
    cp.shot(screens, "serve-live")
    cp.assert_clean(missing, locked=True)
    cp.close()


def _ms(s: float) -> str:
    """console/src/format.js's ms()."""
    return f"{s * 1000:.1f} ms" if s < 0.1 else f"{s * 1000:.0f} ms"


def _serve_live_shows_the_chat(cp, url: str, sent_at: float):
    """The server's own /admin/live counts the chat (one request, 8 tokens since it was sent) and
    the Live view shows its figures: the latest TTFT and TPOT, the scheduler's queue, none running."""
    live = httpx.get(url + "/admin/live", headers=AUTH).json()
    assert live["scope"] == "server"
    s = next(x for x in live["series"] if (x["model"], x["device_type"]) == ("tiny", "simxpu"))
    since = [i for i, t in enumerate(live["t"]) if t + live["step_s"] > sent_at]
    assert sum(s["requests_per_s"][i] for i in since) * live["step_s"] == 1
    assert sum(s["output_tokens_per_s"][i] for i in since) * live["step_s"] == 8
    ttft, tpot = (next(v for v in reversed(s[k]) if v is not None) for k in ("ttft_p50_s", "tpot_p50_s"))
    page = cp.show("live")
    page.wait_for_selector(".chart canvas")
    assert page.locator(".chart").count() == 6
    assert page.locator("select option", has_text="tiny on simxpu").count() == 1
    assert page.locator(".chart figcaption", has_text="Waiting in the scheduler, by priority").count() == 1

    def tile(label: str) -> str:
        return page.locator(f'.tile:has-text("{label}") b').inner_text()
    # the page polls every 2 s; the scheduler is sampled every 2 s, once after the chat ended
    wait_for(lambda: tile("TTFT p50") == _ms(ttft) and tile("running") == "0", 10, f"TTFT {_ms(ttft)}, 0 running")
    assert tile("TPOT p50") == _ms(tpot)
    errors = ", ".join(f"{k} {n}" for k, n in live["errors_by_kind"].items()) or "none"
    assert page.locator("p", has_text="Errors in the window").inner_text() == f"Errors in the window: {errors}."


def thinking_replica() -> FastAPI:
    """A replica that streams a Qwen3-style answer: reasoning_content deltas, then content."""
    from router_helpers import FakeReplica
    app = FakeReplica(model="qwen3-fake", device="simxpu:1").app

    async def answer(request: Request):
        pieces = [{"reasoning_content": "The user greets"}, {"reasoning_content": " me."},
                  {"content": "Hello"}, {"content": " back!"}]

        async def events():
            for delta in pieces:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/chat/completions"]
    app.add_api_route("/v1/chat/completions", answer, methods=["POST"])
    return app


def test_chat_shows_thinking_apart_from_the_answer(browser, screens):
    with ThreadServer(thinking_replica()) as replica:
        server, _ = start_router(RouterConfig(health=HealthConfig(interval=0.3, success_threshold=1)), [replica.url])
        try:
            wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 20, "replica up")
            cp = browser.page(server.url)
            page = cp.open("chat")
            answer = send_chat(page, "Hi")
            assert answer.locator("[data-thinking]").text_content() == "The user greets me."
            assert answer.locator("[data-answer]").text_content() == "Hello back!"
            assert answer.locator("[data-device]").inner_text() == "simxpu:1"
            assert answer.locator("[data-tokens]").inner_text() == "4"
            answer.locator("details.thinking summary").click()      # shown while streaming, folded after
            cp.shot(screens, "chat-thinking")
            cp.assert_clean(missing_routes(server.url, None))
            cp.close()
        finally:
            server.stop()
