"""BatchConfig: the router's settings for OpenAI files and batch jobs (part of RouterConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from polychip.errors import ConfigError


@dataclass(frozen=True)
class BatchConfig:
    files_dir: str | None = None            # where uploads, outputs and batch progress live; None: API off
    max_file_bytes: int = 200 * 1024 * 1024  # an upload's limit (OpenAI's is 200 MB per batch file)
    concurrency: int = 4                    # batch requests in flight at once, all batches together
    retry_for: float = 300.0                # a request the router cannot place yet (503) is retried this long

    def __post_init__(self):
        if self.max_file_bytes < 1:
            raise ConfigError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.concurrency < 1:
            raise ConfigError(f"batch concurrency must be >= 1, got {self.concurrency}")
        if self.retry_for < 0:
            raise ConfigError(f"batch retry_for must be >= 0 seconds, got {self.retry_for}")
