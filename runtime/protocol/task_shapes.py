"""Tasks on the wire, for both eras. Sans-io.

* 2025-11-25 (core, experimental): ``Task = {taskId, status, statusMessage?, createdAt,
  lastUpdatedAt, ttl, pollInterval?}``; a task-augmented ``tools/call`` answers
  ``CreateTaskResult = {task: Task}``; ``tasks/get`` and ``tasks/cancel`` answer the ``Task``;
  ``tasks/result`` answers what the call would have (with ``_meta`` related-task);
  ``notifications/tasks/status`` carries the ``Task``.
* 2026-07-28 (extension ``io.modelcontextprotocol/tasks``): a flat ``{resultType: "task", taskId,
  status, statusMessage?, createdAt, lastUpdatedAt, ttlMs, pollIntervalMs?}``; ``tasks/get`` answers
  ``{resultType: "complete", …}`` with ``result`` (completed), ``error`` (failed) or ``inputRequests``
  (input_required); ``tasks/update`` and ``tasks/cancel`` answer ``{resultType: "complete"}``;
  ``notifications/tasks`` carries the task's full state.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import msgspec

EXTENSION = "io.modelcontextprotocol/tasks"
RELATED_TASK = "io.modelcontextprotocol/related-task"
STATUSES = ("working", "input_required", "completed", "failed", "cancelled")
TERMINAL = frozenset({"completed", "failed", "cancelled"})

_enc = msgspec.json.Encoder()
#: ``{}`` with whitespace inside (a stored result is checked to be one JSON object, not compact).
_EMPTY_OBJECT = re.compile(rb"\{[ \t\r\n]*\}")


class TaskView(msgspec.Struct, frozen=True, kw_only=True):
    """What the wire shows of a task (built from the store's record by the daemon)."""

    task_id: str
    status: str
    status_message: str | None = None
    created_at_ms: int
    updated_at_ms: int
    ttl_ms: int | None
    poll_interval_ms: int | None = None
    #: Raw JSON of the result object (completed, or failed with a result), a JSON-RPC error object
    #: (failed) and the open input requests (input_required).
    result: bytes | None = None
    error: bytes | None = None
    input_requests: bytes | None = None


def iso(ms: int) -> str:
    """An RFC 3339 / ISO 8601 UTC timestamp with milliseconds."""
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _common(view: TaskView, modern: bool) -> dict[str, Any]:
    obj: dict[str, Any] = {"taskId": view.task_id, "status": view.status}
    if view.status_message is not None:
        obj["statusMessage"] = view.status_message
    obj["createdAt"] = iso(view.created_at_ms)
    obj["lastUpdatedAt"] = iso(view.updated_at_ms)
    if modern:
        obj["ttlMs"] = view.ttl_ms
        if view.poll_interval_ms is not None:
            obj["pollIntervalMs"] = view.poll_interval_ms
    else:
        obj["ttl"] = view.ttl_ms
        if view.poll_interval_ms is not None:
            obj["pollInterval"] = view.poll_interval_ms
    return obj


def legacy_task(view: TaskView) -> bytes:
    """The 2025-11-25 ``Task`` object."""
    return _enc.encode(_common(view, modern=False))


def legacy_create_result(view: TaskView) -> bytes:
    return b'{"task":' + legacy_task(view) + b"}"


def modern_create_result(view: TaskView) -> bytes:
    """The flat 2026-07-28 ``CreateTaskResult`` (no result, error or input requests, ever)."""
    return _enc.encode({"resultType": "task", **_common(view, modern=True)})


def modern_detailed(view: TaskView, result_type: bool = True) -> bytes:
    """``tasks/get`` (and ``notifications/tasks``): the task with what its status carries."""
    head = {"resultType": "complete"} if result_type else {}
    body = _enc.encode({**head, **_common(view, modern=True)})
    extra = b""
    if view.status == "completed" and view.result is not None:
        extra = b',"result":' + view.result
    elif view.status == "failed" and view.error is not None:
        extra = b',"error":' + view.error
    elif view.status == "input_required" and view.input_requests is not None:
        extra = b',"inputRequests":' + view.input_requests
    return body[:-1] + extra + b"}"


ACK = b'{"resultType":"complete"}'


def with_related_task(result: bytes, task_id: str) -> bytes:
    """A result object with ``_meta`` related-task added (2025-11-25 ``tasks/result``)."""
    meta = b'"_meta":{"' + RELATED_TASK.encode() + b'":{"taskId":' + _enc.encode(task_id) + b"}}"
    inner = result.strip()
    if _EMPTY_OBJECT.fullmatch(inner):
        return b"{" + meta + b"}"
    if b'"_meta":' in inner:
        obj = msgspec.json.decode(inner)
        if isinstance(obj, dict):
            existing = obj.get("_meta")
            obj["_meta"] = {**(existing if isinstance(existing, dict) else {}), RELATED_TASK: {"taskId": task_id}}
            return _enc.encode(obj)
    return inner[:-1] + b"," + meta + b"}"
