"""Issue 23 faults 5 (state) and 6, run the same way against any checkout of the router, so the
previous main and this one can be compared:

    git worktree add --detach /tmp/old 5f01d19
    (cd /tmp/old && PYTHONPATH=/tmp/old python $PWD/benchmarks/router_state_faults.py /tmp/old)
    PYTHONPATH=$PWD python benchmarks/router_state_faults.py $PWD --etcd

Prints the weights after a `rollout set` followed by a reload and a restart (same file), and what a
second router sends 1 s after the `rollout set` went to the first (with --etcd: both share etcd).
"""
import os
import sys
import tempfile
import time

import httpx

ROOT = os.path.abspath(sys.argv[1])
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for  # noqa: E402

from polychip.router.deployment import load_deployment  # noqa: E402

try:
    from polychip.router.settings import HealthConfig, RouterConfig
except ImportError:                      # the router before settings.py
    from polychip.router.config import HealthConfig, RouterConfig


def weights(url: str) -> dict:
    return {v: x["weight"] for v, x in httpx.get(url + "/admin/rollout").json()["models"]["m"]["versions"].items()}


def restart_and_reload(servers) -> None:
    d = tempfile.mkdtemp(prefix="/tmp/state-faults-")
    os.environ["POLYCHIP_STATE_DIR"] = d
    path = f"{d}/d.yaml"
    with open(path, "w") as f:
        f.write(f"replicas:\n  - {{name: a, model: m, version: v1, url: '{servers[0].url}'}}\n"
                f"  - {{name: b, model: m, version: v2, url: '{servers[1].url}'}}\n"
                "models:\n  - {name: m, versions: {v1: 1, v2: 1}}\nrouter:\n  health_check: {interval: 0.2}\n")
    dep = load_deployment(path)
    cfg = dep.router_config() if hasattr(dep, "router_config") else dep.router
    srv, r = start_router(cfg, [], dep, path)
    wait_for(lambda: all(x.up for x in r.dispatcher.replicas.values()), 15)
    httpx.post(srv.url + "/admin/rollout", json={"model": "m", "weights": {"v1": 9, "v2": 1}})
    httpx.post(srv.url + "/admin/reload")
    after_reload = weights(srv.url)
    time.sleep(0.5)
    srv.stop()
    srv, r = start_router(cfg, [], dep, path)
    print("fault 5: set v1=9 v2=1; after reload:", after_reload, "after restart:", weights(srv.url))
    srv.stop()


def two_routers(servers, etcd_spec: str | None) -> None:
    routers = []
    for i in range(2):
        kw = dict(state=etcd_spec, node_id=f"r{i}") if etcd_spec else {}
        routers.append(start_router(RouterConfig(health=HealthConfig(interval=0.2), **kw), [s.url for s in servers]))
    for _, r in routers:
        wait_for(lambda: "m" in r.rollout.models and len(r.rollout.models["m"].weights) == 2, 15)
    (a, _), (b, _) = routers
    httpx.post(a.url + "/admin/rollout", json={"model": "m", "weights": {"v1": 0, "v2": 1}})
    time.sleep(1.0)
    got = [httpx.post(b.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
           .headers["x-polychip-version"] for _ in range(10)]
    print("fault 6: rollout set v1=0 v2=1 on router A; 1 s later router B sends", {v: got.count(v) for v in set(got)})
    for srv, _ in routers:
        srv.stop()


def main() -> None:
    servers = [ThreadServer(FakeReplica(model="m", version=v).app).start() for v in ("v1", "v2")]
    cluster = None
    try:
        restart_and_reload(servers)
        if "--etcd" in sys.argv:
            from tests.etcd_cluster import EtcdCluster
            cluster = EtcdCluster(1)
        two_routers(servers, cluster.spec if cluster else None)
    finally:
        for s in servers:
            s.stop()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
