"""The router's one settings model (polychip/router/settings.py): every setting is a flag and a key
of the deployment file's router section, with one default; a flag wins over the file; a reload
applies the router section live or refuses, naming the field, what cannot change while it runs."""
from __future__ import annotations

import argparse

import httpx
import pytest
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

from polychip.commands import router as router_cmd
from polychip.router.deployment import from_dict, load_deployment
from polychip.router.settings import RouterConfig, reload_changes
from polychip.router.settings_flags import _fields, settings_from_args
from polychip.errors import ConfigError

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

SETTINGS = list(_fields(RouterConfig))


def other_value(path: tuple, field):
    """A valid value that is not the default, as (python value, command-line text)."""
    special = {("policy",): ("round_robin", "round_robin"),
               ("priority_weights",): ({"high": 5.0, "normal": 1.0, "low": 1.0}, "high=5"),
               ("replica_priorities",): ({"high": -20, "normal": 0, "low": 10}, "high=-20"),
               ("guard", "confidence"): (0.9, "0.9"), ("total_timeout",): (900.0, "900.0"),
               ("state",): ("memory://", "memory://"),
               ("placement", "slo_ttft_ms"): ({"high": 500.0}, "high=500"),
               ("placement", "slo_tpot_ms"): ({"normal": 40.0}, "normal=40"),
               ("placement", "hot_weight"): (0.5, "0.5")}
    if path in special:
        return special[path]
    default = field.get_default(call_default_factory=True)
    if path[-1] in ("host",):
        return "127.0.0.2", "127.0.0.2"
    if default is None and "str" in str(field.annotation):
        return "/tmp/polychip-x", "/tmp/polychip-x"
    if default is None and "int" in str(field.annotation):
        return 3, "3"
    if default is None:
        return 0.5, "0.5"
    if isinstance(default, int):
        return default + 1, str(default + 1)
    value = default / 2 if path[-1] in ("max_error_rate", "match_threshold") else default * 2 + (path[-1] == "balance_rel")
    return value, repr(value)


def get(cfg, path):
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


def nested(path, value) -> dict:
    keys = {"health": "health_check", "guard": "canary_guard"}
    out = value
    for name in reversed(path):
        out = {keys.get(name, name) if len(path) > 1 and name == path[0] else name: out}
    return out


# settings valid only together: each is given with its partner
PARTNERS = {"replica_client_cert": "replica_client_key", "replica_client_key": "replica_client_cert",
            "cert": "key", "key": "cert", "user": "password_file", "password_file": "user"}


def partners(path) -> tuple[list[str], dict]:
    """The flags and the router-section keys that must come with the setting at ``path``: its
    partner, and for the etcd access settings a --state etcds://..."""
    partner = PARTNERS.get(path[-1])
    if path[0] != "etcd":
        return (["--" + partner.replace("_", "-"), "/tmp/polychip-partner"], {partner: "/tmp/polychip-partner"}) \
            if partner else ([], {})
    flags, etcd = ["--state", "etcds://h:2379"], {}
    if partner:
        flags += ["--etcd-" + partner.replace("_", "-"), "/tmp/polychip-partner"]
        etcd[partner] = "/tmp/polychip-partner"
    return flags, {"state": "etcds://h:2379", "etcd": etcd}


@pytest.mark.parametrize("path,flag,field", SETTINGS, ids=[".".join(p) for p, _, _ in SETTINGS])
def test_every_setting_is_a_flag_and_a_file_key(path, flag, field):
    value, text = other_value(path, field)
    assert get(RouterConfig(), path) != value
    extra_args, extra_keys = partners(path)
    args = router_cmd.build_parser().parse_args(["--replica", "http://x:1", flag, text] + extra_args)
    assert get(settings_from_args(args), path) == value                     # the flag
    section = nested(path, value)
    for key, more in extra_keys.items():
        section[key] = {**section.get(key, {}), **more} if isinstance(more, dict) else more
    dep = from_dict({"replicas": [{"name": "a", "model": "m", "url": "http://x:1"}],
                     "models": [{"name": "m", "versions": {"default": 1}}], "router": section})
    assert get(dep.router, path) == value                                   # the file's router section


