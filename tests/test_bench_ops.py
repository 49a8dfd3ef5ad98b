"""The driver-upgrade gate: ``polychip bench ops --save`` / ``--baseline`` on simxpu, whose driver
release 1.5.0 makes linear 3x slower; the comparison's rules; ``polychip doctor``'s baseline lines."""
from __future__ import annotations

import re
import time

import pytest

from polychip.bench import op_baseline
from polychip.cli import main
from polychip.errors import ConfigError
from polychip.pluginkit.conformance import make_tiny_model

pytestmark = pytest.mark.device_independent   # names its device: simxpu (conftest.py)

OPS = ("embedding", "rms_norm", "add_rms_norm", "linear", "rotary_embedding", "attention", "silu_mul")


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv(op_baseline.BASELINE_DIR_ENV, str(tmp_path / "baselines"))
    monkeypatch.delenv("SIMXPU_DRIVER", raising=False)
    return tmp_path


def driver_spec(path, driver: str) -> str:
    path.write_text(f"device_type: simxpu\ndevice_ids: [0]\nmemory: {{total: 2GiB}}\nsupported_dtypes: [float32]\n"
                    f"custom_attributes: {{versions: {{driver: '{driver}'}}}}\n")
    return str(path)


def bench_ops(capsys, model, *args) -> tuple[int, str]:
    # one host thread: a figure a busy shared machine disturbs least
    code = main(["bench", "ops", "--device", "simxpu", "--model-path", model, "--rounds", "5", "--num-threads", "1",
                 *args])
    return code, capsys.readouterr().out


def regression_named(capsys, model: str, host, upgraded: str) -> tuple[bool, str]:
    """Save a baseline on simxpu-driver 1.4.0, then run on 1.5.0 against it: (linear alone named, the output)."""
    for f in (host / "baselines").glob("*.json"):
        f.unlink()
    code, out = bench_ops(capsys, model, "--save")
    assert code == 0 and "baseline saved: " in out, out
    code, out = bench_ops(capsys, model, "--device-config", upgraded, "--baseline", "--save")
    verdict = next((line for line in out.splitlines() if line.startswith("REGRESSION: ")), "")
    ratios = [re.search(rf"linear @ {p} ([\d.]+)x", verdict) for p in ("prefill-256", "decode-1", "decode-16")]
    return (code == 1 and all(r and float(r.group(1)) > 1.5 for r in ratios)
            and set(re.findall(r"(\w+) @ ", verdict)) == {"linear"}
            and verdict.endswith("(changed: driver: 'simxpu-driver 1.4.0' -> 'simxpu-driver 1.5.0')")), out


def test_a_driver_that_slows_linear_is_caught_and_named(host, capsys):
    model = make_tiny_model(str(host / "model"))
    upgraded = driver_spec(host / "upgrade.yaml", "simxpu-driver 1.5.0")
    # Times on a machine other jobs share move by up to 2x between runs (a competing process takes half the
    # core): up to three attempts for linear, 3x slower, to be the one op named. A gate that named nothing,
    # named every op or lost the driver fails all three. Linear's ratio must pass 1.5x, not 3x: its added time is
    # a sleep, which a busy host does not stretch as it stretches the computing part. A retry waits 10, then 30 s,
    # so that one burst of host noise (CI saw three back-to-back attempts fall within 5 s) cannot take all three.
    outs = []
    for attempt in range(3):
        if attempt:
            time.sleep(10 if attempt == 1 else 30)
        ok, out = regression_named(capsys, model, host, upgraded)
        outs.append(out)
        if ok:
            break
    assert ok, "\n\n".join(outs)
    assert "baseline not saved: this run regressed" in out and len(list((host / "baselines").glob("*.json"))) == 1
    assert main(["doctor"]) == 0
    assert re.search(r"ok\s+op baselines: simxpu:0: its version matrix now has a baseline", capsys.readouterr().out)
    assert main(["doctor", "--device-config", upgraded]) == 0
    assert re.search(r"warn\s+op baselines: simxpu:0: no baseline for its version matrix now \(driver "
                     r"simxpu-driver 1.4.0 -> simxpu-driver 1.5.0\)", capsys.readouterr().out)


def run(medians: dict, spread: float = 0.02, driver: str = "d1", model: str = "m", chunk: int = 256) -> dict:
    return {"format": op_baseline.FORMAT, "format_version": 1, "device": "simxpu:0", "model": {"path": model},
            "settings": {"prefill_chunk": chunk, "decode_batches": [1, 16], "decode_context": 256},
            "versions": {"polychip": "0.1", "torch": "2.13", "plugin": "simxpu 0.1", "device": {"driver": driver}},
            "measures": [{"kind": "op", "op": op, "phase": "decode-1", "median_s": s, "best_s": s * 0.9,
                          "spread": spread} for op, s in medians.items()]}


def test_the_comparison_is_noise_aware_and_names_what_changed():
    base = run({"linear": 1.0, "attention": 1.0, "silu_mul": 1.0}, spread=0.02)
    changes, versions, lonely = op_baseline.compare(base, run({"linear": 1.2, "attention": 1.1, "rms_norm": 1.0},
                                                              driver="d2"))
    by = {c.op: c for c in changes}
    assert by["linear"].regressed and not by["attention"].regressed and set(by) == {"linear", "attention"}
    assert versions == {"driver": ("d1", "d2")} and lonely == ["rms_norm @ decode-1", "silu_mul @ decode-1"]
    noisy = run({"linear": 1.0}, spread=0.10)            # a baseline whose rounds spread 10%: 30% needed to count
    assert not op_baseline.compare(noisy, run({"linear": 1.25}))[0][0].regressed
    assert op_baseline.compare(noisy, run({"linear": 1.35}))[0][0].regressed
    lines = op_baseline.report(*op_baseline.compare(base, run({"linear": 3.0, "attention": 1.0, "silu_mul": 1.0},
                                                             driver="d2")), 0.15)
    assert lines[-1] == ("REGRESSION: 1 of 3 measures slower than allowed (threshold 15%, or 3x the baseline's "
                         "spread, in the median and the best round): linear @ decode-1 3.00x (changed: driver: "
                         "'d1' -> 'd2')")
    burst = run({"linear": 1.5})                            # a slower median, but its best round as fast as before
    burst["measures"][0]["best_s"] = 0.9
    assert not op_baseline.compare(base, burst)[0][0].regressed


def test_runs_that_do_not_compare_are_refused(tmp_path, host, capsys):
    with pytest.raises(ConfigError, match="measured on model 'm', this run on 'other'"):
        op_baseline.compare(run({"linear": 1.0}), run({"linear": 1.0}, model="other"))
    with pytest.raises(ConfigError, match="measured with settings"):
        op_baseline.compare(run({"linear": 1.0}), run({"linear": 1.0}, chunk=128))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match="not a polychip op baseline"):
        op_baseline.load(str(bad))
    assert main(["bench", "ops", "--device", "simxpu", "--model-path", str(tmp_path / "nothing"), "--baseline"]) == 2
    assert "error: " in capsys.readouterr().err
