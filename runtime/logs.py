"""Structured logs on stderr (stdout belongs to the protocol): one JSON object per line, or on a
terminal one readable, coloured line per event (structlog's ``ConsoleRenderer``).

``log(event, **fields)`` is the single hook; it costs one level check when the level is off.
``configure(level, format=...)`` picks the format: "json", "text", or "auto" (text when stderr is a
terminal, JSON otherwise: a file, a pipe, a log collector). Secrets never go through here: callers
pass sizes and names, not arguments or tokens. Values may come from plugins (their output, their
names): in text they are escaped, so that no control character reaches the terminal.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Literal, TextIO

import msgspec

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
FORMATS = ("auto", "json", "text")
LogFormat = Literal["auto", "json", "text"]
_encoder = msgspec.json.Encoder()
Render = Callable[[dict[str, Any]], str]


class _State:
    level = LEVELS["info"]
    stream: TextIO | None = None
    format: LogFormat = "auto"
    #: How a record becomes a line; chosen at the first line after ``configure`` (``_renderer``).
    render: Render | None = None
    sinks: list[Callable[[dict[str, Any]], None]] = []


def configure(level: str = "info", stream: TextIO | None = None, format: LogFormat | None = None) -> None:
    """Set the level, the stream (default: stderr) and the format ("auto" unless given before)."""
    _State.level = LEVELS.get(level, 20)
    _State.stream = stream
    if format is not None:
        _State.format = format
    _State.render = None


def _json_line(record: dict[str, Any]) -> str:
    return _encoder.encode(record).decode("utf-8", "replace")


def _renderer(stream: TextIO) -> Render:
    fmt = _State.format
    try:
        tty = stream.isatty()
    except (ValueError, OSError):
        tty = False
    if fmt == "json" or (fmt == "auto" and not tty):
        return _json_line
    # Only for people at a terminal (or who asked): the daemon behind a client never imports it.
    import structlog

    console = structlog.dev.ConsoleRenderer(colors=tty and "NO_COLOR" not in os.environ, sort_keys=False,
                                            pad_event_to=28)

    def text_line(record: dict[str, Any]) -> str:
        fields = {k: _printable(v) for k, v in record.items() if k not in ("ts", "level", "event")}
        when = time.strftime("%H:%M:%S", time.localtime(record["ts"])) + f".{int(record['ts'] * 1000) % 1000:03d}"
        return str(console(None, record["level"], {"timestamp": when, "level": record["level"],
                                                   "event": _printable(record["event"]), **fields}))

    return text_line


def _printable(value: Any) -> Any:
    """A string with its control characters escaped (other values are rendered with repr, which does)."""
    if isinstance(value, str) and not value.isprintable():
        return value.encode("unicode_escape").decode("ascii")
    return value


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
        render = _State.render
        if render is None:
            render = _State.render = _renderer(stream)
        stream.write(render(record) + "\n")
        stream.flush()
    except (ValueError, OSError):
        pass
