"""Where each key of a TOML document is: ``(line, column)`` by key path, to point at a problem.

tomllib decodes TOML but forgets where things were; a person fixing a manifest or config wants
``file:line:column``. This scanner walks source that tomllib has already accepted and records the
position of every key (``("limits", "timeout_s")``), table header, array-of-tables entry
(``("http", "tokens", 0)``) and array item (``("permissions", "read", 1)``). It never decides
whether the TOML is valid -- tomllib did -- and on anything it does not follow it stops with what it
has: a position is a help, never a requirement.
"""

from __future__ import annotations

import bisect
import json
import re

Key = tuple[str | int, ...]
Position = tuple[int, int]

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_SCALAR_END = re.compile(r"[,\]}\n#]")


class _Scanner:
    def __init__(self, source: str) -> None:
        self.s = source
        self.i = 0
        self.found: dict[Key, Position] = {}
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
        self._tables_seen: dict[Key, int] = {}

    def position(self, offset: int) -> Position:
        line = bisect.bisect_right(self._line_starts, offset)
        return line, offset - self._line_starts[line - 1] + 1

    def record(self, key: Key, offset: int) -> None:
        self.found.setdefault(key, self.position(offset))

    def skip_space(self, newlines: bool) -> None:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\r" or (newlines and c == "\n"):
                self.i += 1
            elif c == "#" and newlines:
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            else:
                return

    def key_part(self) -> str:
        s, i = self.s, self.i
        if s.startswith('"', i):
            end = i + 1
            while end < len(s) and s[end] != '"':
                end += 2 if s[end] == "\\" else 1
            self.i = end + 1
            return str(json.loads(s[i:end + 1]))
        if s.startswith("'", i):
            end = s.index("'", i + 1)
            self.i = end + 1
            return s[i + 1:end]
        m = _BARE.match(s, i)
        if m is None:
            raise ValueError("not a key")
        self.i = m.end()
        return m.group()

    def dotted_key(self) -> tuple[list[str], int]:
        start = self.i
        parts = [self.key_part()]
        while True:
            self.skip_space(False)
            if self.s.startswith(".", self.i):
                self.i += 1
                self.skip_space(False)
                parts.append(self.key_part())
            else:
                return parts, start

    def document(self) -> None:
        table: Key = ()
        while True:
            self.skip_space(True)
            if self.i >= len(self.s):
                return
            if self.s.startswith("[[", self.i):
                start = self.i
                self.i += 2
                self.skip_space(False)
                parts, _ = self.dotted_key()
                self.i = self.s.index("]]", self.i) + 2
                index = self._tables_seen.get(tuple(parts), -1) + 1
                self._tables_seen[tuple(parts)] = index
                table = (*parts, index)
                for n in range(1, len(parts) + 1):  # [[a.b]] defines a too
                    self.record(tuple(parts[:n]), start)
                self.record(table, start)
            elif self.s.startswith("[", self.i):
                start = self.i
                self.i += 1
                self.skip_space(False)
                parts, _ = self.dotted_key()
                self.i = self.s.index("]", self.i) + 1
                table = tuple(parts)
                for n in range(1, len(parts) + 1):  # [a.b] defines a too
                    self.record(table[:n], start)
            else:
                self.key_value(table)

    def key_value(self, table: Key) -> None:
        parts, start = self.dotted_key()
        key = (*table, *parts)
        for n in range(len(table) + 1, len(key) + 1):
            self.record(key[:n], start)
        self.skip_space(False)
        if not self.s.startswith("=", self.i):
            raise ValueError("expected =")
        self.i += 1
        self.skip_space(False)
        self.value(key)

    def value(self, key: Key) -> None:
        s = self.s
        if s.startswith("{", self.i):
            self.i += 1
            while True:
                self.skip_space(True)
                if s.startswith("}", self.i):
                    self.i += 1
                    return
                if s.startswith(",", self.i):
                    self.i += 1
                    continue
                self.key_value(key)
        elif s.startswith("[", self.i):
            self.i += 1
            index = 0
            while True:
                self.skip_space(True)
                if s.startswith("]", self.i):
                    self.i += 1
                    return
                if s.startswith(",", self.i):
                    self.i += 1
                    index += 1
                    continue
                self.record((*key, index), self.i)
                self.value((*key, index))
        elif s.startswith(('"""', "'''"), self.i):
            quote = s[self.i:self.i + 3]
            end = self.i + 3
            while True:
                end = s.index(quote, end)
                if quote == '"""' and _escaped(s, end):
                    end += 1
                    continue
                break
            self.i = end + 3
            while s.startswith(quote[0], self.i):  # up to two quotes may close the content
                self.i += 1
        elif s.startswith('"', self.i):
            end = self.i + 1
            while s[end] != '"':
                end += 2 if s[end] == "\\" else 1
            self.i = end + 1
        elif s.startswith("'", self.i):
            self.i = s.index("'", self.i + 1) + 1
        else:
            m = _SCALAR_END.search(s, self.i)
            end = len(s) if m is None else m.start()
            if end == self.i:
                raise ValueError("empty value")
            self.i = end


def _escaped(s: str, at: int) -> bool:
    backslashes = 0
    while at - backslashes - 1 >= 0 and s[at - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


def key_positions(source: str) -> dict[Key, Position]:
    """Every key path of ``source`` (TOML that tomllib accepted) with its 1-based line and column."""
    scanner = _Scanner(source)
    try:
        scanner.document()
    except (ValueError, IndexError, RecursionError):
        pass  # what was found so far is still right
    return scanner.found


def locate(positions: dict[Key, Position], key: Key) -> Position | None:
    """The position of ``key``, else of its nearest enclosing key or table that has one."""
    for n in range(len(key), 0, -1):
        found = positions.get(key[:n])
        if found is not None:
            return found
    return None
