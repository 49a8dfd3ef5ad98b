"""Output records in OpenAI's batch shape: ``{id, custom_id, response: {status_code, request_id,
body}, error}``. A request that ran has a response (its HTTP status and body, errors included); a
line that never ran (bad JSON, a refused body) has ``response: null`` and an ``error``."""
from __future__ import annotations

import json
import uuid

from polychip.router.batch.lines import LineError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_record(custom_id: str, status_code: int, request_id: str, body) -> dict:
    return {"id": new_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def error_record(err: LineError) -> dict:
    return {"id": new_id("batch_req"), "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": err.describe(), "param": err.param, "line": err.line}}


def failed_record(custom_id: str, code: str, message: str) -> dict:
    """A request that was sent but got no HTTP answer (the runner gave up on it)."""
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def is_success(record: dict) -> bool:
    response = record.get("response")
    return record.get("error") is None and response is not None and response["status_code"] == 200


def completion_tokens(record: dict) -> int:
    response = record.get("response") or {}
    body = response.get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    return int((usage or {}).get("completion_tokens") or 0)


def encode(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
