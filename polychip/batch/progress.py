"""The progress bar of a batch run: done of total, failed, output tokens per second, ETA (tqdm)."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from polychip.router.batch.records import completion_tokens, is_success


class BatchProgress:
    def __init__(self, total: int, already: int = 0, file=sys.stderr):
        tty = file.isatty()
        self.tty = file.isatty()
        self.bar = tqdm(total=total, initial=already, unit="req", file=file, dynamic_ncols=tty, leave=tty,
                        mininterval=0.5 if tty else 10.0, smoothing=0.1, desc="batch",
                        bar_format="{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} "
                                   "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        self.ok = self.failed = self.tokens = 0
        self.t0 = time.perf_counter()

    def written(self, record: dict) -> None:
        if is_success(record):
            self.ok += 1
        else:
            self.failed += 1
        self.tokens += completion_tokens(record)
        self.bar.set_postfix_str(f"ok={self.ok} failed={self.failed} tok/s={self.tokens_per_s:.1f}", refresh=False)
        self.bar.update(1)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.elapsed, 1e-9)

    def close(self) -> str:
        """Closes the bar; returns its last line (printed again when stderr is not a terminal)."""
        self.bar.refresh()
        line = str(self.bar)
        self.bar.close()
        return line
