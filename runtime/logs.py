"""Structured logs: one JSON object per line on stderr (stdout belongs to the protocol).

``log(event, **fields)`` is the single hook; it costs one level check when the level is off.
Secrets never go through here: callers pass sizes and names, not arguments or tokens.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

import msgspec

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_encoder = msgspec.json.Encoder()


class _State:
    level = LEVELS["info"]
    stream: TextIO | None = None
    sinks: list[Callable[[dict[str, Any]], None]] = []


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    _State.level = LEVELS.get(level, 20)
    _State.stream = stream


def add_sink(sink: Callable[[dict[str, Any]], None]) -> None:
    """Also hand every record to ``sink`` (tests, metrics)."""
    _State.sinks.append(sink)


def remove_sink(sink: Callable[[dict[str, Any]], None]) -> None:
    if sink in _State.sinks:
        _State.sinks.remove(sink)


def log(event: str, level: str = "info", **fields: Any) -> None:
    if LEVELS.get(level, 20) < _State.level and not _State.sinks:
        return
    record = {"ts": round(time.time(), 3), "level": level, "event": event, **fields}
    for sink in _State.sinks:
        sink(record)
    if LEVELS.get(level, 20) < _State.level:
        return
    stream = _State.stream or sys.stderr
    try:
        stream.write(_encoder.encode(record).decode("utf-8", "replace") + "\n")
        stream.flush()
    except (ValueError, OSError):
        pass
