"""Workloads against a real ``polychip router`` launching real ``polychip serve`` replicas (a tiny
random-weight model), driven through the operator's CLI (``polychip workload ...``):

submit onto simxpu and (declared in the deployment file) the CPU, list, describe, logs --tail,
a chat completion routed to the workload, refusals (busy 409, incapable 422), delete freeing the
device for a second submit, a reload that keeps the submitted workload, a router restart
that relaunches it, and the deployment's own replica holding its simxpu card in the same ledger."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import httpx
import pytest

from polychip.commands import workload as workload_cmd
from router_helpers import RouterProcess

pytestmark = pytest.mark.device_independent   # pins the devices it uses (cpu, simxpu)

KEY = "wl-test-key"
SERVE = ["--num-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "8",
         "--chunked-prefill-size", "256"]
AUTH = {"Authorization": f"Bearer {KEY}"}


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run `polychip workload ARGV...` against the router; (exit status, stdout, stderr)."""
    capsys.readouterr()
    verb, rest = argv[0], list(argv[1:])
    extra = rest[rest.index("--"):] if "--" in rest else []
    rest = rest[:len(rest) - len(extra)]
    rc = workload_cmd.main([verb, "--url", ROUTER["url"], "--api-key", KEY, *rest, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


ROUTER: dict = {}


@pytest.fixture(scope="module")
def setup(model_factory, tmp_path_factory):
    model = model_factory("qwen3", True)
    state = tmp_path_factory.mktemp("wl-state")
    deploy = state / "deploy.yaml"
    deploy.write_text(textwrap.dedent(f"""
        workloads:
          - {{id: decl-cpu, model: {model}, name: tiny-cpu, device: cpu, serve_args: {json.dumps(SERVE)}}}
        models:
          - {{name: tiny-dep, versions: {{v1: 1}}}}
        replicas:
          - {{name: dep-sim, model: tiny-dep, version: v1, device: "simxpu:1", model_path: {model},
             args: {json.dumps(SERVE)}}}
    """))
    args = ["--deployment", str(deploy), "--state-dir", str(state), "--api-key", KEY,
            "--health-check-interval", "0.5", "--drain-timeout", "10"]
    routers = [RouterProcess(args)]
    ROUTER["url"] = routers[0].url
    try:
        routers[0].wait_ready(2)
        yield {"model": model, "args": args, "routers": routers, "state": state}
    finally:
        pids = _pids(routers[-1])
        for r in routers:
            r.stop()
        for pid in pids:         # the router stops them; make sure nothing outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids(router) -> list[int]:
    try:
        return [r["pid"] for r in httpx.get(router.url + "/admin/replicas", headers=AUTH, timeout=10)
                .json()["replicas"] if r.get("pid")]
    except httpx.HTTPError:
        return []


def chat(model: str) -> httpx.Response:
    return httpx.post(ROUTER["url"] + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})


def describe(wid: str) -> dict:
    return httpx.get(f"{ROUTER['url']}/admin/workloads/{wid}", headers=AUTH, timeout=10).json()


def test_submit_list_describe_logs_chat_refusals_delete(setup, capsys):
    began = time.monotonic()         # a submit answers at once, before the replica loads
    rc, out, err = cli(capsys, "submit", "--model", setup["model"], "--name", "tiny-cpu2", "--device-type", "cpu",
                       "--", *SERVE)
    assert rc == 0 and out.split()[1] == "pending" and "cpu:0" in out, err
    assert time.monotonic() - began < 10
    cpu_id = out.split()[0]
    t0 = time.monotonic()
    rc, out, err = cli(capsys, "submit", "--model", setup["model"], "--name", "tiny-sim", "--device", "simxpu:0",
                       "--wait", "--", *SERVE)
    assert rc == 0, err
    wid = out.split()[0]
    assert out.split()[1] == "ready" and "simxpu:0" in out
    answer = chat("tiny-sim")        # routed as soon as it is ready: no wait after the status says so
    served_in = time.monotonic() - t0
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polychip-replica"] == wid and answer.headers["x-polychip-device"] == "simxpu:0"

    rc, out, _ = cli(capsys, "list")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows[wid][1:6] == ["tiny-sim", "default", rows[wid][3], "simxpu:0", "ready"]
    assert rows["decl-cpu"][4:6] == ["cpu:0", "ready"]
    rc, out, _ = cli(capsys, "list", "--device-type", "cpu")
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == sorted(["decl-cpu", cpu_id])
    rc, out, _ = cli(capsys, "list", "--model", "tiny-sim")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [wid]

    rc, out, _ = cli(capsys, "describe", wid)
    d = describe(wid)
    assert "target_device:  simxpu:0" in out and d["target_device"] == "simxpu:0"
    kinds = [e["event"] for e in d["events"]]
    assert kinds[:2] == ["placed", "process started"] and kinds[-1] == "first token", kinds
    for k in ("weights loaded", "compiled", "warmed up", "first ready"):
        assert k in kinds
    assert d["load_s"] > 0 and d["compile_s"] >= 0 and 0 < d["first_token_s"] < 30
    ready_after = _seconds(d, "first ready") - _seconds(d, "placed")
    with capsys.disabled():           # the figures, and one real describe, for the record
        print(f"\n{out}\nsubmit -> first answer through the router {served_in:.1f}s; placed -> ready "
              f"{ready_after:.1f}s; load {d['load_s']:.2f}s (load average {os.getloadavg()[0]:.1f})")

    rc, out, _ = cli(capsys, "logs", wid, "--tail", "400")
    assert "polychip ready:" in out                            # the replica's own log ...
    assert "polychip.access" not in setup["routers"][-1].log    # ... not interleaved into the router's
    rc, out, _ = cli(capsys, "logs", wid, "--tail", "3")
    assert rc == 0 and len(out.splitlines()) == 3
    got = ""           # --follow: the tail, then what the replica writes (a line per health check)
    with httpx.stream("GET", f"{ROUTER['url']}/admin/workloads/{wid}/logs", params={"tail": 2, "follow": "true"},
                      headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        for chunk in r.iter_text():
            got += chunk
            if got.count("\n") >= 5:
                break
    assert got.count("GET /server_info") >= 4, got

    rc, _, err = cli(capsys, "submit", "--model", setup["model"], "--device", "simxpu:0")
    assert rc == 1 and "HTTP 409" in err and f"simxpu:0 is held by workload {wid}" in err
    rc, _, err = cli(capsys, "submit", "--model", setup["model"], "--device-type", "simxpu", "--dtype", "float16")
    assert rc == 1 and "HTTP 422" in err and "lacks ['float16']" in err

    rc, out, _ = cli(capsys, "delete", wid, "--wait")
    assert rc == 0 and out.split() == [wid, "stopped"]
    assert describe(wid)["events"][-1]["detail"] == "simxpu:0 free again"
    assert chat("tiny-sim").status_code == 404             # no longer routed
    dev = httpx.get(ROUTER["url"] + "/admin/devices", headers=AUTH, timeout=30).json()["hosts"][0]
    assert next(x for x in dev["devices"] if x["device"] == "simxpu:0")["workloads"] == []
    rc, out, err = cli(capsys, "submit", "--model", setup["model"], "--name", "tiny-sim", "--device", "simxpu:0",
                       "--version", "v2", "--wait", "--", *SERVE)
    assert rc == 0 and out.split()[1] == "ready", err
    setup["second"] = out.split()[0]
    assert chat("tiny-sim").headers["x-polychip-replica"] == setup["second"]

    assert workload_cmd.wait_for(workload_cmd.Admin(ROUTER["url"], KEY), cpu_id, ("ready",), 300)
    assert chat("tiny-cpu2").headers["x-polychip-replica"] == cpu_id    # the CPU, shared with decl-cpu
    rc, out, _ = cli(capsys, "delete", cpu_id, "--wait")
    assert rc == 0 and out.split() == [cpu_id, "stopped"]


def test_a_submitted_workload_survives_a_reload_and_a_router_restart(setup, capsys):
    second = setup.get("second")
    assert second, "runs after the submit test"
    before = _pids_by_name()
    r = httpx.post(ROUTER["url"] + "/admin/reload", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    after = _pids_by_name()
    assert after[second] == before[second] and after["decl-cpu"] == before["decl-cpu"]   # untouched

    old = setup["routers"][-1]
    assert old.stop() == 0
    new = RouterProcess(setup["args"])
    setup["routers"].append(new)
    ROUTER["url"] = new.url
    new.wait_ready(3)                      # decl-cpu, the submitted one, dep-sim
    d = describe(second)
    assert d["status"] == "ready" and d["version"] == "v2" and d["devices"] == ["simxpu:0"]
    kinds = [e["event"] for e in d["events"]]
    back = kinds.index("router stopped")
    assert kinds[back:back + 3] == ["router stopped", "relaunched", "process started"], kinds
    assert chat("tiny-sim").headers["x-polychip-replica"] == second
    rc, out, _ = cli(capsys, "list")
    statuses = {line.split()[0]: line.split()[5] for line in out.splitlines()[1:]}
    assert statuses[second] == "ready" and statuses["decl-cpu"] == "ready" and "stopped" in statuses.values()

    os.kill(_pids_by_name()[second], signal.SIGKILL)      # a crash: restarted, with the reason in its events
    deadline = time.monotonic() + 300
    while not ((w := describe(second))["restarts"] == 1 and w["status"] == "ready"):
        assert time.monotonic() < deadline, w
        time.sleep(0.5)
    exits = [e["detail"] for e in w["events"] if e["event"] == "exited"]
    assert w["restarts"] == 1 and exits and exits[-1].startswith("killed by SIGKILL; restart 1 follows"), exits


def _pids_by_name() -> dict[str, int]:
    return {r["name"]: r["pid"] for r in httpx.get(ROUTER["url"] + "/admin/replicas", headers=AUTH).json()["replicas"]}


def _seconds(d: dict, event: str) -> float:
    import datetime
    at = next(e["at"] for e in d["events"] if e["event"] == event)
    return datetime.datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


def test_a_deployment_replica_holds_its_card_in_the_ledger_workloads_book(setup, capsys):
    """One ledger: the deployment file's replica on simxpu:1 (launched by the router, relaunched by the
    restarted one) holds its card, so a submit for that card is refused naming it, and a submit by device
    type is placed on a card nobody holds."""
    rc, out, _ = cli(capsys, "list")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["dep-sim"][4:6] == ["simxpu:1", "ready"], out
    assert describe("dep-sim")["kind"] == "deployment replica"
    assert chat("tiny-dep").headers["x-polychip-device"] == "simxpu:1"
    rc, _, err = cli(capsys, "submit", "--model", setup["model"], "--device", "simxpu:1")
    assert rc == 1 and "HTTP 409" in err and "simxpu:1 is held by workload dep-sim" in err, err
    rc, out, err = cli(capsys, "submit", "--model", setup["model"], "--name", "tiny-any", "--device-type", "simxpu",
                       "--", *SERVE)
    assert rc == 0, err
    placed = out.split()[2:]
    assert not any(d in ("simxpu:0", "simxpu:1") for d in placed) and any(d.startswith("simxpu:") for d in placed), out
    dev = httpx.get(ROUTER["url"] + "/admin/devices", headers=AUTH, timeout=30).json()["hosts"][0]
    held = {x["device"]: x["workloads"] for x in dev["devices"]}
    assert held["simxpu:1"] == ["dep-sim"] and held["simxpu:0"] == [setup["second"]], held
    rc, out, _ = cli(capsys, "delete", out.split()[0], "--wait")
    assert rc == 0
