"""stdio framing, sans-io: newline-delimited messages out of a byte stream cut anywhere.

``LineSplitter.feed(chunk)`` returns what the bytes so far complete, in order: each message line
(a trailing CR removed, blank lines skipped) or ``TOO_LONG`` for a line over ``max_line_bytes``,
which is then skipped to its end. A line of exactly ``max_line_bytes`` followed by CRLF is a
message wherever the CR and the LF fall between reads. ``end()`` returns what is left at EOF.
The result never depends on how the stream was cut (a property test checks it).
"""

from __future__ import annotations

from typing import Final, Union


class _TooLong:
    __slots__ = ()

    def __repr__(self) -> str:
        return "TOO_LONG"


#: Stands in the output for a line over the limit (its bytes are dropped).
TOO_LONG: Final = _TooLong()

Item = Union[bytes, _TooLong]


class LineSplitter:
    __slots__ = ("max_line", "_buf", "_skipping")

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line = max_line_bytes
        self._buf = bytearray()
        self._skipping = False

    def _line(self, line: bytes | bytearray, out: list[Item]) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line or line.isspace():  # blank (``isspace``: the bytes ``strip`` removes, without a copy)
            return
        out.append(TOO_LONG if len(line) > self.max_line else bytes(line))

    def feed(self, chunk: bytes | bytearray) -> list[Item]:
        out: list[Item] = []
        start = 0
        end = chunk.find(b"\n")
        while end >= 0:
            if self._skipping:
                self._skipping = False
            elif self._buf:
                self._buf += chunk[start:end]
                self._line(self._buf, out)
                self._buf = bytearray()
            else:
                self._line(chunk[start:end], out)
            start = end + 1
            end = chunk.find(b"\n", start)
        if not self._skipping:
            self._buf += chunk[start:]
            # +1: a line of exactly max_line bytes may still be waiting for the LF of its CRLF.
            size = len(self._buf)
            if size > self.max_line + 1 or (size == self.max_line + 1 and not self._buf.endswith(b"\r")):
                out.append(TOO_LONG)
                self._buf = bytearray()
                self._skipping = True
        return out

    def end(self) -> list[Item]:
        """EOF: the last line, if it had no newline."""
        out: list[Item] = []
        if self._buf and not self._skipping:
            self._line(self._buf, out)
        self._buf = bytearray()
        return out
