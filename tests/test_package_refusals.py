"""Every way a package is refused, each with its own test: the error names the file and the
reason, and nothing is extracted (the cache holds no package folder and no leftover)."""
from __future__ import annotations

import json
import os
import tarfile

import pytest
from package_helpers import plain, read_members, special, synthetic_package, write_members

from polychip.devices.discovery import open_device
from polychip.errors import ConfigError
from polychip.package import PackageError
from polychip.trust import keys as signing
from polychip.package.opening import PackageOptions, open_package

pytestmark = pytest.mark.device_independent   # pins the devices it checks (conftest.py)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {name: signing.keygen(str(d / name)) for name in ("site", "other")}    # name -> (private, public)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def refused(pkg: str, cache: str, match: str, options=PackageOptions(), plugin=None):
    with pytest.raises(PackageError, match=match) as err:
        open_package(pkg, options, cache, plugin)
    assert pkg in str(err.value)                               # names the package ...
    root = os.path.join(cache, "packages")
    assert not os.path.exists(root) or os.listdir(root) == []   # ... and leaves nothing behind
    return str(err.value)


def edited(pkg: str, edit) -> str:
    """The package with its (TarInfo, bytes) member list passed through ``edit``, written beside it."""
    return write_members(pkg.replace(".pcpkg", "-edited.pcpkg"), edit(read_members(pkg)))


def test_a_good_package_opens(tmp_path, cache, keys):
    pkg = synthetic_package(tmp_path, key=keys["site"][0])
    opened = open_package(pkg, PackageOptions((keys["site"][1],)), cache, open_device("cpu"))
    assert sorted(os.listdir(opened.model_dir)) == ["config.json", "model.safetensors", "plan.json"]
    assert opened.signer == keys["site"][1] and opened.extracted and opened.warnings == []


def test_hash_mismatch(tmp_path, cache):
    def flip(members):
        info, data = members[3]
        assert info.name == "model.safetensors"
        members[3] = (info, data[:-1] + bytes([data[-1] ^ 1]))     # same size, one bit differs
        return members
    msg = refused(edited(synthetic_package(tmp_path), flip), cache, "model.safetensors: hash mismatch")
    assert "the manifest says" in msg


def test_missing_file(tmp_path, cache):
    pkg = edited(synthetic_package(tmp_path), lambda ms: [m for m in ms if m[0].name != "config.json"])
    refused(pkg, cache, "config.json: missing: listed in the manifest but not in the package")


def test_extra_file(tmp_path, cache):
    pkg = edited(synthetic_package(tmp_path), lambda ms: ms + [plain("extra.safetensors", b"x")])
    refused(pkg, cache, "extra.safetensors: extra file: not listed in the manifest")


def test_executable_or_pickled_members_are_refused(tmp_path, cache):
    for name in ("model.py", "pytorch_model.bin"):
        pkg = edited(synthetic_package(tmp_path, name=f"{name}.pcpkg"),
                     lambda ms, n=name: ms[:1] + [plain(n, b"import os")] + ms[1:])
        refused(pkg, cache, rf"{name}: not a data file .*nothing in a package is executed")


def test_missing_signature_when_required(tmp_path, cache, keys):
    refused(synthetic_package(tmp_path), cache, "signature: no manifest.sig: the package is unsigned and a "
            "signature is required", PackageOptions((keys["site"][1],), require_signature=True))


def test_missing_signature_with_a_trusted_key(tmp_path, cache, keys):
    refused(synthetic_package(tmp_path), cache, "no manifest.sig", PackageOptions((keys["site"][1],)))


def test_bad_signature(tmp_path, cache, keys):
    def tamper(members):
        info, data = members[0]
        manifest = json.loads(data)
        manifest["model"]["source"] = "something else"           # still valid, hashes intact
        members[0] = (info, json.dumps(manifest).encode())
        return members
    pkg = edited(synthetic_package(tmp_path, key=keys["site"][0]), tamper)
    refused(pkg, cache, r"signature: bad signature: manifest.json does not match the signature of trusted key",
            PackageOptions((keys["site"][1],)))


def test_garbage_signature_file(tmp_path, cache, keys):
    def garble(members):
        assert members[1][0].name == "manifest.sig"
        members[1] = (members[1][0], b"not json")
        return members
    pkg = edited(synthetic_package(tmp_path, key=keys["site"][0]), garble)
    refused(pkg, cache, "manifest.sig: bad signature file", PackageOptions((keys["site"][1],)))


def test_untrusted_key(tmp_path, cache, keys):
    pkg = synthetic_package(tmp_path, key=keys["other"][0])
    msg = refused(pkg, cache, "signature: signed by key [0-9a-f]{16}, which is not a trusted key",
                  PackageOptions((keys["site"][1],)))
    assert keys["site"][1] in msg


