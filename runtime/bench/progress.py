"""The live display on stderr: one line per segment, rewritten twice a second (rate, p50, p99,
errors so far). Shown only on a terminal, and never with ``--quiet``."""

from __future__ import annotations

import sys
from typing import TextIO

from runtime.bench.load import Loop, progress_line
from runtime.bench.report import Segment
from runtime.bench.runner import Events
from runtime.bench.targets import Live


class Display(Events):
    """Writes progress to ``stream`` (a terminal)."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.prefix = ""
        self.width = 0

    def _line(self, text: str, end: str = "") -> None:
        pad = max(0, self.width - len(text))
        self.stream.write("\r" + text + " " * pad + end)
        self.stream.flush()
        self.width = 0 if end else len(text)

    def target_ready(self, live: Live) -> None:
        info = live.server_info or {}
        who = f" ({info.get('name', '?')} {info.get('version', '')})".rstrip() if info else ""
        state = "ready" if live.problem is None else live.problem
        self._line(f"{live.spec.name}{who}: {state[:200]} [{live.ready_s:.1f} s]", "\n")

    def segment_start(self, index: int, total: int, target: str, step: str, repeat: int) -> None:
        self.prefix = f"[{index}/{total}] {target} {step} #{repeat}"
        self._line(f"{self.prefix} ...")

    def progress(self, loop: Loop, now: int) -> None:
        elapsed, ok, errors, p50, p99 = progress_line(loop, now)
        phase = "warm-up" if elapsed == 0 else f"{elapsed:4.1f} s"
        rate = ok / elapsed if elapsed > 0 else 0.0
        self._line(f"{self.prefix} {phase}  {rate:>10,.0f} calls/s  p50 {p50:8.3f} ms  "
                   f"p99 {p99:8.2f} ms  errors {errors}")

    def segment_end(self, segment: Segment) -> None:
        if segment.skipped is not None:
            self._line(f"{self.prefix} skipped: {segment.skipped[:160]}", "\n")
            return
        errors = sum(segment.errors.values())
        ended = f"  ENDED: {segment.ended_by[:120]}" if segment.ended_by else ""
        self._line(f"{self.prefix} {segment.calls_per_s:>10,.0f} calls/s  p50 {segment.latency.p50_ms:8.3f} ms  "
                   f"p99 {segment.latency.p99_ms:8.2f} ms  errors {errors}{ended}", "\n")
