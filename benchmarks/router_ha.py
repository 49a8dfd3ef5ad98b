"""Three routers over a three-member etcd, two fake replicas (v1, v2 of model m) behind them, and a
client that spreads requests over the three router URLs and, as an L4 balancer would, sends a
request again to the next URL when its connection is refused or cut. During the run: SIGKILL the
leader router, later SIGKILL one etcd member, later `rollout set` on one survivor.

  .venv/bin/python benchmarks/router_ha.py [--duration 120] [--concurrency 16] [--ttl 3] [--json out.json]
  .venv/bin/python benchmarks/router_ha.py --store-cost [--duration 10]     # one router: memory vs etcd

Prints the table: sent, answered, client retries (refused / cut), failed, time to a new leader,
time for the weight change to reach every router, late answers from the old version; then what the
store cost (writes per 1000 requests, latency). Fake replicas: the model is not the point.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from tests.etcd_cluster import EtcdCluster  # noqa: E402

BODY = {"model": "m", "prompt": "x", "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_fake(port: int, version: str) -> None:
    """This script as one fake replica (subprocess): 10 ms per token."""
    import uvicorn
    from router_helpers import FakeReplica
    fake = FakeReplica(model="m", version=version, delay=0.01, max_running=64)
    uvicorn.run(fake.app, host="127.0.0.1", port=port, log_level="warning")


class Proc:
    def __init__(self, cmd: list[str], log_path: str, env: dict | None = None):
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_http(url: str, ok, timeout: float = 120, proc: "Proc | None" = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.proc.poll() is not None:
            with open(proc.log_path) as f:
                raise RuntimeError(f"{url}: the process exited: {f.read()[-2000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if ok(r):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s")


class Stack:
    """etcd members, fake replicas and routers as processes; ``stop()`` ends all of them."""

    def __init__(self, n_routers: int, state: str | None, ttl: float, etcd_members: int = 3,
                 log_dir: str | None = None):
        self.dir = log_dir or tempfile.mkdtemp(prefix="/tmp/state-ha-")   # kept: the logs outlive a failed run
        self.etcd = EtcdCluster(etcd_members) if state is None else None
        self.state = state or self.etcd.spec
        self.replicas, self.replica_urls, self.routers, self.urls = [], [], [], []
        try:
            self._start(n_routers, ttl)
        except BaseException:
            self.stop()
            raise

    def _start(self, n_routers: int, ttl: float) -> None:
        for version in ("v1", "v2"):
            port = free_port()
            self.replicas.append(Proc([sys.executable, __file__, "--fake-replica", str(port), version],
                                      os.path.join(self.dir, f"replica-{version}.log")))
            self.replica_urls.append(f"http://127.0.0.1:{port}")
        for url in self.replica_urls:
            wait_http(url + "/server_info", lambda r: r.status_code == 200)
        for i in range(n_routers):
            port = free_port()
            cmd = [sys.executable, "-m", "polychip.cli", "router", "--port", str(port), "--state", self.state,
                   "--node-id", f"r{i}", "--state-lease-ttl", str(ttl), "--health-check-interval", "0.5",
                   "--log-level", "info",
                   # the canary guard is not what this run measures: on a loaded machine its latency
                   # ratio tests can roll a version back by chance
                   "--canary-max-error-rate", "0.99", "--canary-max-ttft-ratio", "1e9", "--canary-max-tpot-ratio", "1e9"]
            for url in self.replica_urls:
                cmd += ["--replica", url]
            self.routers.append(Proc(cmd, os.path.join(self.dir, f"router-{i}.log"),
                                     {"POLYCHIP_STATE_DIR": os.path.join(self.dir, f"state-{i}")}))
            self.urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(self.urls, self.routers):
            wait_http(url + "/admin/rollout", proc=proc, ok=lambda r: r.status_code == 200 and len(
                r.json()["models"].get("m", {}).get("versions", {})) == 2)

    def stop(self) -> None:
        for p in self.routers + self.replicas:
            p.stop()
        if self.etcd is not None:
            self.etcd.stop()


class Client:
    """``concurrency`` loops; each request goes to the next URL in turn and, when the connection is
    refused or cut before the answer, to the next one again (at most 2 x the number of URLs)."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.turn = 0
        self.sent = self.answered = self.failed = self.refused = self.cut = 0
        self.other_errors: list[str] = []
        self.cuts: list[str] = []
        self.answers: list[tuple[float, str, str]] = []     # (time sent, router url, version)
        self.latencies: list[float] = []

    async def one(self, http: httpx.AsyncClient) -> None:
        self.sent += 1
        self.turn += 1
        first, t0 = self.turn, time.monotonic()
        for attempt in range(2 * len(self.urls)):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                r = await http.post(url + "/v1/completions", json=BODY)
            except httpx.ConnectError:
                self.refused += 1
                continue
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as e:
                self.cut += 1
                self.cuts.append(f"{time.monotonic():.2f} {url} {type(e).__name__}: {e}")
                continue
            if r.status_code == 200 and r.json()["choices"][0]["text"] == "x" * BODY["max_tokens"]:
                self.answered += 1
                self.latencies.append(time.monotonic() - t0)
                self.answers.append((t0, url, r.headers.get("x-polychip-version", "?")))
            else:
                self.failed += 1
                self.other_errors.append(f"{r.status_code} {r.text[:200]}")
            return
        self.failed += 1
        self.other_errors.append("every router URL refused or cut the request")

    async def run(self, concurrency: int, until: float) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, connect=2),
                                     limits=httpx.Limits(max_keepalive_connections=concurrency)) as http:
            async def loop():
                while time.monotonic() < until:
                    await self.one(http)
            await asyncio.gather(*(loop() for _ in range(concurrency)))


