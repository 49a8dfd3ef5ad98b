"""simxpu's simulated driver releases, and the kernels each release slows.

A real driver or SDK upgrade rarely fails outright; it makes one kernel several times slower. simxpu
plays that: the driver a card runs is the spec's ``custom_attributes.versions.driver``, else the
environment's ``SIMXPU_DRIVER`` (the host's installed driver), else :data:`DEFAULT_DRIVER`, and a
release listed in :data:`REGRESSIONS` slows the named ops by the factor (on top of the spec's
``slowdown`` / ``op_slowdown``). ``polychip bench ops --baseline`` is what catches it (docs/upgrades.md).
"""
from __future__ import annotations

import os

DRIVER_ENV = "SIMXPU_DRIVER"
DEFAULT_DRIVER = "simxpu-driver 1.4.0"
#: driver release -> {op name: how many times slower its kernel runs}; releases not listed run at full speed
REGRESSIONS: dict[str, dict[str, float]] = {
    "simxpu-driver 1.5.0": {"linear": 3.0},          # its GEMM lost the tiled path: linear 3x slower
}


def installed(spec_versions: dict[str, str]) -> str:
    """The driver release this card runs: the spec's, else the environment's, else the default."""
    return spec_versions.get("driver") or os.environ.get(DRIVER_ENV) or DEFAULT_DRIVER


def regressions(driver: str) -> dict[str, float]:
    """The ops ``driver`` slows, with their factors."""
    return dict(REGRESSIONS.get(driver, {}))
