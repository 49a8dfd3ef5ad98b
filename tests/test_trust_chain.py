"""The site trust chain (polychip/trust): each refusal names the file or the key, each override
loads and says so in a TRUST OVERRIDE log line."""
from __future__ import annotations

import datetime
import logging
import os
import shutil

import pytest
from package_helpers import synthetic_package
from trust_helpers import install_wheel_plugin, trust_store

from polychip.commands import serve as serve_cmd
from polychip.commands import verify as verify_cmd
from polychip.devices.discovery import open_device
from polychip.errors import PolychipError
from polychip.trust import keys as signing
from polychip.package.opening import PackageOptions, open_package
from polychip.trust.detached import verify_file, sign_file
from polychip.trust.options import TrustOptions
from polychip.trust.pins import pin_of
from polychip.trust.store import TrustStore

pytestmark = pytest.mark.device_independent
SPEC = os.path.join(os.path.dirname(__file__), "..", "examples", "specs", "cpu-2.yaml")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {name: signing.keygen(str(d / name)) for name in ("site", "old", "lost", "stranger")}


@pytest.fixture
def store(tmp_path, keys):
    yesterday = datetime.date.today() - datetime.timedelta(days=1)
    return trust_store(tmp_path, {k: keys[k][1] for k in ("site", "old", "lost")}, revoked={"lost": "laptop stolen"},
                       not_after={"old": yesterday})


def _open(pkg, tmp_path, trust, plugin=None):
    return open_package(pkg, PackageOptions(), str(tmp_path / "cache"), plugin, trust)


def test_signed_package_opens_with_the_store(tmp_path, keys, store):
    opened = _open(synthetic_package(tmp_path, key=keys["site"][0]), tmp_path, TrustOptions(store))
    assert opened.signer == keys["site"][1] and set(opened.costs) >= {"signature", "release", "files"}


@pytest.mark.parametrize("signer,why", [("old", "expired on"), ("lost", "is revoked in the trust store"),
                                        ("stranger", "not a trusted key")])
def test_expired_revoked_and_unknown_keys_are_refused(tmp_path, keys, store, signer, why):
    pkg = synthetic_package(tmp_path, key=keys[signer][0])
    with pytest.raises(PolychipError, match=why) as err:
        _open(pkg, tmp_path, TrustOptions(store))
    kid = signing.load_trusted_key(keys[signer][1]).key_id
    assert pkg in str(err.value) and kid[:16] in str(err.value)        # the package and the key, named
    if signer == "lost":
        assert "laptop stolen" in str(err.value)


def test_revoked_wins_over_a_trusted_key_flag(tmp_path, keys, store):
    pkg = synthetic_package(tmp_path, key=keys["lost"][0])
    with pytest.raises(PolychipError, match="revoked"):
        open_package(pkg, PackageOptions((keys["lost"][1],)), str(tmp_path / "c"), None, TrustOptions(store))


def test_unsigned_package_refused_then_allowed_loudly(tmp_path, store, caplog):
    pkg = synthetic_package(tmp_path)
    with pytest.raises(PolychipError, match="unsigned") as err:
        _open(pkg, tmp_path, TrustOptions(store))
    assert pkg in str(err.value)
    with caplog.at_level(logging.WARNING, logger="polychip.trust"):
        opened = _open(pkg, tmp_path, TrustOptions(store, allow_unsigned=True))
    assert opened.signer is None
    assert any("TRUST OVERRIDE" in r.message and pkg in r.message and "UNSIGNED" in r.message for r in caplog.records)


def test_allow_flags_need_a_store(tmp_path, monkeypatch):
    monkeypatch.delenv("POLYCHIP_TRUST_STORE", raising=False)
    with pytest.raises(PolychipError, match="--allow-unsigned overrides the trust store, and none is set"):
        _open(synthetic_package(tmp_path), tmp_path, TrustOptions(allow_unsigned=True))


def test_store_from_the_environment(tmp_path, store, monkeypatch):
    monkeypatch.setenv("POLYCHIP_TRUST_STORE", store)
    with pytest.raises(PolychipError, match="unsigned"):
        _open(synthetic_package(tmp_path), tmp_path, TrustOptions())


