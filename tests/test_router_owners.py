"""Owners of the router's shared things (issue 32): the device ledger books a device once whoever
asks (finding 6), and the task supervisor restarts a loop that raises, counts it and shows it on
its health view meanwhile (finding 3)."""
from __future__ import annotations

import asyncio

import pytest

from polychip.router import runtime
from polychip.router.fleet.ledger import DeviceBusy, DeviceLedger
from polychip.router.runtime import TaskSupervisor

pytestmark = pytest.mark.device_independent


def test_a_device_cannot_be_booked_twice_and_a_late_release_frees_nothing():
    ledger = DeviceLedger()
    deployment = ledger.reserve("deploy-gpu-0", ["cuda:0"])
    with pytest.raises(DeviceBusy, match="cuda:0 is held by workload deploy-gpu-0"):
        ledger.reserve("wl-1", ["cuda:1", "cuda:0"])
    assert ledger.held_by("wl-1") == []                      # all or nothing: cuda:1 not taken either
    assert deployment.release() and not deployment.release()
    workload = ledger.reserve("wl-1", ["cuda:0"])
    assert not deployment.release() and ledger.holding("cuda:0") == ["wl-1"]
    ledger.reserve("wl-2", ["cpu"]), ledger.reserve("wl-3", ["cpu"])     # the host's CPU is shared
    assert workload.devices == ("cuda:0",)


def test_a_loop_that_raises_is_restarted_counted_and_shown_down_meanwhile(monkeypatch):
    monkeypatch.setattr(runtime, "BACKOFF_START", 0.3)
    counted = []

    class Counter:
        def labels(self, name):
            return type("C", (), {"inc": lambda _: counted.append(name)})()

    async def main():
        sup = TaskSupervisor(Counter())
        runs = []

        async def flaky():
            runs.append(1)
            if len(runs) == 1:
                raise OSError("store unreachable")
            await asyncio.sleep(3600)
        sup.loop("health checks", flaky, critical=True)
        await asyncio.sleep(0.1)
        during = sup.health()
        await asyncio.sleep(0.5)
        after = sup.health()
        await sup.stop()
        return runs, during, after

    runs, during, after = asyncio.run(main())
    assert during["down"] == ["health checks"] and not during["ok"]
    assert during["loops"][0]["last_error"] == "OSError: store unreachable"
    assert len(runs) == 2 and after["ok"] and after["loops"][0]["state"] == "running"
    assert counted == ["health checks"]
