"""What each trust check costs at start-up (docs/packages.md, "Trust chain"). Run from a checkout:

    PYTHONPATH=.:plugins/simxpu python benchmarks/trust_costs.py MODEL_DIR

Packs MODEL_DIR (signed, release 1) into a temporary folder, then times: loading the trust store,
a device spec's detached signature, each check of opening the package on the CPU (signature,
release, plugin pin, every file's hash while extracting; then from the cache), the plugin pin
alone, the rendezvous proof, and loading the seccomp filter (in a fresh process)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def median_ms(fn, n: int = 20) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(out), 3)


def main(model: str) -> None:
    import yaml
    from polychip.devices.discovery import open_device
    from polychip.distributed.secret import proof, random_secret
    from polychip.trust import keys as signing
    from polychip.package.opening import PackageOptions, open_package
    from polychip.package.pack import PackOptions, pack
    from polychip.trust.detached import sign_file, verify_file
    from polychip.trust.options import TrustOptions
    from polychip.trust.pins import pin_of
    from polychip.trust.store import TrustStore
    d = tempfile.mkdtemp(prefix="trust-costs-")
    try:
        private, public = signing.keygen(os.path.join(d, "site"))
        os.makedirs(os.path.join(d, "store"))
        with open(os.path.join(d, "store", "trust.yaml"), "w") as f:
            yaml.safe_dump({"keys": [{"file": public, "not_after": "2099-01-01"}]}, f)
        store_dir = os.path.join(d, "store")
        spec = os.path.join(d, "cpu-2.yaml")
        shutil.copyfile(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "specs", "cpu-2.yaml"), spec)
        sign_file(spec, private)
        store = TrustStore.load(store_dir)
        res = {"trust store load ms": median_ms(lambda: TrustStore.load(store_dir)),
               "device spec signature ms": median_ms(lambda: verify_file(spec, store, what="device spec"))}
        pkg = os.path.join(d, "m.pcpkg")
        pack(PackOptions(pkg, model, sign_key=private, release=1))
        res["package MiB"] = round(os.path.getsize(pkg) / 2**20, 1)
        plugin = open_device("cpu")
        pin = pin_of(plugin)
        res["cpu plugin pin files"] = len(pin["files"])
        res["cpu plugin pin ms"] = median_ms(lambda: pin_of(plugin), 5)
        for label, trust in (("no store", TrustOptions()), ("store", TrustOptions(store_dir))):
            for run in ("extract", "cached"):
                cache = os.path.join(d, f"cache-{label}")
                opened = open_package(pkg, PackageOptions(), cache, plugin, trust)
                res[f"open, {label}, {run}"] = {k: round(v * 1000, 1) for k, v in opened.costs.items()} | \
                    {"total ms": round(opened.seconds * 1000, 1)}
        plugin.destroy()
        secret = random_secret()
        res["rendezvous proof us"] = round(median_ms(lambda: proof(secret, 1, "c" * 32, "n" * 32), 1000) * 1000, 1)
        code = ("import time; from polychip.trust import seccomp; t0 = time.perf_counter(); n = seccomp.apply(); "
                "print(n, (time.perf_counter() - t0) * 1000)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        res["seccomp allowed syscalls"], res["seccomp load ms"] = int(out[0]), round(float(out[1]), 1)
        print(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
