"""The routes of OpenAI's files and batches API on the router: /v1/files (upload, list, get,
content, delete) and /v1/batches (create, list, get, cancel). Without --files-dir they answer 404
saying so."""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from polychip.router.batches import public
from polychip.router.files import FileError
from polychip.router.proxy import error_json

FORM_OVERHEAD = 64 * 1024        # multipart headers and the purpose field around the file's bytes


def _refusal(e: FileError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}}
    return JSONResponse(body, status_code=e.status)


def _page(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def _limit(request: Request, default: int = 20) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= 10000:
        raise FileError(400, f"limit must be an integer in [1, 10000], got {raw!r}", param="limit")
    return int(raw)


def batch_routes(get_jobs: Callable, locked_out: Callable[[Request], Response | None]) -> APIRouter:
    """``get_jobs()`` is the router's BatchJobs, or None when the batch API is off."""
    api = APIRouter()

    def guard(request: Request):
        refused = locked_out(request)
        if refused is not None:
            return None, refused
        jobs = get_jobs()
        if jobs is None:
            return None, error_json(404, "the files and batches API is off: start the router with --files-dir DIR",
                                    "not_found_error")
        return jobs, None

    def route(method: str, path: str):
        """A handler that gets (jobs, request, **path params); FileError becomes its 4xx."""
        def wrap(handler):
            async def endpoint(request: Request):
                jobs, refused = guard(request)
                if refused is not None:
                    return refused
                try:
                    return await handler(jobs, request, **request.path_params)
                except FileError as e:
                    return _refusal(e)
            api.add_api_route(path, endpoint, methods=[method])
            return handler
        return wrap

    @route("POST", "/v1/files")
    async def upload(jobs, request: Request):
        files = jobs.files
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > files.max_bytes + FORM_OVERHEAD:
            raise files.too_big()
        form = await request.form(max_files=1, max_fields=8)
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise FileError(400, "the form has no file part named 'file'", param="file")
            if not isinstance(purpose, str):
                raise FileError(400, "the form has no purpose field (purpose must be 'batch')", param="purpose")
            return await asyncio.to_thread(files.upload, upload.file, upload.filename or "upload.jsonl", purpose)
        finally:
            await form.close()

    @route("GET", "/v1/files")
    async def list_files(jobs, request: Request):
        items = jobs.files.list(request.query_params.get("purpose"))
        after, limit = request.query_params.get("after"), _limit(request, 10000)
        if after is not None:
            ids = [m["id"] for m in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        return _page(items[:limit], len(items) > limit)

    @route("GET", "/v1/files/{file_id}")
    async def get_file(jobs, request: Request, file_id: str):
        return jobs.files.get(file_id)

    @route("GET", "/v1/files/{file_id}/content")
    async def file_content(jobs, request: Request, file_id: str):
        meta = jobs.files.get(file_id)
        return FileResponse(jobs.files.path(file_id), media_type="application/jsonl", filename=meta["filename"])

    @route("DELETE", "/v1/files/{file_id}")
    async def delete_file(jobs, request: Request, file_id: str):
        user = jobs.uses(file_id)
        if user is not None:
            raise FileError(409, f"file {file_id} is in use by batch {user}, which is still running; cancel it "
                            "first", param="file_id")
        return jobs.files.delete(file_id)

    @route("POST", "/v1/batches")
    async def create_batch(jobs, request: Request):
        try:
            data = json.loads(await request.body())
        except ValueError as e:
            raise FileError(400, f"invalid JSON body: {e}") from None
        if not isinstance(data, dict):
            raise FileError(400, "the body must be a JSON object")
        return await jobs.create(data.get("input_file_id"), data.get("endpoint"),
                                 data.get("completion_window"), data.get("metadata"))

    @route("GET", "/v1/batches")
    async def list_batches(jobs, request: Request):
        items, more = jobs.list(request.query_params.get("after"), _limit(request))
        return _page(items, more)

    @route("GET", "/v1/batches/{batch_id}")
    async def get_batch(jobs, request: Request, batch_id: str):
        return public(jobs.get(batch_id))

    @route("POST", "/v1/batches/{batch_id}/cancel")
    async def cancel_batch(jobs, request: Request, batch_id: str):
        return await jobs.cancel(batch_id)

    return api