@pytest.mark.parametrize("text, says", [
    ("keys: [file: a.pub\n", "malformed YAML at line 2"),
    ("", "the file is empty"),
    ("keys: []\n", "non-empty 'keys' list"),
])
def test_a_broken_trust_store_is_one_clear_error(tmp_path, text, says):
    (tmp_path / "trust.yaml").write_text(text)
    with pytest.raises(PolychipError, match=says) as got:
        TrustStore.load(str(tmp_path))
    assert str(tmp_path / "trust.yaml") in str(got.value)
    with pytest.raises(PolychipError, match="trust store file not found"):
        TrustStore.load(str(tmp_path / "missing.yaml"))


def test_downgrade_refused_then_allowed(tmp_path, keys, store, caplog):
    def pkg(number):
        return synthetic_package(tmp_path, key=keys["site"][0], name=f"m{number}.pcpkg",
                                 extra={"release": {"name": "smol", "number": number}})
    _open(pkg(2), tmp_path, TrustOptions(store))
    assert TrustStore.load(store).releases()["smol"]["release"] == 2
    old = pkg(1)
    with pytest.raises(PolychipError, match="release 1 of 'smol' is older than release 2") as err:
        _open(old, tmp_path, TrustOptions(store))
    assert old in str(err.value) and "m2.pcpkg" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="polychip.trust"):
        _open(old, tmp_path, TrustOptions(store, allow_downgrade=True))
    assert any("TRUST OVERRIDE" in r.message and "--allow-downgrade" in r.message for r in caplog.records)
    assert TrustStore.load(store).releases()["smol"]["release"] == 2       # the highest stays


def test_verify_command_uses_the_store(tmp_path, keys, store, capsys):
    good = synthetic_package(tmp_path, key=keys["site"][0], name="good.pcpkg")
    bad = synthetic_package(tmp_path, key=keys["old"][0], name="bad.pcpkg")
    assert verify_cmd.main([good, "--trust-store", store, "--skip-device"]) == 0
    assert verify_cmd.main([bad, "--trust-store", store, "--skip-device"]) == 1
    assert "expired on" in capsys.readouterr().out


# device specs: detached signatures
@pytest.fixture
def spec(tmp_path, keys):
    path = str(tmp_path / "cpu-2.yaml")
    shutil.copyfile(SPEC, path)
    sign_file(path, keys["site"][0])
    return path


def test_signed_spec_verifies(spec, store, keys):
    assert verify_file(spec, TrustStore.load(store), what="device spec") == keys["site"][1]


def test_tampered_spec_refused_by_serve(spec, store, keys, capsys):
    with open(spec) as f:
        text = f.read()
    with open(spec, "w") as f:
        f.write(text.replace("total: 2GiB", "total: 3GiB"))            # the memory size, changed
    rc = serve_cmd.main(["--device-config", spec, "--trust-store", store, "--port", "1"])
    err = capsys.readouterr().err
    kid = signing.load_trusted_key(keys["site"][1]).key_id
    assert rc == 1 and spec in err and "bad signature" in err and kid[:16] in err and keys["site"][1] in err


def test_unsigned_spec_refused_then_allowed(spec, store, caplog):
    os.unlink(spec + ".sig")
    with pytest.raises(PolychipError, match="device spec is unsigned") as err:
        verify_file(spec, TrustStore.load(store), what="device spec")
    assert spec in str(err.value)
    with caplog.at_level(logging.WARNING, logger="polychip.trust"):
        assert verify_file(spec, TrustStore.load(store), allow_unsigned=True, what="device spec") is None
    assert any("TRUST OVERRIDE" in r.message and spec in r.message for r in caplog.records)


def test_spec_signed_by_a_revoked_key(tmp_path, spec, store, keys):
    sign_file(spec, keys["lost"][0])
    with pytest.raises(PolychipError, match="revoked") as err:
        verify_file(spec, TrustStore.load(store), what="device spec")
    assert spec in str(err.value) and keys["lost"][1] in str(err.value)


# plugins pinned by the package
@pytest.fixture(scope="module")
def wheel_plugin(tmp_path_factory):
    site = str(tmp_path_factory.mktemp("site-packages"))
    target = install_wheel_plugin(site)
    plugin = open_device("pinnedcpu", (target,))
    yield site, plugin
    plugin.destroy()


def _pinned_package(tmp_path, plugin, keys):
    return synthetic_package(tmp_path, key=keys["site"][0], device_types=("pinnedcpu",),
                             extra={"plugin_pin": pin_of(plugin)})


