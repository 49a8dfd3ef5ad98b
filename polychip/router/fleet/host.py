"""This host's devices as workloads see them: read from the router's inventory (``polychip devices
--json`` in a thread) when first needed, published to the state store for other routers'
``/admin/devices`` (``hosts/NODE``), and the reason when they cannot be read (shown, never silent)."""
from __future__ import annotations

import asyncio
import logging
import socket
import time

from polychip.router.fleet.inventory import Inventory
from polychip.router.fleet.workload_placement import HostDevices

log = logging.getLogger("polychip.router.workloads")

HOSTS = "hosts/"            # hosts/NODE: the devices that host's router last read (for /admin/devices)


class HostInventory:
    def __init__(self, inventory: Inventory, node: str, publish):
        self.inventory, self.node, self.publish = inventory, node, publish     # publish(key, value): the state
        self.devices: HostDevices | None = None
        self.error: str | None = None
        self._read: asyncio.Future | None = None

    async def ready(self) -> None:
        """The first read of the devices is done (a failed read is tried again on the next call)."""
        failed = self._read is not None and self._read.done() and self.devices is None
        if self._read is None or failed:
            self._read = asyncio.ensure_future(self.refresh())
        await asyncio.shield(self._read)

    async def refresh(self, again: bool = False) -> HostDevices | None:
        """This host's devices; ``again`` asks anew (the memory figures are those of the moment it asks)."""
        if again:
            self.inventory.known.pop(None, None)
        try:
            plugins = await asyncio.to_thread(self.inventory.get, None)
            self.devices, self.error = HostDevices(socket.gethostname(), plugins), None
            self.publish(HOSTS + self.node, {**self.devices.record(), "at": time.time()})
        except Exception as e:        # shown on /admin/devices and in every refusal; never silent
            self.error = f"{type(e).__name__}: {e}"
            log.error("cannot read this host's devices: %s", self.error)
        return self.devices

    async def stop(self) -> None:
        if self._read is not None:
            self._read.cancel()
            await asyncio.gather(self._read, return_exceptions=True)
