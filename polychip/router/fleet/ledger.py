"""The device ledger: the one owner of "device -> holder" on this router's host.

Every replica the router launches holds its devices through it: a deployment's replicas, submitted and
declared workloads and ``serve --dp-size``'s replicas alike (all of them are workloads, fleet/workloads.py),
so one device is never booked twice whoever asks. A device of a shareable type (the host's CPU) has as
many holders as want it; any other has one.

``reserve`` takes all of a holder's devices or none; the ``Reservation`` it returns is released once,
however many times its holder's end is reported: a late second release never frees a device that
another holder has taken since.
"""
from __future__ import annotations

from typing import Iterable

SHAREABLE = ("cpu",)          # device types several replicas may share


def shareable(device: str) -> bool:
    return device.partition(":")[0] in SHAREABLE


class DeviceBusy(Exception):
    """A device the holder asked for is held by another."""

    def __init__(self, device: str, holder: str):
        super().__init__(f"{device} is held by workload {holder}")
        self.device, self.holder = device, holder


class Reservation:
    """One holder's devices; ``release()`` gives them back, the first time only."""

    def __init__(self, ledger: "DeviceLedger", holder: str, devices: tuple[str, ...]):
        self._ledger, self.holder, self.devices = ledger, holder, devices
        self.released = False

    def release(self) -> bool:
        """True if this call gave the devices back; False if they were given back before."""
        if self.released:
            return False
        self.released = True
        self._ledger._drop(self)
        return True

    def __repr__(self) -> str:
        return f"Reservation({self.holder!r}, {list(self.devices)}{', released' if self.released else ''})"


class DeviceLedger:
    def __init__(self):
        self._held: dict[str, list[Reservation]] = {}     # device -> the reservations holding it

    def reserve(self, holder: str, devices: Iterable[str]) -> Reservation:
        """Hold ``devices`` for ``holder``, all of them or none (DeviceBusy naming the first one held)."""
        devices = tuple(dict.fromkeys(devices))
        for d in devices:
            other = next((r.holder for r in self._held.get(d, ()) if r.holder != holder), None)
            if other is not None and not shareable(d):
                raise DeviceBusy(d, other)
        reservation = Reservation(self, holder, devices)
        for d in devices:
            self._held.setdefault(d, []).append(reservation)
        return reservation

    def _drop(self, reservation: Reservation) -> None:
        for d in reservation.devices:
            left = [r for r in self._held.get(d, ()) if r is not reservation]
            if left:
                self._held[d] = left
            else:
                self._held.pop(d, None)

    def without(self, holders: set[str]) -> "DeviceLedger":
        """A scratch copy without ``holders``' reservations: what a plan reserves into before any change."""
        scratch = DeviceLedger()
        for device, reservations in self._held.items():
            for r in reservations:
                if r.holder not in holders:
                    scratch.reserve(r.holder, [device])
        return scratch

    def holders(self, ignore: Iterable[str] = ()) -> dict[str, str]:
        """device -> its holder, for the devices that cannot be shared (what placement must avoid);
        the holders in ``ignore`` are left out (a holder being replaced by itself)."""
        skip = set(ignore)
        return {d: rs[0].holder for d, rs in self._held.items()
                if not shareable(d) and rs and rs[0].holder not in skip}

    def holding(self, device: str) -> list[str]:
        """Every holder of ``device`` (several for a shared one)."""
        return [r.holder for r in self._held.get(device, ())]

    def held_by(self, holder: str) -> list[str]:
        return sorted(d for d, rs in self._held.items() if any(r.holder == holder for r in rs))

    def describe(self) -> dict[str, list[str]]:
        return {d: self.holding(d) for d in sorted(self._held)}
