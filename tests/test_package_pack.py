"""An int8 package of a random model: keygen, pack, verify (CLI), inspect, open (cache, second
start, tampered cache), load and generate, the plan applied and checked, serve."""
from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys

import httpx
import pytest

from polychip import LLM, SamplingParams
from polychip.commands import inspect as inspect_cmd
from polychip.commands import verify as verify_cmd
from polychip.devices.discovery import open_device
from polychip.devices.plugin import API_VERSION
from polychip.package import PackageError
from polychip.trust import keys as signing
from polychip.package.opening import PackageOptions, open_llm, open_package
from polychip.package.pack import PackOptions, pack
from polychip.http.launcher import ServerProcess, free_port

pytestmark = pytest.mark.device_independent   # pins the devices it checks (conftest.py)

PROMPTS = [[5, 77, 1024, 9], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return signing.keygen(str(tmp_path_factory.mktemp("keys") / "site"))


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("llama", True)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory, source, keys):
    out = str(tmp_path_factory.mktemp("pkg") / "tiny-int8.pcpkg")
    res = pack(PackOptions(out, source, "int8", sign_key=keys[0]))
    assert res.signed_by == signing.key_id(signing.load_private_key(keys[0]).public_key())
    return out


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path):
    private, public = signing.keygen(str(tmp_path / "k"))
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert open(public).read().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(signing.TrustError, match="exists; not overwriting a key"):
        signing.keygen(str(tmp_path / "k"))


def test_keygen_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "polychip.cli", "keygen", "-o", str(tmp_path / "k")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "key id" in out.stdout and os.path.exists(tmp_path / "k.pub")


def test_package_members_and_manifest(pkg):
    import tarfile
    with tarfile.open(pkg) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())
        plan = json.loads(tar.extractfile("plan.json").read())
    assert names[:3] == ["manifest.json", "manifest.sig", "plan.json"]
    assert set(names) == {"manifest.json", "manifest.sig", "plan.json", "config.json", "generation_config.json",
                          "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
    assert [f["name"] for f in manifest["files"]] == names[2:]
    assert manifest["model"]["quantization"] == "int8" and manifest["target"]["device_types"] == ["cpu"]
    v = manifest["versions"]
    assert v["plugin_api"] == API_VERSION and v["plugin"] == "cpu 1.0" and v["device"]["runtime"].startswith("torch ")
    assert plan["quantization"] == "int8" and plan["fusions"] == ["qkv", "gate_up", "add_rms_norm"]
    assert {r["op"] for r in plan["ops"]} >= {"linear_int8", "attention", "embedding"}
    assert plan["memory"]["weights_bytes"] > 0 and plan["memory"]["kv_pool"]["default_tokens"] > 0


def test_int8_package_verifies_loads_and_generates(pkg, keys, source, tmp_path, monkeypatch, capsys):
    assert verify_cmd.main([pkg, "--trusted-key", keys[1]]) == 0
    out = capsys.readouterr().out
    assert "ok    signature: ed25519 by trusted key" in out and "ok    model.safetensors: sha256" in out
    assert "ok    device type: cpu present" in out and "FAIL" not in out
    want = LLM(source, device="cpu", quantization="int8", max_total_tokens=1024).generate(PROMPTS, GREEDY)
    from polychip.quant import int8

    def no_requantising(w):
        raise AssertionError("a packaged int8 model must load without quantising again")
    monkeypatch.setattr(int8, "quantize_int8", no_requantising)
    llm = open_llm(pkg, trusted_keys=(keys[1],), cache_dir=str(tmp_path), device="cpu", max_total_tokens=1024)
    assert llm.engine.loaded.quantization == "int8" and llm.engine.loaded.plan_warnings == []
    assert llm.config.served_model_name == "tiny-int8"
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]   # same int8 weights as quantised at load


def test_second_start_does_not_extract_again_and_a_tampered_cache_is_replaced(pkg, keys, tmp_path, caplog):
    opts = PackageOptions((keys[1],))
    first = open_package(pkg, opts, str(tmp_path))
    assert first.extracted and os.path.basename(first.model_dir) == first.manifest_sha256
    mtime = os.stat(os.path.join(first.model_dir, "model.safetensors")).st_mtime_ns
    second = open_package(pkg, opts, str(tmp_path))
    assert not second.extracted and second.model_dir == first.model_dir
    assert os.stat(os.path.join(first.model_dir, "model.safetensors")).st_mtime_ns == mtime
    with open(os.path.join(first.model_dir, "config.json"), "a") as f:
        f.write(" ")
    third = open_package(pkg, opts, str(tmp_path))
    assert third.extracted and "no longer matches the manifest (config.json: hash mismatch)" in caplog.text
    with open(os.path.join(first.model_dir, "extra.safetensors"), "w") as f:
        f.write("x")                                  # would be loaded with the weights: never trusted
    assert open_package(pkg, opts, str(tmp_path)).extracted


