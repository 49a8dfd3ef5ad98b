"""polychip-simxpu: an out-of-tree simulated accelerator, found through the ``polychip.devices``
entry point. Use it to develop against the plugin API without hardware."""
from polychip_simxpu.plugin import SimXpuPlugin

__all__ = ["SimXpuPlugin"]
