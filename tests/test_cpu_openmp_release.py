"""The cpu plugin's release_thread (plugin API 1.3): the thread that set the engine up ends its OpenMP
workers when the serving engine's thread takes the steps over. With both teams alive libgomp counts more
threads than cores and its waiting threads sleep between parallel regions (a futex wake each region).
Its bind_helper_thread (1.4): a helper thread beside the steps runs its regions alone, starting no team."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.device_independent   # names its device (the cpu plugin)

# Run in a fresh interpreter: which threads hold OpenMP teams is process state.
SCRIPT = r"""
import json, os, threading, time, torch
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(n):      # ended threads leave /proc/self/task a moment after they exit
    for _ in range(200):
        if tasks() == n:
            break
        time.sleep(0.01)
    return tasks()

x = torch.randn(4_000_000)
def regions(k):     # k parallel regions on the calling thread (torch's intra-op threads: OpenMP)
    for _ in range(k):
        torch.mul(x, 2.0, out=y)

workers_added = []       # how many workers each worker_sleeps thread's team had

def worker_sleeps(k):   # voluntary context switches of the threads a new thread's team adds, over k regions
    seen = {}
    def run():
        regions(1)
        mine = set(os.listdir("/proc/self/task")) - before
        start = {t: switches(t) for t in mine}
        regions(k)
        seen.update({t: switches(t) - start[t] for t in mine})
    before = set(os.listdir("/proc/self/task"))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    workers_added.append(len(seen) - 1)
    return sum(v for tid, v in seen.items() if tid != str(t.native_id))

def switches(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        return int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])

y = torch.empty_like(x)
p = CpuPlugin()
p.init(num_threads=2)
registry = OpRegistry(p.name)
register_native(registry)
p.register_ops(registry)
base = tasks()
regions(1)
with_team = tasks()
kept = worker_sleeps(200)                  # the main thread's team still alive
p.release_thread()
after = settle(base)
released = worker_sleeps(200)

def beside_a_helper(bind):   # a helper thread (bound or not) runs one region and stays alive while we measure
    ready, stay, seen = threading.Event(), threading.Event(), {}
    def run():
        if bind:
            p.bind_helper_thread()
        mine = torch.empty_like(x)
        torch.mul(x, 3.0, out=mine)
        seen["tasks"], seen["right"] = tasks(), bool(torch.equal(mine, x * 3.0))
        ready.set()
        stay.wait()
    h = threading.Thread(target=run)
    h.start()
    ready.wait()
    seen["sleeps"] = worker_sleeps(200)
    seen["steps_team_workers"] = workers_added[-1]
    stay.set()
    h.join()
    seen["after"] = settle(base)
    return seen

unbound, bound = beside_a_helper(False), beside_a_helper(True)
print(json.dumps({"kernels": p.kernels is not None, "base": base, "with_team": with_team, "after": after,
                  "sleeps_kept": kept, "sleeps_released": released, "sum": float(y.sum()) / float(x.sum()),
                  "unbound": unbound, "bound": bound}))
"""


@pytest.fixture(scope="module")
def run():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_ends_the_calling_threads_openmp_workers(run):
    if not run["kernels"]:
        pytest.skip("the CPU kernels did not build here (release_thread then keeps the workers, logged)")
    assert run["with_team"] == run["base"] + 1         # a team of 2: one worker beside the thread
    assert run["after"] == run["base"]                 # that worker ended
    assert run["sum"] == pytest.approx(2.0)            # and another thread's team still computes


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="with one core libgomp never spins long")
def test_a_second_team_sleeps_between_regions_until_the_first_is_released(run):
    if not run["kernels"]:
        pytest.skip("the CPU kernels did not build here")
    assert run["sleeps_kept"] >= 100         # ~one futex sleep a region while two teams outnumber the cores
    assert run["sleeps_released"] <= 20      # it spins from one region to the next


def test_a_bound_helper_thread_starts_no_openmp_team_and_still_computes(run):
    if not run["kernels"]:
        pytest.skip("the CPU kernels did not build here (bind_helper_thread then does nothing, logged)")
    assert run["unbound"]["tasks"] == run["base"] + 2    # the helper and its team's worker
    assert run["bound"]["tasks"] == run["base"] + 1      # the helper alone
    assert run["unbound"]["right"] and run["bound"]["right"]
    assert run["bound"]["after"] == run["unbound"]["after"] == run["base"]
    # the setting was the helper's, not the process's: a thread started beside it still gets a team of 2
    assert run["bound"]["steps_team_workers"] == run["unbound"]["steps_team_workers"] == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="with one core libgomp never spins long")
def test_the_steps_team_spins_beside_a_bound_helper_and_sleeps_beside_an_unbound_one(run):
    if not run["kernels"]:
        pytest.skip("the CPU kernels did not build here")
    assert run["unbound"]["sleeps"] >= 100
    assert run["bound"]["sleeps"] <= 20