def test_pin_is_the_wheel_record(wheel_plugin):
    _, plugin = wheel_plugin
    pin = pin_of(plugin)
    assert pin["installed"] == "wheel" and pin["distribution"] == "pinnedcpu-plugin" and pin["version"] == "1.0"
    assert sorted(pin["files"]) == ["pinnedcpu_plugin/__init__.py", "pinnedcpu_plugin/extra.py"]


def test_tampered_plugin_file_refused_then_warned(tmp_path, wheel_plugin, keys, store, caplog):
    site, plugin = wheel_plugin
    pkg = _pinned_package(tmp_path, plugin, keys)
    _open(pkg, tmp_path, TrustOptions(store), plugin)                    # as pinned: opens
    extra = os.path.join(site, "pinnedcpu_plugin", "extra.py")
    with open(extra, "a") as f:
        f.write("import os  # changed after packing\n")
    try:
        with pytest.raises(PolychipError, match="pinnedcpu_plugin/extra.py: modified") as err:
            _open(pkg, tmp_path, TrustOptions(store), plugin)
        assert pkg in str(err.value) and "pinnedcpu" in str(err.value)
        with caplog.at_level(logging.WARNING, logger="polychip.trust"):
            _open(pkg, tmp_path, TrustOptions(store, allow_modified_plugin=True), plugin)
        assert any("TRUST OVERRIDE" in r.message and "extra.py" in r.message for r in caplog.records)
    finally:
        with open(extra, "w") as f:
            f.write("VALUE = 1\n")


def test_added_plugin_file_refused(tmp_path, wheel_plugin, keys):
    site, plugin = wheel_plugin
    pkg = _pinned_package(tmp_path, plugin, keys)
    added = os.path.join(site, "pinnedcpu_plugin", "sneaky.py")
    with open(added, "w") as f:
        f.write("print('hi')\n")
    try:
        with pytest.raises(PolychipError, match="pinnedcpu_plugin/sneaky.py: extra file"):
            _open(pkg, tmp_path, TrustOptions(), plugin)
    finally:
        os.unlink(added)


def test_a_model_folder_is_unsigned_once_a_store_is_set(tmp_path, store, caplog):
    from polychip.config import EngineConfig
    from polychip.package.opening import engine_config_for
    folder = str(tmp_path / "model")
    os.makedirs(folder)
    config = EngineConfig(model_path=folder)
    with pytest.raises(PolychipError, match=f"{folder}: not a signed .pcpkg package, and the trust store"):
        engine_config_for(config, PackageOptions(), TrustOptions(store))
    with caplog.at_level(logging.WARNING, logger="polychip.trust"):
        assert engine_config_for(config, PackageOptions(), TrustOptions(store, allow_unsigned=True)) is config
    assert any("TRUST OVERRIDE" in r.message and folder in r.message for r in caplog.records)


def test_llm_and_batch_refuse_an_unsigned_model_once_a_store_is_set(tmp_path, store, monkeypatch, capsys,
                                                                     model_factory, caplog):
    """``polychip.LLM`` and ``polychip batch`` apply the store as serve does: from the environment,
    before the model loads; --allow-unsigned loads it, said as a TRUST OVERRIDE."""
    from polychip import LLM
    from polychip.commands import batch as batch_cmd
    folder = model_factory("llama", True)
    monkeypatch.setenv("POLYCHIP_TRUST_STORE", store)
    with pytest.raises(PolychipError, match=f"{folder}: not a signed .pcpkg package, and the trust store"):
        LLM(folder, device="cpu", max_total_tokens=256)
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    args = ["-i", str(lines), "-o", str(tmp_path / "out.jsonl"), "--model-path", folder, "--device", "cpu"]
    assert batch_cmd.main(args) == 1
    assert f"{folder}: not a signed .pcpkg package, and the trust store" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    with caplog.at_level(logging.WARNING, logger="polychip.trust"):
        llm = LLM(folder, allow_unsigned=True, device="cpu", max_total_tokens=256)
    try:
        assert len(llm.generate("hi")[0].outputs[0].token_ids) > 0
    finally:
        llm.shutdown()
    assert any("TRUST OVERRIDE" in r.message and folder in r.message for r in caplog.records)
