"""Checking what a worker sends before the daemon does anything with it.

A worker runs code nobody here has read, so every frame it sends is untrusted input to the daemon:
msgspec's typed decode (``sandbox.wire``) fixes each frame's shape and field types, and this module
checks the free-form values inside (log data, structured results, content items, tool metadata)
before they are relayed, re-encoded as JSON or logged:

* depth at most ``MAX_VALUE_DEPTH`` (a deep value would make the daemon's JSON encoder raise
  ``RecursionError``, and many clients cannot read it either);
* only JSON values: ``None``, booleans, integers, finite floats, strings, lists, and maps whose
  keys are strings (msgpack also carries binary, extension types, timestamps, non-string keys and
  NaN, which JSON cannot carry or which a client would misread);
* at most ``MAX_VALUE_NODES`` values in one frame.

The walk is iterative (no recursion of our own) and stops at the first problem, which it names in
``FrameRejected``; the caller fails the call with it and recycles the worker.
"""

from __future__ import annotations

import math
from typing import Any

from sandbox import wire
from runtime.logs import log

MAX_VALUE_DEPTH = 64
MAX_VALUE_NODES = 1_000_000

_SCALARS = (str, int, bool, type(None), bytes)


class FrameRejected(Exception):
    """A worker sent a value the daemon will not relay; the message says what was wrong."""


def check_value(value: Any, what: str) -> None:
    """Raise ``FrameRejected`` unless ``value`` is a JSON value within the depth and size bounds.

    ``bytes`` are allowed (the JSON encoder writes them as base64, as before this check existed)."""
    kind = type(value)
    if kind in _SCALARS:
        return
    if kind is float:
        if not math.isfinite(value):
            raise FrameRejected(f"{what} contains a non-finite number (NaN or infinity)")
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    push = stack.append
    pop = stack.pop
    while stack:
        item, depth = pop()
        nodes += 1
        kind = type(item)
        if kind is dict:
            if depth >= MAX_VALUE_DEPTH:
                raise FrameRejected(f"{what} is nested deeper than {MAX_VALUE_DEPTH} levels")
            for key, child in item.items():
                if type(key) is not str:
                    raise FrameRejected(f"{what} has a map key that is not a string ({type(key).__name__})")
                if type(child) in _SCALARS:
                    nodes += 1
                else:
                    push((child, depth + 1))
        elif kind is list:
            if depth >= MAX_VALUE_DEPTH:
                raise FrameRejected(f"{what} is nested deeper than {MAX_VALUE_DEPTH} levels")
            for child in item:
                if type(child) in _SCALARS:
                    nodes += 1
                else:
                    push((child, depth + 1))
        elif kind is float:
            if not math.isfinite(item):
                raise FrameRejected(f"{what} contains a non-finite number (NaN or infinity)")
        elif kind not in _SCALARS:
            raise FrameRejected(f"{what} contains a {kind.__name__}, which is not a JSON value")
        if nodes > MAX_VALUE_NODES:
            raise FrameRejected(f"{what} holds more than {MAX_VALUE_NODES} values")


def check_result(msg: wire.Result) -> None:
    """Content items and structured content of a ``Result``."""
    for item in msg.content:
        # The common item ({"type": "text", "text": ...}) is flat: no walk needed.
        for child in item.values():
            if type(child) not in _SCALARS:
                check_value(msg.content, "the result's content")
                break
    if msg.has_structured:
        check_value(msg.structured, "the result's structured content")


def check_progress(msg: wire.Progress) -> None:
    if not math.isfinite(msg.progress) or (msg.total is not None and not math.isfinite(msg.total)):
        raise FrameRejected("a progress notification carries a non-finite number (NaN or infinity)")


def check_log(msg: wire.Log) -> None:
    if not 0 <= msg.level < len(wire.LOG_LEVELS):
        raise FrameRejected(f"a log message has level {msg.level}, outside 0..{len(wire.LOG_LEVELS) - 1}")
    check_value(msg.data, "a log message's data")


