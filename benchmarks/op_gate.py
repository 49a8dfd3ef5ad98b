"""The driver-upgrade gate's false-positive rate and its regression report, on simxpu (docs/upgrades.md).

One baseline on simxpu-driver 1.4.0, then RUNS runs of the same against it (each should pass: a
failure is a false positive), then one run on simxpu-driver 1.5.0 (linear 3x slower), whose report
is printed. Each is a separate ``polychip bench ops`` process, as an operator's script would run it.

    PYTHONPATH=$PWD WHO=me /work/bin/quiet .venv/bin/python benchmarks/op_gate.py [--runs 5] [--model-path M] \
        [--flags "--prefill-chunk 64"]

(SmolLM2's 256-token prefill takes ~2 s on a 2-core host: with 9 rounds one run is ~2 minutes there.)
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time


def bench_ops(args, extra: list[str], driver: str) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "polychip.cli", "bench", "ops", "--device", "simxpu", *args.flags.split(), *extra]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SIMXPU_DRIVER": driver})
    return out.returncode, out.stdout + out.stderr[-2000:] * (out.returncode not in (0, 1)), time.perf_counter() - t0


def verdict(out: str) -> str:
    return next((line for line in out.splitlines() if line.startswith(("REGRESSION:", "ok: "))), out[-500:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--flags", default="", help="more bench ops flags, e.g. '--prefill-chunk 64'")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline.json")
        code, out, secs = bench_ops(args, ["--save", base], "simxpu-driver 1.4.0")
        assert code == 0, out
        print(f"bench ops flags: {args.flags or '(defaults)'}; model {args.model_path or 'embedded SmolLM2-135M'}")
        print(f"baseline (simxpu-driver 1.4.0): {secs:.1f} s, load {os.getloadavg()[0]:.2f}")
        false_positives = 0
        for i in range(args.runs):
            code, out, secs = bench_ops(args, ["--baseline", base], "simxpu-driver 1.4.0")
            false_positives += code == 1
            assert code in (0, 1), out
            print(f"self-compare {i + 1}: exit {code} ({secs:.1f} s, load {os.getloadavg()[0]:.2f}): {verdict(out)}")
        print(f"false positives: {false_positives} of {args.runs}")
        code, out, secs = bench_ops(args, ["--baseline", base], "simxpu-driver 1.5.0")
        print(f"\nsimxpu-driver 1.5.0 against the baseline: exit {code} ({secs:.1f} s)")
        print(out[out.index("compared with"):] if "compared with" in out else out)


if __name__ == "__main__":
    main()
