"""The etcd watch: one stream at a time, resumed from the next revision on another member when one
goes; a ThreadLoop (loops.py), so a broken stream is counted and shown, never a silent end."""
from __future__ import annotations

import json
import logging
import socket

import requests
from etcd3gw.utils import _decode, _encode, _increment_last_byte

from polychip.router.state.base import CompactedError, Event, StoreError
from polychip.router.state.etcd_conn import value_of
from polychip.router.state.loops import ThreadLoop

log = logging.getLogger("polychip.router.state")


class _Canceled(Exception):
    pass


class WatchRunner:
    """One watch stream at a time on a thread; when a member goes, resume on the next one from the
    revision after the last event seen (etcd replays from there, so nothing is missed). When etcd
    has compacted that revision away (a member was out of reach across a compaction), list the
    prefix afresh and deliver the difference as ordinary events: a put for every key, a delete for
    each key it had seen that is gone; then watch on from the listing's revision."""

    def __init__(self, store, prefix: str, callback, start_revision: int):
        self.store, self.prefix, self.callback, self.next_rev = store, prefix, callback, start_revision
        self.full = store.ns + prefix
        self.present = store.keys_at(prefix, start_revision - 1) if start_revision > 1 else set()
        self.resyncs = 0
        self.response: requests.Response | None = None
        self._streams = 0
        self.loop = ThreadLoop(f"watch {prefix or '(all keys)'}", self._stream,
                               lambda: 0.0 if self._streams == 0 else 0.1,
                               lambda name, e: store.on_loop_failure and store.on_loop_failure(name, e),
                               max_backoff=1.0)      # a member back is watched again within a second
        self.stopped = self.loop.stopping
        self.loop.start()

    def _read(self, response: requests.Response) -> None:
        """The gateway's stream: one JSON object per line. etcd3gw's own reader skips a ``canceled``
        message (etcd sends one when the member loses its leader), which would leave the watch silent
        for good; here it ends the stream so the watch resumes on another member."""
        for line in response.iter_lines():
            if not line.strip():
                continue
            result = json.loads(line).get("result", {})
            if result.get("compact_revision"):
                raise CompactedError(f"etcd watch from revision {self.next_rev}: compacted at "
                                     f"{result['compact_revision']}")
            if result.get("canceled"):
                raise _Canceled(result.get("cancel_reason") or "canceled")
            for raw in result.get("events", ()):
                self._on_event(raw)

    def _on_event(self, raw: dict) -> None:
        kv = raw["kv"]
        rev = int(kv["mod_revision"])
        key = _decode(kv["key"]).decode()[len(self.store.ns):]
        if raw.get("type") == "DELETE":
            ev = Event("delete", key, None, rev)
        else:
            ev = Event("put", key, value_of(kv), rev)
        self.next_rev = rev + 1
        self._deliver(ev)

    def _deliver(self, ev: Event) -> None:
        (self.present.discard if ev.kind == "delete" else self.present.add)(ev.key)
        if not self.stopped.is_set():
            try:
                self.callback(ev)
            except Exception:
                log.exception("state watch callback failed on %s", ev)

    def _resync(self, why: CompactedError) -> None:
        entries, rev = self.store.list(self.prefix)
        gone = self.present - {e.key for e in entries}
        log.warning("%s; listed %d keys under %r at revision %d (%d gone) and watching from there",
                    why, len(entries), self.prefix, rev, len(gone))
        for key in sorted(gone):
            self._deliver(Event("delete", key, None, rev))
        for e in entries:
            self._deliver(Event("put", e.key, e.value, e.revision))
        self.next_rev, self.resyncs = rev + 1, self.resyncs + 1

    def _stream(self) -> None:
        """One stream from the current member until it ends; then the next member (etcd replays from
        ``next_rev``). A compaction lists afresh; a failure is the loop's to count and back off."""
        store = self.store
        i, self._streams = store._current, self._streams + 1
        member = store.members[i]
        body = {"create_request": {"key": _encode(self.full), "range_end": _encode(_increment_last_byte(self.full)),
                                   "start_revision": self.next_rev}}
        try:
            if member.user is not None and member._token is None:
                member.authenticate()
            self.response = member.session.post(member.client.get_url("/watch"), json=body, stream=True,
                                                timeout=(2, None))
            if self.response.status_code == 401 and member.user is not None:
                member.authenticate()          # the token expired: the next stream has a new one
            if self.response.status_code != 200:
                raise StoreError(f"etcd at {member.where}: watch of {self.prefix!r} answered HTTP "
                                 f"{self.response.status_code}: {self.response.text[:300]}")
            self.loop.working()
            self._read(self.response)
            log.info("etcd watch on %s ended; resuming from revision %d", member.where, self.next_rev)
        except CompactedError as e:
            self._resync(e)
        except Exception:
            if self.stopped.is_set():
                return
            raise
        finally:
            if store._current == i and not self.stopped.is_set():
                store._current = (i + 1) % len(store.members)

    def stop(self) -> None:
        """Shut the stream's socket down (as etcd3gw's Watcher.stop does): a plain close blocks while
        the reading thread sits in recv."""
        self.loop.stop()
        if self.response is not None:
            try:
                sock = socket.fromfd(self.response.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except (OSError, AttributeError, ValueError):
                pass                          # already closed