#: Most requests in one ``Ask`` round, and the longest key.
MAX_ASK_REQUESTS = 16
MAX_ASK_KEY = 64


def check_ask(msg: wire.Ask) -> None:
    """One round of questions: a few requests, each of a known method with a JSON params object
    under a short unique key (the client sees the key in 2026-07-28 ``inputRequests``)."""
    if not msg.requests:
        raise FrameRejected("an Ask frame asks nothing")
    if len(msg.requests) > MAX_ASK_REQUESTS:
        raise FrameRejected(f"an Ask frame asks {len(msg.requests)} questions, over {MAX_ASK_REQUESTS} in one round")
    keys = set()
    for request in msg.requests:
        if request.method not in wire.INPUT_METHODS:
            raise FrameRejected(f"an Ask frame asks for {request.method[:64]!r}, which a tool cannot ask a client")
        key = request.key
        if not key or len(key) > MAX_ASK_KEY or not key.isascii() or not key.isprintable() or key in keys:
            raise FrameRejected("an Ask frame's keys must be short, printable, ASCII and unique")
        keys.add(key)
        check_value(request.params, f"the params of {request.method}")


def check_ready(msg: wire.Ready) -> None:
    """The free-form parts of tool definitions (schemas are checked again by ``runtime.protocol.schemas``)."""
    for spec in msg.tools:
        for name in ("input_schema", "output_schema", "annotations", "icons", "meta"):
            check_value(getattr(spec, name), f"tool {spec.name[:64]!r}'s {name}")


def truncate_log(msg: wire.Log, size: int, cap: int) -> wire.Log:
    """A log frame of ``size`` bytes, over the per-message cap, with its data replaced by a note."""
    note = f"[truncated by toolcell: this log message was {size} bytes, over the {cap}-byte limit per message]"
    logger = msg.logger[:256] if msg.logger is not None else None
    return wire.Log(msg.id, msg.level, note, logger)


def truncate_progress(msg: wire.Progress, cap: int) -> wire.Progress:
    message = msg.message
    if message is not None and len(message) > cap:
        message = message[: max(0, cap - 40)] + " [truncated by toolcell]"
    return wire.Progress(msg.id, msg.progress, msg.total, message)


def check_notification(msg: wire.Progress | wire.Log) -> None:
    """A progress or log frame, checked (raises ``FrameRejected``)."""
    if type(msg) is wire.Log:
        check_log(msg)
    else:
        check_progress(msg)  # type: ignore[arg-type]


def within_budget(slot: Any, msg: Any, size: int, limits: wire.Limits, plugin: str, tool: str) -> Any:
    """The progress/log frame to relay for a call (``slot`` counts what it relayed: ``notes``,
    ``note_bytes``, ``notes_dropped``), or None when the call's budget is spent.

    Budget (``Limits``): at most ``max_notifications`` notifications whose bytes, together, stay within
    ``max_output_bytes``; one over ``max_notification_bytes`` is truncated. Beyond the budget
    notifications are dropped (the reader keeps draining, so nothing piles up) and the log says so
    once per call. Shared by worker pools and hosted servers."""
    if size > limits.max_notification_bytes:
        if type(msg) is wire.Log:
            msg = truncate_log(msg, size, limits.max_notification_bytes)
        else:
            msg = truncate_progress(msg, limits.max_notification_bytes)
        size = limits.max_notification_bytes
        if not slot.notes_dropped and not slot.notes:
            log("notification_truncated", level="warning", plugin=plugin, tool=tool,
                limit_bytes=limits.max_notification_bytes)
    if slot.notes >= limits.max_notifications or slot.note_bytes + size > limits.max_output_bytes:
        if not slot.notes_dropped:
            log("notification_budget_exhausted", level="warning", plugin=plugin, tool=tool, relayed=slot.notes,
                relayed_bytes=slot.note_bytes, max_notifications=limits.max_notifications,
                max_output_bytes=limits.max_output_bytes, note="later progress/log notifications of this call are dropped")
        slot.notes_dropped += 1
        return None
    slot.notes += 1
    slot.note_bytes += size
    return msg
