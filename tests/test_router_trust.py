"""The router's side of the trust chain: a deployment file is checked against the trust store
(changed or unsigned: refused, naming the file and the key), and the replicas it launches get
the same trust flags."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
from trust_helpers import trust_store

from polychip.commands import router as router_cmd
from polychip.router.deployment import ReplicaEntry, load_deployment
from polychip.router.fleet.launcher import Launcher, serve_command
from polychip.trust import keys as signing
from polychip.trust.detached import sign_file
from polychip.trust.options import TrustOptions

pytestmark = pytest.mark.device_independent
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "deploy", "mixed.yaml")


@pytest.fixture
def site(tmp_path):
    key = signing.keygen(str(tmp_path / "site"))
    dep = str(tmp_path / "deploy.yaml")
    shutil.copyfile(EXAMPLE, dep)
    sign_file(dep, key[0])
    return key, trust_store(tmp_path, {"site": key[1]}), dep


def test_a_signed_deployment_loads(site):
    _, store, dep = site
    assert [r.name for r in load_deployment(dep, TrustOptions(store)).replicas][:2] == ["cpu-a", "cpu-b"]


def test_a_changed_deployment_is_refused_by_the_router(site, capsys):
    key, store, dep = site
    with open(dep) as f:
        text = f.read()
    with open(dep, "w") as f:
        f.write(text.replace("{v1: 90, v2: 10}", "{v1: 10, v2: 90}"))        # the canary's weights, changed
    assert router_cmd.main(["--deployment", dep, "--trust-store", store, "--port", "0"]) == 1
    err = capsys.readouterr().err
    kid = signing.load_trusted_key(key[1]).key_id
    assert f"{dep}: deployment file refused: bad signature" in err and kid[:16] in err


def test_an_unsigned_deployment_is_refused_then_allowed(site, caplog):
    _, store, dep = site
    os.unlink(dep + ".sig")
    with pytest.raises(Exception, match="deployment file is unsigned"):
        load_deployment(dep, TrustOptions(store))
    with caplog.at_level(logging.WARNING, logger="polychip.trust"):
        assert load_deployment(dep, TrustOptions(store, allow_unsigned=True)).replicas
    assert any("TRUST OVERRIDE" in r.message and dep in r.message for r in caplog.records)


def test_launched_replicas_get_the_trust_flags(site):
    _, store, _ = site
    trust = TrustOptions(store, allow_downgrade=True)
    values = trust.replica_values()
    assert values == {"trust_store": os.path.join(os.path.abspath(store), "trust.yaml"), "allow_downgrade": True}
    entry = ReplicaEntry(name="a", model="m", version="v1", device="cpu")
    cmd = serve_command(entry, 4000, "auto", None, Launcher(trust=trust).trust)
    assert cmd[cmd.index("--trust-store") + 1] == values["trust_store"] and "--allow-downgrade" in cmd
