"""The router's start-up cost: seconds from launch to its ready line and peak resident memory
(``/usr/bin/time -v``), and the modules ``import polychip.router.app`` loads (``-X importtime``).

  python benchmarks/router_startup.py [ROOT] [--runs 3]

ROOT is a checkout (default: this one); the router gets one replica URL nobody answers, so
nothing but the router itself is measured."""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_start(root: str) -> tuple[float, int]:
    """(seconds to the ready line, max RSS in KiB) of one router start."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "polychip.cli", "router",
           "--replica", "http://127.0.0.1:1", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": root}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ready = [], None
    for line in proc.stdout:
        lines.append(line)
        if ready is None and "polychip router ready" in line:
            ready = time.perf_counter() - t0
            for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                os.kill(int(child), signal.SIGTERM)        # the router, not /usr/bin/time
    proc.wait(60)
    text = "".join(lines)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if ready is None or rss is None:
        raise RuntimeError(f"the router did not start:\n{text[-3000:]}")
    return ready, int(rss.group(1))


def imported(root: str) -> tuple[int, bool]:
    """(modules imported by ``import polychip.router.app``, whether torch is among them)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import polychip.router.app"], cwd=root,
                         env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, check=True).stderr
    names = [line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if line.startswith("import time:")][1:]
    return len(names), any(n == "torch" for n in names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    runs = [one_start(args.root) for _ in range(args.runs)]
    count, torch = imported(args.root)
    print(f"{args.root}: ready in {statistics.median(r[0] for r in runs):.2f} s (median of {args.runs}: "
          f"{', '.join(f'{r[0]:.2f}' for r in runs)}), max RSS {statistics.median(r[1] for r in runs) / 1024:.0f} MiB; "
          f"import polychip.router.app loads {count} modules{' including torch' if torch else ', no torch'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
