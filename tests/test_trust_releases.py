"""``releases.json``, the one file of the trust store the serving user writes: concurrent writers
in several processes lose no record, it is written in place (the store's folder may be read-only to
the serving user), and a store that every user may write is refused."""
from __future__ import annotations

import multiprocessing
import os
import stat

import pytest
from trust_helpers import trust_store

from polychip.errors import ConfigError
from polychip.trust import keys as signing
from polychip.trust.store import TrustStore

pytestmark = pytest.mark.device_independent
WRITERS, EACH = 6, 20


@pytest.fixture
def store(tmp_path):
    _, pub = signing.keygen(str(tmp_path / "site"))
    return trust_store(tmp_path, {"site": pub})


def _write_releases(store: str, writer: int, start) -> None:
    start.wait()
    loaded = TrustStore.load(store)
    for j in range(EACH):
        loaded.record_release(f"model-{writer}-{j}", 1, "0" * 64, f"/pkgs/{writer}-{j}.pcpkg")


def test_concurrent_writers_lose_no_release(store):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_write_releases, args=(store, w, start)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    seen = TrustStore.load(store).releases()
    assert sorted(seen) == sorted(f"model-{w}-{j}" for w in range(WRITERS) for j in range(EACH))
    assert stat.S_IMODE(os.stat(os.path.join(store, "releases.json")).st_mode) == 0o644


def test_releases_are_written_in_place_so_the_store_folder_can_be_read_only(store):
    loaded = TrustStore.load(store)
    loaded.record_release("smol", 1, "a" * 64, "/pkgs/smol-1.pcpkg")
    path = os.path.join(store, "releases.json")
    inode, listing = os.stat(path).st_ino, sorted(os.listdir(store))
    os.chmod(store, 0o555)                        # the serving user may write releases.json only
    try:
        for name, number, digest in (("smol", 2, "b"), ("other", 1, "c")):
            loaded.record_release(name, number, digest * 64, f"/pkgs/{name}-{number}.pcpkg")
            # the same file (as root, where the mode does not stop a new file, this is what shows it)
            assert os.stat(path).st_ino == inode and sorted(os.listdir(store)) == listing
    finally:
        os.chmod(store, 0o755)
    seen = TrustStore.load(store).releases()
    assert (seen["smol"]["release"], seen["smol"]["manifest_sha256"], seen["other"]["release"]) == (2, "b" * 64, 1)


@pytest.mark.parametrize("what", ["trust.yaml", ".", "key"])
def test_a_store_every_user_may_write_is_refused(store, tmp_path, what):
    path = {"trust.yaml": os.path.join(store, "trust.yaml"), ".": store, "key": str(tmp_path / "site.pub")}[what]
    os.chmod(path, os.stat(path).st_mode | stat.S_IWOTH)
    with pytest.raises(ConfigError, match="writable by every user") as err:
        TrustStore.load(store)
    assert path in str(err.value)


def test_a_damaged_releases_file_is_one_clear_error(store):
    with open(os.path.join(store, "releases.json"), "w") as f:
        f.write('{"smol": {"release": ')
    with pytest.raises(ConfigError, match="releases.json: cannot read the releases seen"):
        TrustStore.load(store).check_release("smol", 1, "x.pcpkg", False)
