"""``polychip trust init|add-key|revoke`` write the trust store the reader reads: a package signed
by an added key opens, one signed by a revoked key is refused with the reason, and each mistake
(a second init, a key twice, a file that is no key, an abbreviated flag) is one clear error."""
from __future__ import annotations

import datetime
import json
import os
import stat

import pytest
from package_helpers import synthetic_package

from polychip import cli
from polychip.errors import PolychipError
from polychip.package.opening import PackageOptions, open_package
from polychip.trust import keys as signing
from polychip.trust.options import TrustOptions
from polychip.trust.store import TrustStore

pytestmark = pytest.mark.device_independent


def _opens(pkg: str, store: str, tmp_path) -> str | None:
    """None when the package opens against ``store``, else the refusal."""
    try:
        open_package(pkg, PackageOptions(), str(tmp_path / "cache"), None, TrustOptions(store))
        return None
    except PolychipError as e:
        return str(e)


def test_init_add_key_and_revoke_write_the_store_the_reader_reads(tmp_path, capsys):
    site, site_pub = signing.keygen(str(tmp_path / "site"))
    nxt, next_pub = signing.keygen(str(tmp_path / "next"))
    store = str(tmp_path / "etc" / "trust")
    assert cli.main(["trust", "init", store, "--key", site_pub, "--not-after", "2030-01-31"]) == 0
    loaded = TrustStore.load(store)
    assert [(k.key.key_id, k.not_after) for k in loaded.keys] == \
        [(signing.load_trusted_key(site_pub).key_id, datetime.date(2030, 1, 31))]
    modes = {name: stat.S_IMODE(os.stat(os.path.join(store, name)).st_mode)
             for name in (".", "trust.yaml", "releases.json", "keys/site.pub")}
    assert modes == {".": 0o755, "trust.yaml": 0o644, "releases.json": 0o644, "keys/site.pub": 0o644}
    with open(os.path.join(store, "releases.json")) as f:
        assert json.load(f) == {}
    by_site = synthetic_package(tmp_path, key=site, name="a.pcpkg")
    by_next = synthetic_package(tmp_path, key=nxt, name="b.pcpkg")
    assert _opens(by_site, store, tmp_path) is None
    assert "not a trusted key" in _opens(by_next, store, tmp_path)

    assert cli.main(["trust", "add-key", store, "--key", next_pub]) == 0
    year = datetime.date.today() + datetime.timedelta(days=365)
    assert [k.not_after for k in TrustStore.load(store).keys] == [datetime.date(2030, 1, 31), year]
    assert _opens(by_next, store, tmp_path) is None

    assert cli.main(["trust", "revoke", store, "--key", next_pub, "--reason", "laptop lost"]) == 0
    refusal = _opens(by_next, store, tmp_path)
    assert "is revoked in the trust store" in refusal and "laptop lost" in refusal
    assert _opens(by_site, store, tmp_path) is None
    assert f"serve with --trust-store {store}" in capsys.readouterr().out


def test_trust_command_mistakes_are_one_clear_error(tmp_path, capsys):
    _, pub = signing.keygen(str(tmp_path / "site"))
    store = str(tmp_path / "trust")
    assert cli.main(["trust", "init", store, "--key", pub]) == 0
    capsys.readouterr()
    not_a_key = tmp_path / "x.pub"
    not_a_key.write_text("hello")
    for argv, says in ((["init", store, "--key", pub], "already holds a trust.yaml"),
                       (["add-key", store, "--key", pub], "is already in the trust store"),
                       (["add-key", store, "--key", str(not_a_key)], "x.pub"),
                       (["revoke", store, "--key-id", "abc", "--reason", "r"], "neither a key id")):
        assert cli.main(["trust", *argv]) == 1, argv
        assert says in capsys.readouterr().err, argv
    before = open(os.path.join(store, "trust.yaml")).read()
    for argv in (["init", str(tmp_path / "t2"), "--ke", pub], ["add-key", store, "--key", pub, "--not-after", "soon"],
                 ["revoke", store, "--key", pub]):
        with pytest.raises(SystemExit) as e:            # no prefix matching; a date; a reason
            cli.main(["trust", *argv])
        assert e.value.code == 2, argv
    assert open(os.path.join(store, "trust.yaml")).read() == before and not os.path.exists(tmp_path / "t2")
