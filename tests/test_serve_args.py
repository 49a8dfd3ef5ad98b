"""Serve arguments as data (issue 32, finding 1): a workload's serve_args and a deployment replica's
args are read as serve's own settings (every flag spelled in full, each value checked by the
settings classes), the replica's command is written from those values with the router's trust
settings last, and the flags that load code or weaken the trust chain are refused unless the
router allows them; no polychip parser matches a flag prefix (issue 34: `pack --device`)."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import httpx
import pytest
from router_helpers import ThreadServer
from test_workloads_units import devices_json
from trust_helpers import trust_store

from polychip import cli
from polychip.commands import pack as pack_cmd
from polychip.commands import router as router_cmd
from polychip.errors import ConfigError
from polychip.http.serve_settings import parse_serve_args, serve_argv
from polychip.router.deployment import DeploymentError, ReplicaEntry, from_dict, load_deployment
from polychip.router.fleet.inventory import Inventory, parse_devices_json
from polychip.router.fleet.launcher import serve_command
from polychip.trust import keys as signing
from polychip.trust.options import RouterTrust

pytestmark = pytest.mark.device_independent     # runs no model

REPO = Path(__file__).resolve().parents[1]
KEY = "serve-args-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ABBREVIATED = [["--hos", "0.0.0.0"], ["--por", "1"], ["--max-total-tok", "64"], ["--po=1"]]
GUARDED = [(["--plugin", "/tmp/evil.py"], "--plugin loads code"),
           (["--trust-store", "/srv/other"], "--trust-store replaces the site trust store"),
           (["--allow-unsigned"], "--allow-unsigned loads unsigned"),
           (["--trusted-key", "/tmp/mine.pub"], "--trusted-key adds a key"),
           (["--allow-modified-plugin"], "--allow-modified-plugin loads a plugin")]


def test_every_parser_is_made_without_prefix_matching():
    """Every parser in polychip/ is the project's Parser (prefix matching off), and a prefix is
    refused by serve, router, pack and a subcommand's parser alike."""
    made_here = [f"{path.relative_to(REPO)}:{node.lineno}"
                 for path in (REPO / "polychip").rglob("*.py") if path.name != "flags.py"
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) ==
                 "ArgumentParser"]
    assert made_here == []
    for argv in (["serve", "--hos", "0.0.0.0"], ["router", "--replic", "http://x"],
                 ["pack", "-o", "x.pcpkg", "--device-conf", "spec.yaml"], ["workload", "submit", "m", "--devic", "cpu"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv


def test_pack_device_is_the_target_device_not_a_prefix_of_device_config():
    args = pack_cmd.build_parser().parse_args(["--device", "simxpu", "-o", "m.pcpkg"])
    assert (args.target_device, args.device_config) == ("simxpu", None)


@pytest.mark.parametrize("argv", ABBREVIATED + [["x"], ["--help"], ["--max-total-tokens", "many"]])
def test_serve_args_are_refused_unless_spelled_in_full_with_good_values(argv):
    with pytest.raises(ValueError, match="unrecognized arguments|invalid int value"):
        parse_serve_args(argv)


def test_serve_args_are_checked_by_the_settings_and_written_back_the_same():
    with pytest.raises(ValueError, match=r"mem_fraction_static must be in \(0, 1\)"):
        parse_serve_args(["--mem-fraction-static", "2"])
    with pytest.raises(ValueError, match="must be below chunked_prefill_size"):
        parse_serve_args(["--speculative-num-draft-tokens", "600"])
    values = parse_serve_args(["--max-total-tokens", "64", "--disable-fusion", "--enable-thinking", "false",
                               "--default-chat-template-kwargs", '{"a": 1}', "--plugin", "p.py", "--plugin", "q"])
    assert values == {"max_total_tokens": 64, "enable_fusion": False, "enable_thinking": False,
                      "default_chat_template_kwargs": {"a": 1}, "plugins": ("p.py", "q")}
    assert parse_serve_args(serve_argv(values)) == values


@pytest.fixture
def site(tmp_path):
    pub = signing.keygen(str(tmp_path / "site"))[1]
    return trust_store(tmp_path, {"site": pub})


def test_the_routers_trust_settings_are_applied_last_and_once(site):
    entry = ReplicaEntry(name="a", model="m", device="cpu", args=["--trust-store", "/srv/other", "--allow-unsigned"])
    with pytest.raises(ConfigError, match="--trust-store replaces the site trust store"):
        serve_command(entry, 0, "auto", None, RouterTrust(site))
    allowing = RouterTrust(site, allow_workload_flags=("trust-store", "allow-unsigned"))
    cmd = serve_command(entry, 0, "auto", None, allowing)
    assert cmd.count("--trust-store") == 1 and cmd[cmd.index("--trust-store") + 1] == os.path.join(site, "trust.yaml")


def workloads_file(tmp_path, serve_args, replica_args=()) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"""
replicas:
  - {{name: r, model: m, version: v1, device: cpu, args: {list(replica_args)}}}
models:
  - {{name: m, versions: {{v1: 1}}}}
workloads:
  - {{id: w, model: {tmp_path}, device: cpu, serve_args: {list(serve_args)}}}
""".replace("'", '"'))
    return str(path)


@pytest.mark.parametrize("argv", ABBREVIATED)
def test_a_deployment_files_abbreviated_serve_args_are_refused(tmp_path, argv):
    with pytest.raises(DeploymentError, match=r"workloads\.0\.serve_args: .*unrecognized arguments"):
        load_deployment(workloads_file(tmp_path, argv))
    with pytest.raises(DeploymentError, match=r"replicas\.0\.args: .*unrecognized arguments"):
        from_dict({"replicas": [{"name": "r", "model": "m", "device": "cpu", "args": argv}],
                   "models": [{"name": "m", "versions": {"v1": 1}}]})


@pytest.mark.parametrize("argv, why", GUARDED)
def test_a_deployment_files_guarded_serve_args_are_refused_by_the_router(tmp_path, capsys, argv, why):
    path = workloads_file(tmp_path, argv, replica_args=argv)
    assert router_cmd.main(["--deployment", path, "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert f"workloads.0.serve_args: {why}" in err and f"replicas.0.args: {why}" in err
    flag = argv[0].removeprefix("--")
    assert load_deployment(path, RouterTrust(allow_workload_flags=(flag,))).workloads[0].serve_args == argv


def in_process_router(trust, tmp_path):
    from polychip.router.app import Router
    from polychip.router.asgi import build_app
    from polychip.router.settings import RouterConfig
    inventory = Inventory(reader=lambda config, plugins: parse_devices_json(devices_json()))
    router = Router(RouterConfig(api_key=KEY, state="memory://", drain_timeout=1), inventory=inventory, trust=trust)
    return router, ThreadServer(build_app(router)).start()


def submit(url: str, model: str, serve_args) -> httpx.Response:
    return httpx.post(url + "/admin/workloads", headers=AUTH, timeout=30,
                      json={"model": model, "device": "cpu", "serve_args": serve_args})


def test_the_api_refuses_abbreviated_and_guarded_serve_args_naming_the_field(tmp_path):
    router, server = in_process_router(RouterTrust(), tmp_path)
    try:
        for argv in ABBREVIATED:
            r = submit(server.url, str(tmp_path), argv)
            assert r.status_code == 400 and "unrecognized arguments" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "serve_args"
        for argv, why in GUARDED:
            r = submit(server.url, str(tmp_path), argv)
            assert r.status_code == 422 and f"serve_args: {why}" in r.json()["error"]["message"], r.text
        assert httpx.get(server.url + "/admin/workloads", headers=AUTH).json()["data"] == []
        assert router.launcher.managed == {}
    finally:
        server.stop()


def test_an_allowed_guarded_flag_still_gets_the_routers_store(tmp_path, site):
    router, server = in_process_router(RouterTrust(site, allow_workload_flags=("trust-store",)), tmp_path)
    try:
        r = submit(server.url, str(tmp_path), ["--trust-store", "/srv/other", "--max-total-tokens", "64"])
        assert r.status_code == 202, r.text
        cmd = router.launcher.managed[r.json()["id"]].cmd
        assert cmd.count("--trust-store") == 1 and cmd[cmd.index("--trust-store") + 1] == os.path.join(site, "trust.yaml")
        assert cmd[cmd.index("--max-total-tokens") + 1] == "64"
    finally:
        server.stop()
