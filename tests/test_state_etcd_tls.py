"""etcd over TLS with authentication (finding 2): a real etcd with --client-cert-auth, a CA and
certificates made here, auth on (a polychip user whose role may touch /polychip/ only). The router
reaches it with its CA, client certificate and user (password from a file), keeps working when its
token expires, and is refused at start, with one clear line naming the store and the cause, without
the client certificate, with a wrong password, with another CA, or with no user at all."""
from __future__ import annotations

import time

import pytest

from polychip.commands import router as router_cmd
from polychip.router.settings import EtcdAccess
from polychip.router.state import StoreError, open_store
from tests.etcd_secure import TOKEN_TTL, SecureEtcd

pytestmark = pytest.mark.device_independent


@pytest.fixture(scope="module")
def etcd():
    cluster = SecureEtcd()
    yield cluster
    cluster.stop()


def _open(etcd, **changes):
    return open_store(etcd.spec, access=EtcdAccess(**etcd.access(**changes)))


def test_the_router_reads_writes_watches_and_leases_over_tls_as_its_user(etcd):
    store = _open(etcd)
    try:
        seen = []
        rev = store.put("models/m", {"weights": {"v1": 1.0}})
        watch = store.watch("models/", seen.append, rev + 1)
        lease = store.grant_lease(5)
        store.put("replicas/a", {"url": "http://x"}, lease=lease)
        store.put("models/m", {"weights": {"v1": 0.5}})
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [e.value for e in seen] == [{"weights": {"v1": 0.5}}]
        assert store.get("replicas/a").lease == lease and store.refresh_lease(lease)
        shown = store.describe()
        assert shown["tls"] is True and shown["user"] == "polychip" and shown["endpoints"][0].startswith("https://")
        # the token expires when unused for --auth-token-ttl: the next call asks for a new one and goes on
        token = store.members[0]._token
        time.sleep(TOKEN_TTL + 1.5)
        assert store.get("models/m").value == {"weights": {"v1": 0.5}}
        assert store.members[0]._token != token
        watch.cancel()
        store.revoke_lease(lease)
    finally:
        store.close()


@pytest.mark.parametrize("case, changes, said", [
    ("no client certificate", {"cert": None, "key": None}, "asks for a client certificate and this router gives none"),
    ("a certificate from another CA", "rogue", "refused this router's client certificate"),
    ("a CA that did not sign the server's", "rogue-ca", "does not chain to the CA bundle"),
    ("a wrong password", "wrong-password", "user 'polychip' was refused: wrong password"),
    ("no etcd user", {"user": None, "password_file": None}, "has authentication on: give --etcd-user"),
])
def test_a_router_that_cannot_prove_itself_is_refused_at_start_with_the_cause(etcd, tmp_path, case, changes, said):
    if changes == "rogue":
        changes = {"cert": etcd.certs.rogue[0], "key": etcd.certs.rogue[1]}
    elif changes == "rogue-ca":
        changes = {"ca": etcd.certs.rogue[0]}
    elif changes == "wrong-password":
        (tmp_path / "pw").write_text("not-the-password\n")
        changes = {"password_file": str(tmp_path / "pw")}
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        _open(etcd, **changes)
    assert said in str(e.value) and etcd.endpoints[0] in str(e.value), (case, str(e.value))
    assert not e.value.retryable and time.monotonic() - t0 < 5, "refused at once, not after the failover window"


def test_polychip_router_without_its_client_certificate_exits_with_one_line(etcd, capsys):
    """The whole command: the state store opens when the router starts; the operator sees the
    store, the member and the cause, and no traceback."""
    rc = router_cmd.main(["--port", "0", "--state", etcd.spec, "--etcd-ca", etcd.certs.ca,
                          "--etcd-user", "polychip", "--etcd-password-file", etcd.certs.password_file])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"etcd at https://{etcd.endpoints[0]}: it asks for a client certificate" in err, err
    assert "Traceback" not in err


def test_settings_refuse_a_password_over_plain_http_and_half_pairs():
    from polychip.errors import ConfigError
    from polychip.router.settings import RouterConfig
    access = EtcdAccess(user="polychip", password_file="/run/secrets/etcd-password")
    with pytest.raises(ConfigError, match="etcds://... only"):
        RouterConfig().replace(state="etcd://h:2379", etcd=access)
    assert RouterConfig().replace(state="etcds://h:2379", etcd=access).etcd.user == "polychip"
    with pytest.raises(ConfigError, match="etcd.cert and etcd.key go together"):
        RouterConfig().replace(state="etcds://h:2379", etcd={"cert": "/c.pem"})
    # no setting holds the password itself: only the file it is read from
    assert set(EtcdAccess.model_fields) == {"ca", "cert", "key", "user", "password_file"}
