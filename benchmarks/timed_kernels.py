"""The CPU kernels module wrapped so a benchmark sees each call: ``wrap(on_call)`` installs a wrapper
that runs every kernel and then calls ``on_call(name, fn, args, wall_s, cpu_s)`` (``cpu_s``: the calling
thread's CPU seconds). Install it before the engine is made (it binds the kernels at load)."""
import time

from polychip.devices.cpu import kernels as cpu_kernels


class Timed:
    def __init__(self, module, on_call):
        self.module, self.on_call = module, on_call

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def timed(*args):
            c, t = time.thread_time(), time.perf_counter()
            out = fn(*args)
            self.on_call(name, fn, args, time.perf_counter() - t, time.thread_time() - c)
            return out
        return timed


def wrap(on_call) -> bool:
    """Wrap the loaded kernels module; False when there is none (the plugin runs native ops)."""
    module = cpu_kernels.load()
    if module is None:
        return False
    cpu_kernels._state["module"] = Timed(module, on_call)
    return True
