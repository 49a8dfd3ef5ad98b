"""The bounded runner: reads the checked lines one at a time, keeps at most ``concurrency``
requests in flight and at most ``window`` records between the oldest unwritten one and the newest
read (so memory stays flat on any file size), and hands each finished record to the ordered writer.

``send(request) -> record`` is the caller's: the in-process server for ``polychip batch``, the
router's own dispatch for ``/v1/batches``. An exception from it becomes that line's error record.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from polychip.router.batch.lines import BatchRequest, LineError
from polychip.router.batch.output import OrderedWriter, Written
from polychip.router.batch.records import error_record, failed_record

log = logging.getLogger("polychip.batch")

Send = Callable[[BatchRequest], Awaitable[dict]]


@dataclass
class Limits:
    concurrency: int = 8
    window: int | None = None       # default: 4 x concurrency

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.window is None:
            self.window = 4 * self.concurrency
        if self.window < self.concurrency:
            raise ValueError(f"window ({self.window}) must be >= concurrency ({self.concurrency})")


async def run_batch(items: Iterable[BatchRequest | LineError], send: Send, writer: OrderedWriter,
                    done: Written, limits: Limits, stop: Callable[[], bool] = lambda: False) -> int:
    """Run every item not in ``done``; returns how many were skipped as already written. Stops
    reading when ``stop()`` turns true (the requests in flight still finish and are written)."""
    in_flight = asyncio.Semaphore(limits.concurrency)
    window = asyncio.Semaphore(limits.window)
    written_hook = writer.on_written

    def on_written(record: dict) -> None:
        window.release()
        written_hook(record)
    writer.on_written = on_written

    tasks: set[asyncio.Task] = set()
    skipped = index = 0
    try:
        for item in items:
            if stop():
                break
            if (item.custom_id, item.line) in done:
                skipped += 1
                continue
            await window.acquire()
            if isinstance(item, LineError):
                writer.put(index, error_record(item))
            else:
                await in_flight.acquire()
                task = asyncio.ensure_future(_one(item, index, send, writer, in_flight))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            index += 1
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        writer.on_written = written_hook
    return skipped


async def _one(item: BatchRequest, index: int, send: Send, writer: OrderedWriter, in_flight) -> None:
    try:
        record = await send(item)
    except asyncio.CancelledError:
        raise
    except Exception as e:       # one failed request is that line's error record, not the run's end
        log.warning("line %d (%s): %s: %s", item.line, item.custom_id, type(e).__name__, e)
        record = failed_record(item.custom_id, "request_failed", f"{type(e).__name__}: {e}")
    finally:
        in_flight.release()
    writer.put(index, record)