def test_the_plan_is_applied_and_checked(pkg, tmp_path, monkeypatch, caplog):
    from polychip.devices.cpu import kernels as cpu_kernels
    from polychip.devices.cpu import CpuPlugin
    from polychip.models.loader import load_model
    folder = open_package(pkg, PackageOptions(), str(tmp_path)).model_dir
    # the device now declares no fusions and its kernels are off: the plan's fusions still apply,
    # and each op now resolved differently is named
    monkeypatch.setattr(CpuPlugin, "fusions", lambda self: ())
    monkeypatch.setenv("POLYCHIP_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    lm = load_model(folder, open_device("cpu"), "float32")
    assert lm.fusions == ["qkv", "gate_up", "add_rms_norm"]
    warnings = "\n".join(lm.plan_warnings)
    assert "the package's plan fuses ['qkv', 'gate_up', 'add_rms_norm']; this device's plugin declares []" in warnings
    for op in ("linear_int8", "attention", "rms_norm", "add_rms_norm", "silu_mul", "rotary_embedding"):
        assert f"op {op} v1: the package was built with plugin:cpu (float32) on cpu; this device resolves " \
               f"native (float32): plugin 'cpu' cannot provide {op} here" in warnings
    assert "op embedding" not in warnings                     # native then and now
    assert "plan: op linear_int8 v1" in caplog.text


def test_inspect_text_and_json(pkg, capsys):
    assert inspect_cmd.main([pkg]) == 0
    text = capsys.readouterr().out
    for part in ("devices    cpu", "quantize   int8 (compute dtype float32)", "memory     weights",
                 "fusions: qkv, gate_up, add_rms_norm", "linear_int8       1        float32  plugin:cpu",
                 "plugin API  1", "runtime     torch", "model.safetensors", "KV pool default:"):
        assert part in text, part
    assert inspect_cmd.main([pkg, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["manifest"]["model"]["quantization"] == "int8" and d["plan"]["fusions"] and d["signature_key_id"]


def test_verify_cli_lists_every_failure(pkg, tmp_path, capsys):
    import tarfile
    bad = str(tmp_path / "bad.pcpkg")
    with tarfile.open(pkg) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name in ("config.json", "tokenizer_config.json"):
                data = data.replace(b"{", b"[", 1)             # same size, different bytes
            dst.addfile(m, io.BytesIO(data))
    assert verify_cmd.main([bad, "--skip-device"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  config.json: hash mismatch" in out and "FAIL  tokenizer_config.json: hash mismatch" in out
    assert "ok    model.safetensors" in out                   # kept going past the first failure


def test_verify_cli_refuses_an_unchecked_signature_when_required(pkg, keys, capsys):
    assert verify_cmd.main([pkg, "--skip-device"]) == 0      # integrity only: the signature is 'skip'
    assert "skip  signature: signed by key" in capsys.readouterr().out
    other = signing.keygen(os.path.join(os.path.dirname(keys[0]), "other"))
    assert verify_cmd.main([pkg, "--skip-device", "--trusted-key", other[1]]) == 1
    assert "FAIL  signature: signed by key" in capsys.readouterr().out


def test_packaged_int8_refused_on_a_device_without_int8(source, tmp_path):
    spec = tmp_path / "sim.yaml"
    spec.write_text("device_type: simxpu\ndevice_ids: [0]\nmemory: {total: 2GiB}\n"
                    "supported_dtypes: [float32, bfloat16, int8]\n")
    out = str(tmp_path / "sim.pcpkg")
    pack(PackOptions(out, source, "int8", target_device="simxpu", device_config=str(spec)))
    spec.write_text(spec.read_text().replace(", int8", ""))
    with pytest.raises(Exception, match=r"int8 weight dtype int8 is not supported by device simxpu:0 .*sim.yaml"):
        open_llm(out, cache_dir=str(tmp_path), device="simxpu", device_config=str(spec))


def test_serve_a_signed_package(pkg, keys, tmp_path):
    s = ServerProcess(["--model-path", pkg, "--trusted-key", keys[1], "--cache-dir", str(tmp_path),
                       "--max-total-tokens", "1024"])
    with s:
        models = httpx.get(s.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny-int8"]
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny-int8", "prompt": "hi", "max_tokens": 4,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(s.url + "/server_info", timeout=10).json()["quantization"] == "int8"   # what a router reads
    assert "verified and extracted to" in s.log and "signed by" in s.log


def test_serve_refuses_an_untrusted_package_before_loading(pkg, tmp_path):
    other = signing.keygen(str(tmp_path / "other"))
    out = subprocess.run([sys.executable, "-m", "polychip.serve", "--model-path", pkg, "--trusted-key", other[1],
                          "--cache-dir", str(tmp_path), "--port", str(free_port())], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "which is not a trusted key" in out.stderr and "loaded" not in out.stderr
    assert not os.path.exists(tmp_path / "packages") or os.listdir(tmp_path / "packages") == []


def test_package_flags_refuse_a_model_that_is_not_a_package(source, keys):
    from polychip.commands import generate
    assert generate.main(["--model-path", source, "--trusted-key", keys[1], "--prompt", "x"]) == 1


def test_the_plans_dtype_is_the_default(source, tmp_path):
    from polychip.models.loader import load_model
    out = str(tmp_path / "bf16.pcpkg")
    pack(PackOptions(out, source, "int8", dtype="bfloat16"))
    folder = open_package(out, PackageOptions(), str(tmp_path)).model_dir
    lm = load_model(folder, open_device("cpu"))                  # --dtype auto
    assert str(lm.dtype) == "torch.bfloat16" and lm.plan_warnings == []
    assert lm.resolutions["linear_int8"].source == "native"      # torch's bf16 int8 kernel
    llm = open_llm(out, cache_dir=str(tmp_path), device="cpu", max_total_tokens=512)
    assert len(llm.generate([PROMPTS[0]], GREEDY)[0].token_ids) == 8