def test_require_signature_needs_a_trusted_key():
    with pytest.raises(ConfigError, match="--require-signature needs at least one --trusted-key"):
        PackageOptions(require_signature=True)


def test_wrong_device_type(tmp_path, cache):
    pkg = synthetic_package(tmp_path, device_types=("simxpu",))
    refused(pkg, cache, r"built for device type\(s\) \['simxpu'\]; this device is cpu:0", plugin=open_device("cpu"))


def test_wrong_plugin_api_version(tmp_path, cache):
    pkg = synthetic_package(tmp_path, plugin_api=2)
    refused(pkg, cache, "built for plugin API version 2; the cpu plugin here implements API version 1",
            plugin=open_device("cpu"))
    newer = synthetic_package(tmp_path, plugin_api="1.5", name="newer.pcpkg")   # a newer minor: refused too
    refused(newer, cache, r"built for plugin API version 1.5; the cpu plugin here implements API version 1.4",
            plugin=open_device("cpu"))


def test_truncated_tar_inside_a_file(tmp_path, cache):
    pkg = synthetic_package(tmp_path)
    cut = str(tmp_path / "cut.pcpkg")
    with open(pkg, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(os.path.getsize(pkg) - 2 * 2**20))         # stops inside model.safetensors
    refused(cut, cache, "archive: truncated tar")


def test_truncated_tar_at_a_member_boundary(tmp_path, cache):
    pkg = synthetic_package(tmp_path)
    with tarfile.open(pkg) as tar:
        end = tar.getmember("model.safetensors").offset_data + tar.getmember("model.safetensors").size
    cut = str(tmp_path / "cut.pcpkg")
    with open(pkg, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(-(-end // 512) * 512))                      # every member, no end-of-archive blocks
    refused(cut, cache, "archive: truncated tar: it stops at byte .* without its end-of-archive blocks")


@pytest.mark.parametrize("name,why", [("../evil.json", r"a '\.\.' path \(escapes the extraction folder\)"),
                                      ("sub/../../evil.json", r"a '\.\.' path"),
                                      ("/etc/evil.json", r"an absolute path \(escapes the extraction folder\)"),
                                      ("sub/evil.json", "a path inside a folder")])
def test_path_escapes(tmp_path, cache, name, why):
    pkg = edited(synthetic_package(tmp_path), lambda ms: ms[:1] + [plain(name, b"{}")] + ms[1:])
    refused(pkg, cache, f"{__import__('re').escape(name)}: {why}")
    assert not os.path.exists(tmp_path / "evil.json") and not os.path.exists("/etc/evil.json")


def test_symlink(tmp_path, cache):
    pkg = edited(synthetic_package(tmp_path),
                 lambda ms: ms[:1] + [special("evil.json", tarfile.SYMTYPE, "/etc/passwd")] + ms[1:])
    refused(pkg, cache, r"evil.json: a symbolic link \(to '/etc/passwd'\); refused")


def test_hard_link(tmp_path, cache):
    pkg = edited(synthetic_package(tmp_path),
                 lambda ms: ms[:1] + [special("evil.json", tarfile.LNKTYPE, "/etc/passwd")] + ms[1:])
    refused(pkg, cache, r"evil.json: a hard link \(to '/etc/passwd'\); refused")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE])
def test_device_file(tmp_path, cache, kind):
    pkg = edited(synthetic_package(tmp_path), lambda ms: ms[:1] + [special("null.json", kind)] + ms[1:])
    refused(pkg, cache, "null.json: a device file; refused")


def test_manifest_not_valid_json(tmp_path, cache):
    pkg = edited(synthetic_package(tmp_path), lambda ms: [(ms[0][0], b"{not json")] + ms[1:])
    refused(pkg, cache, "manifest.json: not valid JSON")


def test_unknown_format_version(tmp_path, cache):
    def bump(members):
        manifest = json.loads(members[0][1])
        manifest["format_version"] = 2
        return [(members[0][0], json.dumps(manifest).encode())] + members[1:]
    pkg = edited(synthetic_package(tmp_path), bump)
    refused(pkg, cache, "manifest.json: unknown format version 2; this polychip reads format version 1")


def test_manifest_must_come_first(tmp_path, cache):
    pkg = edited(synthetic_package(tmp_path), lambda ms: ms[1:] + ms[:1])
    refused(pkg, cache, "config.json: the first member must be manifest.json")


def test_not_a_tar(tmp_path, cache):
    path = tmp_path / "junk.pcpkg"
    path.write_bytes(b"PK\x03\x04 a zip, not a tar" * 100)
    refused(str(path), cache, "archive: not a readable tar archive")
