"""``polychip doctor``: each finding with its fix, exit status 1 on a failure."""
from __future__ import annotations

import datetime
import shutil
import socket

import pytest
from package_helpers import synthetic_package
from trust_helpers import trust_store

from polychip.commands import doctor
from polychip.trust import keys as signing
from polychip.trust.detached import sign_file
from test_trust_chain import SPEC

pytestmark = pytest.mark.device_independent


@pytest.fixture
def site(tmp_path):
    keys = {n: signing.keygen(str(tmp_path / n)) for n in ("now", "soon")}
    store = trust_store(tmp_path, {n: k[1] for n, k in keys.items()},
                        not_after={"soon": datetime.date.today() + datetime.timedelta(days=10)})
    spec = str(tmp_path / "spec.yaml")
    shutil.copyfile(SPEC, spec)
    sign_file(spec, keys["now"][0])
    return keys, store, spec


def test_a_healthy_host(tmp_path, site, capsys):
    keys, store, spec = site
    pkg = synthetic_package(tmp_path, key=keys["now"][0])
    assert doctor.main(["--trust-store", store, "--device-config", spec, "--package", pkg, "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert f"ok    device spec: {spec}: signed by {keys['now'][1]}" in out
    assert "ok    package signature" in out and "ok    devices: cpu" in out
    assert "expires on" in out and "(10 days)" in out and "fix: sign with a new key" in out   # a warning, not a failure


def test_failures_exit_1_with_their_fix(tmp_path, site, capsys):
    keys, store, spec = site
    with open(spec, "a") as f:
        f.write("# edited\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        rc = doctor.main(["--trust-store", store, "--device-config", spec, "--port", str(port),
                          "--package", synthetic_package(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"FAIL  device spec: {spec}: device spec refused: bad signature" in out and f"polychip sign {spec}" in out
    assert f"FAIL  port: 127.0.0.1:{port}: Address already in use" in out
    assert "FAIL  package signature: no manifest.sig" in out