def test_help_shows_each_default_once_from_the_model():
    text = router_cmd.build_parser().format_help()
    assert "--health-check-interval" in text and "(default: 5.0)" in text
    assert "--prefix-match-threshold" in text and "--connect-timeout" in text and "--canary-window" in text


def test_a_flag_wins_over_the_file():
    dep = from_dict({"replicas": [{"name": "a", "model": "m", "url": "http://x:1"}],
                     "models": [{"name": "m", "versions": {"default": 1}}],
                     "router": {"policy": "prefix_aware", "max_retries": 5, "health_check": {"interval": 2}}})
    args = router_cmd.build_parser().parse_args(["--deployment", "f", "--max-retries", "1"])
    cfg = settings_from_args(args, dep.router)
    assert (cfg.policy, cfg.max_retries, cfg.health.interval) == ("prefix_aware", 1, 2)


def test_a_bad_flag_value_is_one_error_naming_the_field(capsys):
    assert router_cmd.main(["--replica", "http://x:1", "--max-retries", "-1", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: [config]") and "max_retries" in err and "greater than or equal to 0" in err


def test_reload_changes_names_what_cannot_change_live():
    old = RouterConfig()
    assert reload_changes(old, old.replace(max_retries=0, policy="round_robin")) == ["policy", "max_retries"]
    with pytest.raises(ConfigError, match=r"router\.port, router\.connect_timeout cannot change"):
        reload_changes(old, old.replace(port=1, connect_timeout=1.0))


def file_text(url: str, router: str) -> str:
    return (f"replicas:\n  - {{name: a, model: m, version: v1, url: '{url}'}}\n"
            f"models:\n  - {{name: m, versions: {{v1: 1}}}}\nrouter:\n{router}")


@pytest.fixture
def replica():
    fake = FakeReplica(model="m", version="v1")
    with ThreadServer(fake.app) as s:
        yield s


@pytest.fixture
def started(tmp_path, replica):
    """(file, server, router): a router started from a deployment file, its replica up."""
    path = tmp_path / "d.yaml"
    path.write_text(file_text(replica.url, "  health_check: {interval: 0.2}\n"))
    dep = load_deployment(str(path))
    srv, router = start_router(dep.router, [], dep, str(path))
    try:
        wait_for(lambda: router.registry.workers["a"].up, 10, "a up")
        yield path, srv, router
    finally:
        srv.stop()


def test_reload_applies_the_router_section(started, replica):
    path, srv, router = started
    path.write_text(file_text(replica.url, "  health_check: {interval: 0.3}\n  policy: round_robin\n"
                                           "  priority_weights: {high: 7}\n  max_queue: 5\n  api_key: sesame\n"))
    r = httpx.post(srv.url + "/admin/reload", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["settings_changed"] == ["policy", "priority_weights", "health.interval", "max_queue",
                                            "api_key"]
    assert router.dispatcher.policy.name == "round_robin" and router.health.cfg.interval == 0.3
    assert router.dispatcher.queue.weights["high"] == 7 and router.dispatcher.queue.max_size == 5
    body = {"prompt": "x", "max_tokens": 1}
    assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401      # the new key, live
    ok = httpx.post(srv.url + "/v1/completions", json=body, headers={"authorization": "Bearer sesame"})
    assert ok.status_code == 200


def test_reload_refuses_what_cannot_change_live_and_keeps_everything(started, replica):
    path, srv, router = started
    before = router.cfg
    path.write_text(file_text(replica.url, "  health_check: {interval: 0.2}\n  connect_timeout: 1\n"
                                           "  max_retries: 0\n"))
    r = httpx.post(srv.url + "/admin/reload", timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("router.connect_timeout cannot change while the router runs")
    assert router.cfg is before and router.proxy.cfg is before and router.cfg.max_retries == 2


def test_settings_from_args_ignores_flags_not_given():
    args = argparse.Namespace(replica=[], deployment=None)
    assert settings_from_args(args) == RouterConfig()