def state_of(url: str) -> dict | None:
    try:
        return httpx.get(url + "/admin/state", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def weights_of(url: str) -> dict | None:
    try:
        versions = httpx.get(url + "/admin/rollout", timeout=2).json()["models"]["m"]["versions"]
        return {v: d["weight"] for v, d in versions.items()}
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def poll(pred, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until ``pred()`` (run in a thread) holds, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await asyncio.to_thread(pred):
            return time.monotonic() - t0
        await asyncio.sleep(step)
    return None


async def ha_scenario(stack: Stack, client: Client, duration: float, concurrency: int, ttl: float) -> dict:
    t0 = time.monotonic()
    load = asyncio.ensure_future(client.run(concurrency, t0 + duration))
    res: dict = {}
    await asyncio.sleep(duration * 0.2)
    leader = (await asyncio.to_thread(state_of, stack.urls[0]))["leader"]
    dead = int(leader[1:])
    survivors = [u for j, u in enumerate(stack.urls) if j != dead]
    t_kill = time.time()
    stack.routers[dead].kill()
    res["killed_router"] = leader

    def new_leader_agreed():
        seen = [(state_of(u) or {}).get("leader") for u in survivors]
        return seen[0] not in (None, leader) and len(set(seen)) == 1
    agreed = await poll(new_leader_agreed, 4 * ttl)
    if agreed is not None:       # from each survivor's own record of when it saw the new leader
        since = [(await asyncio.to_thread(state_of, u))["leader_since"] for u in survivors]
        res["time_to_new_leader_s"] = max(since) - t_kill
        res["time_to_new_leader_polled_s"] = agreed
    res["dead_router_registry_gone_s"] = await poll(
        lambda: leader not in (state_of(survivors[0]) or {}).get("registry", {leader: 1}), 4 * ttl)
    await asyncio.sleep(max(0.0, t0 + duration * 0.4 - time.monotonic()))
    members = (await asyncio.to_thread(state_of, survivors[0]))["store"]["members"]
    etcd_leader = next(m for m in members if m["leader"])
    port = int(etcd_leader["client_urls"][0].rsplit(":", 1)[1])
    stack.etcd.kill(stack.etcd.client_ports.index(port))
    res["killed_etcd_member"] = etcd_leader["name"] + " (the etcd leader)"
    await asyncio.sleep(max(0.0, t0 + duration * 0.75 - time.monotonic()))
    t_set = time.monotonic()
    r = await asyncio.to_thread(httpx.post, survivors[0] + "/admin/rollout",
                                json={"model": "m", "weights": {"v1": 0, "v2": 1}}, timeout=10)
    res["rollout_set_status"] = r.status_code
    target = {"v1": 0.0, "v2": 1.0}
    reach = [await poll(lambda u=u: weights_of(u) == target, 5, 0.02) for u in survivors]
    res["weight_propagation_s"] = None if None in reach else max(reach)
    await load
    res["old_version_answers_1s_after_set"] = sum(1 for t, _, v in client.answers if t > t_set + 1.0 and v == "v1")
    res["answers_after_set_per_router"] = {u: sum(1 for t, url, _ in client.answers if t > t_set + 1.0 and url == u)
                                           for u in survivors}
    states = [await asyncio.to_thread(state_of, u) for u in survivors]
    lags = [(s.get("last_adopted") or {}).get("lag_s") for s in states[1:]]
    res["weight_store_lag_s"] = None if None in lags else max(lags)
    res["survivors_agree_on_leader"] = len({s["leader"] for s in states}) == 1
    res["weights_kept"] = all(s["models"].get("m", {}).get("weights") == target for s in states)
    res["registry"] = sorted(states[0]["registry"])
    res["members"] = states[0]["members"]
    writes = sum(s["writes"] for s in states)
    res["store_writes_survivors"] = writes
    res["store_writes_per_1000_requests"] = round(1000 * writes / max(1, client.answered), 2)
    res["store_writes_per_router_second"] = round(writes / len(states) / duration, 2)
    res["store_write_ms_mean"] = round(1000 * sum(s["write_seconds"] for s in states) / max(1, writes), 2)
    return res


def table(client: Client, res: dict, duration: float, concurrency: int) -> str:
    rows = [("requests sent", client.sent), ("answered (complete)", client.answered),
            ("client retries: connection refused", client.refused),
            ("client retries: connection cut (router killed mid-request)", client.cut),
            ("failed", client.failed),
            ("time to a new leader (s)", _f(res.get("time_to_new_leader_s"))),
            ("dead router's registry gone after (s)", _f(res.get("dead_router_registry_gone_s"))),
            ("weight change reaches every router, seen over HTTP (s)", _f(res.get("weight_propagation_s"))),
            ("weight change: set on one router to applied on the others (s)", _f(res.get("weight_store_lag_s"))),
            ("old-version answers to requests sent > 1 s after rollout set", res.get("old_version_answers_1s_after_set")),
            ("store writes per 1000 requests", res.get("store_writes_per_1000_requests")),
            ("store writes per router per second", res.get("store_writes_per_router_second"))]
    head = f"| HA run: {duration:g} s at concurrency {concurrency} | |\n| --- | --- |\n"
    return head + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def run_ha(duration: float = 120, concurrency: int = 16, ttl: float = 3,
           log_dir: str | None = None) -> tuple[Client, dict]:
    stack = Stack(3, None, ttl, log_dir=log_dir)
    try:
        client = Client(stack.urls)
        res = asyncio.run(ha_scenario(stack, client, duration, concurrency, ttl))
        res["errors"] = client.other_errors[:10]
        res["cuts"] = client.cuts[:40]
        res["logs"] = stack.dir
        return client, res
    finally:
        stack.stop()


def store_cost(duration: float, concurrency: int) -> dict:
    """One router over the same two replicas with --state memory:// and with etcd (1 member), one after
    the other: request latency and store writes per 1000 requests."""
    out = {}
    for name, state in (("memory", "memory://"), ("etcd", None)):
        stack = Stack(1, state, 3, etcd_members=1)
        try:
            client = Client(stack.urls)
            asyncio.run(client.run(concurrency, time.monotonic() + duration))
            s = state_of(stack.urls[0])
            q = statistics.quantiles(client.latencies, n=100)
            out[name] = {"answered": client.answered, "failed": client.failed,
                         "p50_ms": round(1000 * q[49], 2), "p95_ms": round(1000 * q[94], 2),
                         "store_writes": s["writes"],
                         "writes_per_1000_requests": round(1000 * s["writes"] / max(1, client.answered), 2)}
        finally:
            stack.stop()
    return out


def main() -> int:
    if sys.argv[1:2] == ["--fake-replica"]:
        serve_fake(int(sys.argv[2]), sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--ttl", type=float, default=3)
    p.add_argument("--store-cost", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load = os.getloadavg()
    if args.store_cost:
        out = {"store_cost": store_cost(args.duration, args.concurrency)}
        print(json.dumps(out, indent=2))
    else:
        client, res = run_ha(args.duration, args.concurrency, args.ttl)
        print(table(client, res, args.duration, args.concurrency))
        out = {"sent": client.sent, "answered": client.answered, "refused": client.refused, "cut": client.cut,
               "failed": client.failed, **res}
        print(json.dumps(res, indent=2))
    out["loadavg_start"] = load
    out["loadavg_end"] = os.getloadavg()
    print(f"load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
