"""The audit log: one JSON line per tool call (who, which tool, how big, how it ended, how long).

Arguments and results are never written, only their size; tokens never reach this module. The
log is fed by ``Daemon.call_hooks`` (every call that reached a worker pool, on any transport) and
by the HTTP transport for calls refused before that (rate limits), and for calls the protocol core
refused (``unknown``/out-of-scope tools and bad params: ``invalid_params``; arguments that fail the
tool's schema: ``invalid_arguments``). Every ``tools/call`` that reaches the daemon gets exactly one
line. ``outcome`` is ``ok``, ``busy``
or the worker failure kind (``timeout``, ``output_cap``, ``crashed`` — which covers memory and
CPU kills —, ``cancelled``, ``unavailable``, ...); ``limit`` names the limit hit, if any.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import msgspec

_encoder = msgspec.json.Encoder()
_LIMITS = {"timeout": "timeout_s", "output_cap": "max_output_bytes", "busy": "max_queue",
           "rate_limited": "rate"}


class AuditLog:
    def __init__(self, target: str) -> None:
        self._own = target != "-"
        # Open for the daemon's lifetime; close() ends it.
        self._stream: TextIO = (open(target, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
                                if self._own else sys.stderr)

    def hook(self, event: dict[str, Any]) -> None:
        """A ``Daemon.call_hooks`` entry."""
        self.write(event.get("principal"), event.get("requested") or event["tool"], event.get("plugin"),
                   event.get("argument_bytes"), event["outcome"], event.get("duration_s", 0.0))

    def write(self, principal: str | None, tool: str, plugin: str | None, argument_bytes: int | None,
              outcome: str, duration_s: float) -> None:
        record: dict[str, Any] = {
            "ts": round(time.time(), 3), "event": "tool_call", "principal": principal or "local", "tool": tool,
            "plugin": plugin, "argument_bytes": argument_bytes, "outcome": outcome,
            "duration_ms": round(duration_s * 1000, 3),
        }
        limit = _LIMITS.get(outcome)
        if limit is not None:
            record["limit"] = limit
        try:
            self._stream.write(_encoder.encode(record).decode() + "\n")
            if not self._own:
                self._stream.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self._own:
            self._stream.close()
