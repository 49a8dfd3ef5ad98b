"""OpenAI batch jobs on the router: validate the input file (streamed, line numbers), run its
lines through the router's own dispatch in the ``low`` priority class under a concurrency cap,
write the output and error files as records finish, and survive a restart.

Durability: the files are the truth. Each record is one flushed line; after a kill the next start
cuts a partial last line, reads what both files hold and runs only the custom_ids missing there,
so each appears exactly once. The batch object (status, times, counts, file ids) is kept in the
router's state store under ``batches/ID`` (store.py); its counts are recounted from the files on resume.

N routers over one store (etcd): only the state's leader runs batches (shared.py: the view, the
leadership, the writes), so --files-dir must be one directory they all see.

States (OpenAI's): validating -> in_progress -> finalizing -> completed; validating -> failed;
in_progress -> expired (completion_window passed: unrun lines get ``batch_expired`` records);
validating | in_progress -> cancelling -> cancelled.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from typing import Awaitable, Callable

from polychip.router.batch.lines import ENDPOINTS, BatchRequest, FileCheck, body_error, check_file, parsed_lines
from polychip.router.batch.output import OrderedWriter, Written, read_written
from polychip.router.batch.records import encode, failed_record, is_success, response_record
from polychip.router.batch.runner import Limits, run_batch
from polychip.router.settings import BatchConfig
from polychip.router.batch.files import FileError, FileStore
from polychip.router.batch.shared import ACTIVE, SharedBatches
from polychip.router.batch.store import BatchStore

log = logging.getLogger("polychip.router.batch.jobs")

WINDOWS = {"24h": 24 * 3600}
RETRY_STATUS = (502, 503)        # the router could not place it yet (no replica up, queue full)
CHECK_CHUNK = 256               # bodies per check call
# (url, body) -> (HTTP status, request id, response body bytes)
Send = Callable[[str, dict], Awaitable[tuple[int, str, bytes]]]
# (url, bodies) -> the refused ones: [{index, message, param}]
Check = Callable[[str, list[dict]], Awaitable[list[dict]]]


class BatchJobs(SharedBatches):
    def __init__(self, cfg: BatchConfig, files: FileStore, store: BatchStore, send: Send, check: Check,
                 clock: Callable[[], float] = time.time, is_leader: Callable[[], bool] = lambda: True,
                 term: Callable[[], int | None] = lambda: None, spawn=None):
        super().__init__(store, is_leader, clock, term, spawn)    # only the leader runs batches (the state's election)
        self.cfg, self.files, self._send, self._check = cfg, files, send, check
        self._slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.cfg.concurrency)
        await super().start()

    # the API
    async def create(self, input_file_id, endpoint, completion_window, metadata) -> dict:
        try:
            meta = self.files.get(input_file_id) if isinstance(input_file_id, str) else None
        except FileError:
            meta = None
        if meta is None or meta["purpose"] != "batch":
            raise FileError(400, f"input_file_id {input_file_id!r} is not an uploaded file of purpose 'batch'",
                            param="input_file_id")
        if endpoint not in ENDPOINTS:
            raise FileError(400, f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        if completion_window not in WINDOWS:
            raise FileError(400, f"completion_window must be one of {list(WINDOWS)}, got {completion_window!r}",
                            param="completion_window")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise FileError(400, "metadata must be an object of at most 16 string values", param="metadata")
        now = int(self.clock())
        b = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
             "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
             "expires_at": now + WINDOWS[completion_window], "finalizing_at": None, "completed_at": None,
             "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
             "polychip": {"output": None, "error": None}}
        self.batches[b["id"]] = b
        created = copy.deepcopy(public(b))     # the answer is the batch as created, whatever its run does meanwhile
        if self.is_leader():          # launched before the write, so that its echo finds it running
            self._launch(b)
        await self._save(b, as_leader=False)    # otherwise the leader sees it in the store and runs it
        return created

    def get(self, batch_id: str) -> dict:
        b = self.batches.get(batch_id)
        if b is None:
            raise FileError(404, f"no such batch: {batch_id!r}", "not_found_error", "batch_id")
        return b

    def list(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        ordered = sorted(self.batches.values(), key=lambda b: (-b["created_at"], b["id"]))
        if after is not None:
            ids = [b["id"] for b in ordered]
            ordered = ordered[ids.index(after) + 1:] if after in ids else []
        return [public(b) for b in ordered[:limit]], len(ordered) > limit

    async def cancel(self, batch_id: str) -> dict:
        b = self.get(batch_id)
        if b["status"] in ("validating", "in_progress") and batch_id in self.tasks:
            self._set(b, "cancelling")
            await self._save(b)
        elif b["status"] in ("validating", "in_progress"):      # the leader runs it: tell it through the store
            b = await asyncio.to_thread(self._cancel_stored, batch_id)
        elif b["status"] not in ("cancelling", "cancelled"):
            raise FileError(409, f"batch {batch_id} is {b['status']}; only a validating or in_progress batch "
                            "can be cancelled", param="batch_id")
        return public(b)

    def uses(self, file_id: str) -> str | None:
        """The active batch reading or writing ``file_id``, if any."""
        for b in self.batches.values():
            if b["status"] in ACTIVE and file_id in (b["input_file_id"], *b["polychip"].values()):
                return b["id"]
        return None

    # the run
    def _launch(self, b: dict) -> None:
        self.tasks[b["id"]] = self.spawn(f"batch {b['id']}", self._drive(b))
        self.tasks[b["id"]].add_done_callback(lambda _t, i=b["id"]: self.tasks.pop(i, None))

    def _set(self, b: dict, status: str) -> None:
        b["status"] = status
        b[f"{status}_at"] = int(self.clock())
        log.info("batch %s: %s %s", b["id"], status, b["request_counts"])

    async def _drive(self, b: dict) -> None:
        try:
            if b["status"] == "validating":
                await self._validate(b)
            if b["status"] in ("in_progress", "cancelling") and b["polychip"]["output"]:
                await self._run(b)
            elif b["status"] == "cancelling":          # cancelled while validating
                self._set(b, "cancelled")
            if b["status"] == "finalizing":
                self._finalize(b, "completed")
        except asyncio.CancelledError:
            raise
        except Exception as e:        # the batch fails with the reason; the router goes on
            log.exception("batch %s failed", b["id"])
            b["errors"] = {"object": "list", "data": [{"code": "internal_error", "line": None, "param": None,
                                                       "message": f"{type(e).__name__}: {e}"}]}
            self._set(b, "failed")
        await self._save(b)

    async def _validate(self, b: dict) -> None:
        path = self.files.path(b["input_file_id"])
        found = await asyncio.to_thread(check_file, path, b["endpoint"])
        await self._check_bodies(path, b["endpoint"], found)
        if b["status"] == "cancelling":
            return
        if found.total == 0 or found.error_count:
            errors = [{"code": e.code, "message": e.describe(), "param": e.param, "line": e.line}
                      for e in found.errors] or [{"code": "empty_file", "message": "the input file has no lines",
                                                  "param": None, "line": None}]
            if found.error_count > len(found.errors):
                errors.append({"code": "too_many_errors", "param": None, "line": None,
                               "message": f"{found.error_count - len(found.errors)} more problem(s) not listed"})
            b["errors"] = {"object": "list", "data": errors}
            self._set(b, "failed")
            return
        b["request_counts"]["total"] = found.total
        stem = b["id"]
        b["polychip"] = {"output": self.files.create_empty(f"{stem}_output.jsonl", "batch_output")["id"],
                         "error": self.files.create_empty(f"{stem}_error.jsonl", "batch_output")["id"]}
        self._set(b, "in_progress")
        await self._save(b)

    async def _check_bodies(self, path: str, endpoint: str, found: FileCheck) -> None:
        """Stream the lines again and have a replica check their bodies, CHECK_CHUNK at a time."""
        chunk: list[BatchRequest] = []

        async def flush():
            for p in await self._check(endpoint, [item.body for item in chunk]):
                item = chunk[p["index"]]
                found.add(body_error(item.line, item.custom_id, (p["message"], p.get("param"))))
            chunk.clear()
        for item in parsed_lines(path):
            if isinstance(item, BatchRequest) and item.url == endpoint:    # the others are refused already
                chunk.append(item)
                if len(chunk) == CHECK_CHUNK:
                    await flush()
        if chunk:
            await flush()
        found.errors.sort(key=lambda e: e.line)

    async def _run(self, b: dict) -> None:
        out_path, err_path = (self.files.path(b["polychip"][k]) for k in ("output", "error"))
        done = await asyncio.to_thread(read_written, [out_path, err_path], is_success)
        counts = b["request_counts"]
        counts["completed"], counts["failed"] = done.ok, done.failed
        if b["status"] == "in_progress" and not self._expired(b):
            saver = self.spawn(f"batch {b['id']} autosave", self._autosave(b))
            try:
                with open(out_path, "ab", buffering=0) as out, open(err_path, "ab", buffering=0) as err:
                    writer = OrderedWriter(lambda r: out if is_success(r) else err, encode,
                                           lambda r: self._count(b, done, r))
                    await run_batch(parsed_lines(self.files.path(b["input_file_id"])),
                                    lambda req: self._one(b, req), writer, done, Limits(self.cfg.concurrency),
                                    stop=lambda: b["status"] != "in_progress" or self._expired(b))
            finally:
                saver.cancel()
        if b["status"] == "cancelling":
            self._finalize(b, "cancelled")
        elif self._expired(b):
            await asyncio.to_thread(self._expire_rest, b, done, err_path)
            self._finalize(b, "expired")
        else:
            self._set(b, "finalizing")

    def _count(self, b: dict, done: Written, record: dict) -> None:
        ok = is_success(record)
        done.add(record, ok)
        b["request_counts"]["completed" if ok else "failed"] += 1
        self._dirty.add(b["id"])

    async def _autosave(self, b: dict, every: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every)
            if b["id"] in self._dirty:
                self._dirty.discard(b["id"])
                await self._save(b)

    async def _one(self, b: dict, req: BatchRequest) -> dict:
        """One line through the router, waiting (with backoff) while it cannot be placed yet."""
        deadline, pause = time.monotonic() + self.cfg.retry_for, 0.25
        async with self._slots:
            while True:
                status, rid, raw = await self._send(req.url, req.body)
                if status not in RETRY_STATUS or time.monotonic() + pause > deadline or b["status"] != "in_progress":
                    break
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"error": {"message": raw[:1000].decode(errors="replace"), "type": "upstream_error",
                              "param": None, "code": status}}
        return response_record(req.custom_id, status, rid, body)

    def _expired(self, b: dict) -> bool:
        return self.clock() >= b["expires_at"]

    def _expire_rest(self, b: dict, done: Written, err_path: str) -> None:
        """Every line the window left unrun gets a batch_expired record in the error file."""
        with open(err_path, "ab", buffering=0) as err:
            for item in parsed_lines(self.files.path(b["input_file_id"])):
                if (item.custom_id, item.line) not in done:
                    record = failed_record(item.custom_id, "batch_expired", "the batch's completion_window "
                                           "passed before this request ran")
                    err.write(encode(record))
                    self._count(b, done, record)

    def _finalize(self, b: dict, final: str) -> None:
        for key, field in (("output", "output_file_id"), ("error", "error_file_id")):
            file_id = b["polychip"][key]
            meta = self.files.refresh_size(file_id)
            b[field] = file_id if meta["bytes"] or key == "output" else None
        self._set(b, final)


def public(b: dict) -> dict:
    """The batch object as OpenAI shows it (without the router's own bookkeeping)."""
    return {k: v for k, v in b.items() if k != "polychip"}
