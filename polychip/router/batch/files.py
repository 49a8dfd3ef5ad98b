"""OpenAI's files, on disk under ``--files-dir``: ``<id>`` holds the bytes and ``<id>.json`` the
file object ({id, object, bytes, created_at, filename, purpose, status}). Uploads are purpose
``batch``; the batch runner makes ``batch_output`` files and appends to them as records finish."""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import BinaryIO

from polychip.http.errors import APIError

PURPOSES_IN = ("batch",)
_ID = re.compile(r"^file-[0-9a-f]{32}$")


class FileError(APIError):
    """A refused files or batches call (the edge's error handlers give it OpenAI's error body)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(status, message, type_, param)


class FileStore:
    def __init__(self, root: str, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)

    def path(self, file_id: str) -> str:
        if not _ID.match(file_id):
            raise FileError(404, f"no such file: {file_id!r}", "not_found_error", "file_id")
        return os.path.join(self.root, file_id)

    def _meta_path(self, file_id: str) -> str:
        return self.path(file_id) + ".json"

    def _save(self, meta: dict) -> dict:
        tmp = self._meta_path(meta["id"]) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, self._meta_path(meta["id"]))
        return meta

    def upload(self, src: BinaryIO, filename: str, purpose: str) -> dict:
        """Copy an uploaded file in; refuses a purpose other than batch and files over the limit."""
        if purpose not in PURPOSES_IN:
            raise FileError(400, f"purpose must be one of {list(PURPOSES_IN)} on this server, got {purpose!r}",
                            param="purpose")
        file_id = f"file-{uuid.uuid4().hex}"
        size = 0
        with open(self.path(file_id), "wb") as dst:
            while chunk := src.read(1 << 20):
                size += len(chunk)
                if size > self.max_bytes:
                    dst.close()
                    os.remove(self.path(file_id))
                    raise self.too_big()
                dst.write(chunk)
        return self._save(self._meta(file_id, filename, purpose, size))

    def too_big(self) -> FileError:
        return FileError(413, f"the file is larger than this router accepts ({self.max_bytes} bytes; "
                         "--max-file-bytes)", param="file")

    def create_empty(self, filename: str, purpose: str) -> dict:
        """A new, empty file the router writes itself (a batch's output or error file)."""
        file_id = f"file-{uuid.uuid4().hex}"
        open(self.path(file_id), "wb").close()
        return self._save(self._meta(file_id, filename, purpose, 0))

    def refresh_size(self, file_id: str) -> dict:
        meta = self.get(file_id)
        meta["bytes"] = os.path.getsize(self.path(file_id))
        return self._save(meta)

    @staticmethod
    def _meta(file_id: str, filename: str, purpose: str, size: int) -> dict:
        return {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None}

    def get(self, file_id: str) -> dict:
        try:
            with open(self._meta_path(file_id)) as f:
                return json.load(f)
        except FileNotFoundError:
            raise FileError(404, f"no such file: {file_id!r}", "not_found_error", "file_id") from None

    def list(self, purpose: str | None = None) -> list[dict]:
        """Newest first."""
        metas = []
        for name in os.listdir(self.root):
            if name.endswith(".json") and _ID.match(name[:-5]):
                try:
                    meta = self.get(name[:-5])
                except FileError:       # deleted meanwhile
                    continue
                if purpose is None or meta["purpose"] == purpose:
                    metas.append(meta)
        return sorted(metas, key=lambda m: (-m["created_at"], m["id"]))

    def delete(self, file_id: str) -> dict:
        self.get(file_id)
        os.remove(self._meta_path(file_id))
        with_bytes = self.path(file_id)
        if os.path.exists(with_bytes):
            os.remove(with_bytes)
        return {"id": file_id, "object": "file", "deleted": True}
