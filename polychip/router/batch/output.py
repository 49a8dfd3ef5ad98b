"""The output side: what earlier runs wrote (the resume set), and a writer that puts records on
disk in input order as they complete, one whole line per write, flushed, so a killed run leaves at
most one partial last line, which the next run cuts off and redoes."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import BinaryIO, Callable


@dataclass
class Written:
    """Lines earlier runs finished: by custom_id, and by line number for lines too broken to have one."""
    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)
    ok: int = 0
    failed: int = 0

    def __contains__(self, key: tuple[str | None, int]) -> bool:
        custom_id, line = key
        return custom_id in self.custom_ids if custom_id is not None else line in self.lines

    def add(self, record: dict, ok: bool) -> None:
        if record.get("custom_id") is not None:
            self.custom_ids.add(record["custom_id"])
        elif isinstance(record.get("error"), dict) and isinstance(record["error"].get("line"), int):
            self.lines.add(record["error"]["line"])
        self.ok += ok
        self.failed += not ok


def cut_partial_line(path: str) -> int:
    """Drop a last line with no newline (a write a kill interrupted); the bytes removed."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        keep, step = size, 1 << 16
        while keep > 0:
            start = max(0, keep - step)
            f.seek(start)
            chunk = f.read(keep - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            keep = start
        if keep == size:
            return 0
        f.truncate(keep)
        return size - keep


def read_written(paths: list[str], is_ok: Callable[[dict], bool], into: Written | None = None) -> Written:
    """The resume set of the output file(s), after cutting any partial last line."""
    done = into or Written()
    for path in paths:
        cut_partial_line(path)
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    record = json.loads(raw)
                except ValueError:
                    raise ValueError(f"{path}: line {number} is not a JSON record; it is not an output file "
                                     "this runner wrote (refusing to resume into it)") from None
                done.add(record, is_ok(record))
    return done


class OrderedWriter:
    """Records arrive by index in any order; each is written once every earlier index is written.
    ``sink(record) -> file`` picks the file (one output file, or output and error files)."""

    def __init__(self, sink: Callable[[dict], BinaryIO], encode: Callable[[dict], bytes],
                 on_written: Callable[[dict], None] = lambda r: None):
        self.sink, self.encode, self.on_written = sink, encode, on_written
        self.next = 0
        self.pending: dict[int, dict] = {}

    def put(self, index: int, record: dict) -> int:
        """Queue ``record`` as number ``index``; returns how many records this wrote."""
        if index < self.next or index in self.pending:
            raise ValueError(f"record {index} was given twice")
        self.pending[index] = record
        wrote = 0
        while self.next in self.pending:
            rec = self.pending.pop(self.next)
            f = self.sink(rec)
            f.write(self.encode(rec))
            f.flush()
            self.next += 1
            wrote += 1
            self.on_written(rec)
        return wrote

    @property
    def buffered(self) -> int:
        return len(self.pending)

