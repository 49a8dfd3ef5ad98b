"""Prefill/decode pairs in one test process: each Engine stepped by its own thread as the server's
AsyncEngine does (posted work first, then a step), with results collected per request id."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

from polychip.config import EngineConfig
from polychip.engine.engine import Engine
from polychip.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)


class Driver:
    """Steps one engine in a thread; ``paused`` holds it between steps (a side that stalls)."""

    def __init__(self, engine: Engine):
        self.engine, self.cond = engine, threading.Condition()
        self.outputs: dict = {}
        self.stopped, self.paused = False, threading.Event()
        engine.wake = self.wake
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if engine.disagg is not None:
            engine.disagg.begin()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def _run(self) -> None:
        e = self.engine
        while not self.stopped:
            with self.cond:
                while not (e.has_posted or e.has_unfinished() or self.stopped) or self.paused.is_set():
                    self.cond.wait(0.05)
                    if self.stopped:
                        return
            e.run_posted()
            if e.has_unfinished():
                for out in e.step():
                    self.outputs[out.request_id] = out

    def call(self, fn, timeout: float = 30):
        """``fn(engine)`` in the engine thread; its result (or its exception)."""
        done = cf.Future()

        def run(engine):
            try:
                done.set_result(fn(engine))
            except Exception as e:
                done.set_exception(e)
        self.engine.post(run)
        return done.result(timeout)

    def wait(self, request_id: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.outputs.get(request_id)
            if out is not None and out.finished:
                return out
            time.sleep(0.01)
        raise TimeoutError(f"{request_id} did not finish; status {self.engine.disagg and self.engine.disagg.status()}")

    def idle_pages(self, timeout: float = 10) -> tuple[int, int, int]:
        """(free, cached, total) pages once nothing holds a page any more, after the integrity check
        (which names a leaked page: counted but held by no request and not the cache)."""
        deadline = time.monotonic() + timeout
        while True:
            free, cached, total, busy = self.call(
                lambda e: (e.check_integrity(), e.pages.num_free, e.cache.num_pages, e.pages.num_pages,
                           bool(e.scheduler.running or e.scheduler.waiting or e.scheduler.held
                                or e.scheduler.receiving))[1:])
            if (free + cached == total and not busy) or time.monotonic() > deadline:
                return free, cached, total
            time.sleep(0.05)

    def stop(self) -> None:
        self.stopped = True
        self.paused.clear()
        self.wake()
        self.thread.join(5)
        self.engine.shutdown()


def engine(path: str, device: str, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    return Engine(EngineConfig(model_path=path, device=device, **kw))


def plain_tokens(eng: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    """Greedy tokens of ``prompt`` served plainly on ``eng`` (stepped here, not by a driver)."""
    rid = eng.add_request(prompt, params)
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out = o
    return out.token_ids


class CuttingProxy:
    """A TCP proxy in front of a prefill side's bootstrap port that cuts every connection once ``cut_after``
    bytes went from the prefill side to the decode side (mid-chunk: a connection dropped mid-layer)."""

    def __init__(self, target_port: int, cut_after: int):
        import socket
        self.target, self.cut_after, self.sent = target_port, cut_after, 0
        self.cut = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, counted: bool) -> None:
        try:
            while not self.cut.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if counted:
                    self.sent += len(data)
                    if self.sent > self.cut_after:
                        dst.sendall(data[:len(data) // 2])
                        self.drop()
                        return
                dst.sendall(data)
        except OSError:
            pass

    def drop(self) -> None:
        import socket
        self.cut.set()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.drop()
        self.server.close()
