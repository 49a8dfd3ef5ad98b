"""OpenAI's files and batches API on the router, behind the API key: /v1/files (upload, list,
get, content, delete) and /v1/batches (create, list, get, cancel). Without --files-dir they
answer 404 saying so; a FileError is its 4xx in OpenAI's error shape (the edge's handlers)."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from polychip.router.batch.files import FileError
from polychip.router.batch.jobs import public
from polychip.router.routes import requires_key

FORM_OVERHEAD = 64 * 1024        # multipart headers and the purpose field around the file's bytes

def with_jobs(current, handler):
    """Run ``handler(jobs, request, **path params)`` once --files-dir is known to be set (``current()``:
    the BatchJobs, None without it)."""
    async def endpoint(request: Request):     # FastAPI sees only ``request`` (no functools.wraps)
        jobs = current()
        if jobs is None:
            raise FileError(404, "the files and batches API is off: start the router with --files-dir DIR",
                            "not_found_error")
        return await handler(jobs, request, **request.path_params)
    endpoint.__name__, endpoint.__doc__ = handler.__name__, handler.__doc__
    return endpoint


def _page(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def _limit(request: Request, default: int) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= 10000:
        raise FileError(400, f"limit must be an integer in [1, 10000], got {raw!r}", param="limit")
    return int(raw)


def batch_routes(settings, current) -> APIRouter:
    """``current()``: the router's BatchJobs (made at start; None without --files-dir)."""
    routes = APIRouter(dependencies=[requires_key(settings)])

    def jobs_of(handler):
        return with_jobs(current, handler)

    _file_routes(routes, jobs_of)
    _batch_job_routes(routes, jobs_of)
    return routes


def _file_routes(routes: APIRouter, jobs_of) -> None:
    """/v1/files: upload, list, get, content, delete (OpenAI's Files API)."""
    @routes.post("/v1/files")
    @jobs_of
    async def upload(jobs, request: Request):
        files = jobs.files          # the edge has checked the type and Content-Length (upload_paths)
        form = await request.form(max_files=1, max_fields=8)
        try:
            part, purpose = form.get("file"), form.get("purpose")
            if part is None or isinstance(part, str):
                raise FileError(400, "the form has no file part named 'file'", param="file")
            if not isinstance(purpose, str):
                raise FileError(400, "the form has no purpose field (purpose must be 'batch')", param="purpose")
            return await asyncio.to_thread(files.upload, part.file, part.filename or "upload.jsonl", purpose)
        finally:
            await form.close()

    @routes.get("/v1/files")
    @jobs_of
    async def list_files(jobs, request: Request):
        items = jobs.files.list(request.query_params.get("purpose"))
        after, limit = request.query_params.get("after"), _limit(request, 10000)
        if after is not None:
            ids = [m["id"] for m in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        return _page(items[:limit], len(items) > limit)

    @routes.get("/v1/files/{file_id}")
    @jobs_of
    async def get_file(jobs, request: Request, file_id: str):
        return jobs.files.get(file_id)

    @routes.get("/v1/files/{file_id}/content")
    @jobs_of
    async def file_content(jobs, request: Request, file_id: str):
        meta = jobs.files.get(file_id)
        return FileResponse(jobs.files.path(file_id), media_type="application/jsonl", filename=meta["filename"])

    @routes.delete("/v1/files/{file_id}")
    @jobs_of
    async def delete_file(jobs, request: Request, file_id: str):
        user = jobs.uses(file_id)
        if user is not None:
            raise FileError(409, f"file {file_id} is in use by batch {user}, which is still running; cancel it first",
                            param="file_id")
        return jobs.files.delete(file_id)


def _batch_job_routes(routes: APIRouter, jobs_of) -> None:
    """/v1/batches: create, list, get, cancel (OpenAI's Batch API)."""
    @routes.post("/v1/batches")
    @jobs_of
    async def create_batch(jobs, request: Request):
        try:
            data = json.loads(await request.body())
        except ValueError as e:
            raise FileError(400, f"invalid JSON body: {e}") from None
        if not isinstance(data, dict):
            raise FileError(400, "the body must be a JSON object")
        return await jobs.create(data.get("input_file_id"), data.get("endpoint"), data.get("completion_window"),
                                 data.get("metadata"))

    @routes.get("/v1/batches")
    @jobs_of
    async def list_batches(jobs, request: Request):
        items, more = jobs.list(request.query_params.get("after"), _limit(request, 20))
        return _page(items, more)

    @routes.get("/v1/batches/{batch_id}")
    @jobs_of
    async def get_batch(jobs, request: Request, batch_id: str):
        return public(jobs.get(batch_id))

    @routes.post("/v1/batches/{batch_id}/cancel")
    @jobs_of
    async def cancel_batch(jobs, request: Request, batch_id: str):
        return await jobs.cancel(batch_id)
