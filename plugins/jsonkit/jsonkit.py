"""jsonkit: query, validate, format, diff, flatten and unflatten JSON documents.

Paths come in two forms, accepted by every tool that takes one:

* JSON Pointer (RFC 6901): ``/users/0/name``; ``""`` is the whole document; ``~1`` is ``/`` and
  ``~0`` is ``~`` inside a key; ``-`` names the (non-existent) element after an array's end. The
  URI-fragment form ``#/users/0`` is accepted too.
* Dotted/bracket paths: ``users[0].name``, ``$.users[*].email``, ``["key.with.dots"]``,
  ``items[-1]``. A leading ``$`` is optional; ``*`` (as ``.*`` or ``[*]``) matches every member
  of an object or every element of an array; ``[n]`` indexes arrays (negative from the end);
  quoted keys use JSON string syntax (double quotes) or single quotes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

import msgspec

from sandbox import ToolError, tool

READ_ONLY = {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}

MAX_DOC_BYTES = 4_000_000
MAX_PATH_CHARS = 2000
MAX_DEPTH = 200
MAX_ARRAY_INDEX = 100_000
MAX_ENTRIES = 100_000

# -- loading -------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is too large for a double")
    return value


def _load(text: str, what: str = "document") -> Any:
    if len(text) > MAX_DOC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_DOC_BYTES:
        raise ToolError(f"{what} is too large; the limit is {MAX_DOC_BYTES:,} bytes")
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float)
    except json.JSONDecodeError as exc:
        raise ToolError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:
        raise ToolError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ToolError(f"{what} is nested too deeply") from None
    if _depth(value) > MAX_DEPTH:
        raise ToolError(f"{what} is nested more than {MAX_DEPTH} levels deep")
    return value


def _depth(value: Any) -> int:
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in node)
    return deepest


def _wire_safe(value: Any) -> Any:
    """Integers beyond 64 bits cannot cross the worker channel: give them as floats (or strings)."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return value
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return value
        try:
            return float(value)
        except OverflowError:
            return str(value)
    if isinstance(value, dict):
        return {k: _wire_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire_safe(v) for v in value]
    return value


# -- paths -------------------------------------------------------------------------------------

#: A path segment: ("key", name), ("index", n), ("append",) for a pointer's "-", or ("wild",).
Segment = tuple


def _parse_pointer(path: str) -> list[Segment]:
    if path.startswith("#"):
        from urllib.parse import unquote

        path = unquote(path[1:])
    if path == "":
        return []
    if not path.startswith("/"):
        raise ToolError(f"JSON Pointer {path!r} must start with '/'")
    segments: list[Segment] = []
    for raw in path[1:].split("/"):
        if re.search(r"~(?![01])", raw):
            raise ToolError(f"JSON Pointer segment {raw!r} has a '~' not followed by 0 or 1")
        key = raw.replace("~1", "/").replace("~0", "~")
        segments.append(("ptr", key))
    return segments


_BARE = re.compile(r"[^.\[\]]+")


def _parse_dotted(path: str) -> list[Segment]:
    text = path.strip()
    i = 0
    segments: list[Segment] = []
    if text.startswith("$"):
        i = 1
    n = len(text)
    expect_name = i == 0  # a bare name may start the path
    while i < n:
        ch = text[i]
        if ch == ".":
            if i + 1 < n and text[i + 1] == ".":
                raise ToolError(f"recursive descent '..' is not supported (at {i} in {path!r})")
            i += 1
            m = _BARE.match(text, i)
            if not m:
                raise ToolError(f"expected a name after '.' at position {i} in {path!r}")
            name = m.group(0).strip()
            segments.append(("wild",) if name == "*" else ("key", name))
            i = m.end()
        elif ch == "[":
            close = _bracket_end(text, i, path)
            inner = text[i + 1 : close].strip()
            i = close + 1
            if inner == "*":
                segments.append(("wild",))
            elif re.fullmatch(r"-?\d+", inner):
                segments.append(("index", int(inner)))
            elif inner[:1] == '"':
                try:
                    key = json.loads(inner)
                except ValueError:
                    raise ToolError(f"bad quoted key {inner} in {path!r}") from None
                if not isinstance(key, str):
                    raise ToolError(f"bad quoted key {inner} in {path!r}")
                segments.append(("key", key))
            elif inner[:1] == "'" and inner.endswith("'") and len(inner) >= 2:
                segments.append(("key", re.sub(r"\\(.)", r"\1", inner[1:-1])))
            else:
                raise ToolError(f"inside [] use an index, *, or a quoted key, not {inner!r} (in {path!r})")
        elif expect_name and i == 0:
            m = _BARE.match(text, i)
            if not m:
                raise ToolError(f"unexpected {ch!r} at position {i} in {path!r}")
            name = m.group(0).strip()
            segments.append(("wild",) if name == "*" else ("key", name))
            i = m.end()
        else:
            raise ToolError(f"unexpected {ch!r} at position {i} in {path!r}; separate names with '.'")
        expect_name = False
    return segments


def _bracket_end(text: str, start: int, path: str) -> int:
    i = start + 1
    quote = None
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "]":
            return i
        i += 1
    raise ToolError(f"unclosed '[' at position {start} in {path!r}")


def parse_path(path: str) -> list[Segment]:
    """Segments of a JSON Pointer (starts with '/' or '#', or is empty) or a dotted/bracket path."""
    if len(path) > MAX_PATH_CHARS:
        raise ToolError(f"path is too long; the limit is {MAX_PATH_CHARS} characters")
    if path == "" or path.startswith(("/", "#")):
        return _parse_pointer(path)
    if path.strip() == "$":
        return []
    return _parse_dotted(path)


def pointer_of(parts: list[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def dotted_of(parts: list[str | int]) -> str:
    out = []
    for p in parts:
        if isinstance(p, int):
            out.append(f"[{p}]")
        elif _IDENT.fullmatch(p):
            out.append(("." if out else "") + p)
        else:
            out.append("[" + json.dumps(p, ensure_ascii=False) + "]")
    return "".join(out)


def _step(node: Any, seg: Segment, parts: list[str | int]) -> list[tuple[Any, list[str | int]]]:
    kind = seg[0]
    if kind == "wild":
        if isinstance(node, dict):
            return [(v, parts + [k]) for k, v in node.items()]
        if isinstance(node, list):
            return [(v, parts + [i]) for i, v in enumerate(node)]
        return []
    if isinstance(node, dict):
        key = seg[1] if kind in ("key", "ptr") else str(seg[1])
        return [(node[key], parts + [key])] if key in node else []
    if isinstance(node, list):
        if kind == "ptr":
            raw = seg[1]
            if not re.fullmatch(r"0|[1-9]\d*", raw):
                return []  # includes "-": the element after the end never exists
            index = int(raw)
        elif kind == "key":
            if not re.fullmatch(r"-?\d+", seg[1]):
                return []
            index = int(seg[1])
        else:
            index = seg[1]
        if index < 0:
            index += len(node)
        return [(node[index], parts + [index])] if 0 <= index < len(node) else []
    return []


def resolve(document: Any, segments: list[Segment], limit: int) -> tuple[list[tuple[Any, list[str | int]]], bool]:
    current: list[tuple[Any, list[str | int]]] = [(document, [])]
    for seg in segments:
        nxt: list[tuple[Any, list[str | int]]] = []
        for node, parts in current:
            nxt.extend(_step(node, seg, parts))
            if len(nxt) > MAX_ENTRIES:
                raise ToolError(f"the path matches more than {MAX_ENTRIES:,} intermediate values")
        current = nxt
    return current[:limit], len(current) > limit


# -- tools -------------------------------------------------------------------------------------


class QueryMatch(msgspec.Struct):
    pointer: str
    path: str
    value: Any


class QueryResult(msgspec.Struct):
    count: int
    truncated: bool
    matches: list[QueryMatch]


@tool(annotations={"title": "Query JSON", **READ_ONLY})
def query(
    document: str,
    path: str,
    max_results: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=10000,
            description="Return at most this many matches (1-10000); `truncated` tells whether more were left.",
        ),
    ] = 1000,
) -> QueryResult:
    """Select values from a JSON document with a JSON Pointer (/a/0/b) or a dotted/bracket path with wildcards (a[0].b, $.users[*].email, ["odd.key"]).

    Every match is returned with its concrete location (as a JSON Pointer and as a dotted path) and
    its value; a path that selects nothing gives count 0. Array indexes may be negative (from the
    end) in dotted paths.

    Args:
        document: The JSON text to query (at most 4 MB).
        path: The path: JSON Pointer (starts with '/', or '' for the whole document) or dotted/bracket form ($ optional, * wildcard, [n] index, ["key"] quoted key).
    """
    doc = _load(document)
    segments = parse_path(path)
    found, truncated = resolve(doc, segments, max_results)
    matches = [QueryMatch(pointer_of(parts), dotted_of(parts) or "$", _wire_safe(v)) for v, parts in found]
    return QueryResult(count=len(matches), truncated=truncated, matches=matches)


class Validation(msgspec.Struct):
    valid: bool
    error: str | None
    line: int | None
    column: int | None
    type: str | None
    depth: int | None
    size_bytes: int
    duplicate_keys: list[str]


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


@tool(annotations={"title": "Validate JSON", **READ_ONLY})
def validate(text: str) -> Validation:
    """Check whether a text is valid JSON (RFC 8259); report the first error's line and column, or the top-level type, nesting depth and any duplicate object keys.

    NaN, Infinity, comments, single quotes and trailing commas are all invalid JSON.

    Args:
        text: The text to check (at most 4 MB).
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_DOC_BYTES:
        raise ToolError(f"text is too large; the limit is {MAX_DOC_BYTES:,} bytes")
    dupes: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in items:
            if k in seen and len(dupes) < 100 and k not in dupes:
                dupes.append(k)
            seen[k] = v
        return seen

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=_reject_constant, parse_float=_parse_float)
    except json.JSONDecodeError as exc:
        return Validation(False, exc.msg, exc.lineno, exc.colno, None, None, size, [])
    except ValueError as exc:
        return Validation(False, str(exc), None, None, None, None, size, [])
    except RecursionError:
        return Validation(False, "nested too deeply", None, None, None, None, size, [])
    return Validation(True, None, None, None, _type_name(value), _depth(value), size, dupes)


@tool(name="format", annotations={"title": "Pretty-print or minify JSON", **READ_ONLY})
def format_json(
    text: str,
    indent: Annotated[
        int,
        msgspec.Meta(
            ge=0, le=8, description="Spaces per nesting level (1-8), or 0 to minify onto one line without spaces."
        ),
    ] = 2,
    sort_keys: bool = False,
    ascii_only: bool = False,
) -> str:
    """Pretty-print JSON with the given indentation, or minify it (indent 0), optionally sorting object keys.

    Args:
        text: The JSON text (at most 4 MB).
        sort_keys: Sort object keys alphabetically.
        ascii_only: Escape every non-ASCII character as \\uXXXX.
    """
    doc = _load(text, "text")
    if indent == 0:
        return json.dumps(doc, separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=ascii_only)
    return json.dumps(doc, indent=indent, sort_keys=sort_keys, ensure_ascii=ascii_only)


class Change(msgspec.Struct, omit_defaults=True):
    op: Literal["add", "remove", "replace"]
    path: str
    value: Any = msgspec.UNSET
    old: Any = msgspec.UNSET


class JsonDiff(msgspec.Struct):
    equal: bool
    count: int
    truncated: bool
    changes: list[Change]


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1 and objects ignore key order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Full(Exception):
    pass


def _diff(a: Any, b: Any, parts: list[str | int], out: list[Change], limit: int) -> None:
    def emit(change: Change) -> None:
        if len(out) >= limit:
            raise _Full
        out.append(change)

    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                emit(Change("remove", pointer_of(parts + [k]), old=_wire_safe(a[k])))
        for k in a:
            if k in b:
                _diff(a[k], b[k], parts + [k], out, limit)
        for k in b:
            if k not in a:
                emit(Change("add", pointer_of(parts + [k]), value=_wire_safe(b[k])))
        return
    if isinstance(a, list) and isinstance(b, list):
        common = min(len(a), len(b))
        for i in range(common):
            _diff(a[i], b[i], parts + [i], out, limit)
        for i in range(len(a) - 1, common - 1, -1):  # highest index first keeps the patch applicable
            emit(Change("remove", pointer_of(parts + [i]), old=_wire_safe(a[i])))
        for i in range(common, len(b)):
            emit(Change("add", pointer_of(parts + [i]), value=_wire_safe(b[i])))
        return
    if not _same(a, b):
        emit(Change("replace", pointer_of(parts), value=_wire_safe(b), old=_wire_safe(a)))


@tool(annotations={"title": "Diff two JSON documents", **READ_ONLY})
def diff(
    a: str,
    b: str,
    max_changes: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=10000,
            description="Report at most this many changes (1-10000); `truncated` tells whether more were left.",
        ),
    ] = 1000,
) -> JsonDiff:
    """Compare two JSON documents structurally and list every changed location as a JSON Patch (RFC 6902) style operation.

    Each change has op (add, remove or replace), path (a JSON Pointer), value (the new value, for add
    and replace) and old (the previous value, for remove and replace). Applied in order, the changes
    turn a into b. Object key order is ignored, arrays are compared position by position, and 1
    equals 1.0 but not true.

    Args:
        a: The original JSON text (at most 4 MB).
        b: The new JSON text (at most 4 MB).
    """
    doc_a = _load(a, "a")
    doc_b = _load(b, "b")
    changes: list[Change] = []
    truncated = False
    try:
        _diff(doc_a, doc_b, [], changes, max_changes)
    except _Full:
        truncated = True
    return JsonDiff(equal=not changes, count=len(changes), truncated=truncated, changes=changes)


class Flattened(msgspec.Struct):
    count: int
    entries: dict[str, Any]


@tool(annotations={"title": "Flatten JSON", **READ_ONLY})
def flatten(document: str, style: Literal["path", "pointer"] = "path") -> Flattened:
    """Flatten a nested JSON document into one object mapping each leaf's path to its value, e.g. {"a": {"b": [1, 2]}} -> {"a.b[0]": 1, "a.b[1]": 2}.

    Leaves are scalars, empty objects and empty arrays. Keys that are not simple identifiers are
    quoted (["a.b"]), so every path can be fed back to json_query or json_unflatten.

    Args:
        document: The JSON text to flatten (at most 4 MB and 100000 leaves).
        style: Path style for the keys: "path" (a.b[0]) or "pointer" (/a/b/0).
    """
    doc = _load(document)
    render = dotted_of if style == "path" else pointer_of
    entries: dict[str, Any] = {}
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        node, parts = stack.pop()
        if isinstance(node, dict) and node:
            stack.extend((v, parts + [k]) for k, v in reversed(list(node.items())))
        elif isinstance(node, list) and node:
            stack.extend((v, parts + [i]) for i, v in reversed(list(enumerate(node))))
        else:
            if len(entries) >= MAX_ENTRIES:
                raise ToolError(f"the document has more than {MAX_ENTRIES:,} leaves")
            entries[render(parts)] = _wire_safe(node)
    return Flattened(count=len(entries), entries=entries)


class Unflattened(msgspec.Struct):
    document: Any


def _concrete(path: str, style: str) -> list[Segment]:
    if style == "pointer" or (style == "auto" and (path == "" or path.startswith(("/", "#")))):
        segments = []
        for seg in _parse_pointer(path if path.startswith(("/", "#")) or path == "" else "/" + path):
            raw = seg[1]
            if raw == "-":
                segments.append(("append",))
            elif re.fullmatch(r"0|[1-9]\d*", raw):
                segments.append(("index", int(raw)))
            else:
                segments.append(("key", raw))
        return segments
    segments = _parse_dotted(path) if path.strip() not in ("", "$") else []
    for seg in segments:
        if seg[0] == "wild":
            raise ToolError(f"path {path!r}: wildcards cannot be used to build a document")
        if seg[0] == "index" and seg[1] < 0:
            raise ToolError(f"path {path!r}: negative indexes cannot be used to build a document")
    return segments


_MISSING = object()


@tool(annotations={"title": "Unflatten JSON", **READ_ONLY})
def unflatten(
    entries: dict[str, Any] | str,
    style: Literal["auto", "path", "pointer"] = "auto",
) -> Unflattened:
    """Rebuild a nested JSON document from an object that maps paths to values (the inverse of json_flatten).

    In dotted paths, [n] creates arrays and names create objects. In JSON Pointers, all-digit
    segments create arrays and "-" appends. Missing array positions are filled with null; a path
    that conflicts with an earlier one (e.g. "a" = 1 and then "a.b" = 2) is an error.

    Args:
        entries: The path -> value object, or its JSON text (at most 100000 entries).
        style: How to read the keys: "path" (a.b[0]), "pointer" (/a/b/0), or "auto" (a key starting with '/' is a pointer).
    """
    if isinstance(entries, str):
        loaded = _load(entries, "entries")
        if not isinstance(loaded, dict):
            raise ToolError("entries must be a JSON object mapping paths to values")
        entries = loaded
    if len(entries) > MAX_ENTRIES:
        raise ToolError(f"too many entries; the limit is {MAX_ENTRIES:,}")
    root: Any = _MISSING
    for path, value in entries.items():
        segments = _concrete(path, style)
        if not segments:
            if len(entries) != 1:
                raise ToolError("the root path ('' or '$') can only be used when it is the only entry")
            root = value
            continue
        if root is _MISSING:
            root = [] if segments[0][0] in ("index", "append") else {}
        parent = root
        for depth, seg in enumerate(segments):
            last = depth == len(segments) - 1
            nxt = None if last else ([] if segments[depth + 1][0] in ("index", "append") else {})
            parent = _put(parent, seg, value if last else nxt, last, path)
    return Unflattened(document=_wire_safe(None if root is _MISSING else root))


def _conflict(path: str, existing: Any, new: Any, last: bool) -> ToolError:
    def a(kind: str) -> str:
        return ("an " if kind[0] in "aeiou" else "a ") + kind

    need = "a value" if last else a(_type_name(new))
    return ToolError(
        f"path {path!r} conflicts with another entry: {a(_type_name(existing))} is already there, {need} is needed"
    )


def _put(container: Any, seg: Segment, new: Any, last: bool, path: str) -> Any:
    """Store ``new`` under ``seg`` (or reuse an existing container there); return what is stored."""
    kind = seg[0]
    if kind == "key":
        if not isinstance(container, dict):
            raise ToolError(f"path {path!r}: cannot use key {seg[1]!r} on an array or a value")
        key = seg[1]
        if key in container:
            existing = container[key]
            if last or not isinstance(existing, type(new)):
                raise _conflict(path, existing, new, last)
            return existing
        container[key] = new
        return new
    if not isinstance(container, list):
        raise ToolError(f"path {path!r}: cannot use an array index on an object or a value")
    index = len(container) if kind == "append" else seg[1]
    if index > MAX_ARRAY_INDEX:
        raise ToolError(f"path {path!r}: array index above {MAX_ARRAY_INDEX:,}")
    if index < len(container) and container[index] is not None:
        existing = container[index]
        if last or not isinstance(existing, type(new)):
            raise _conflict(path, existing, new, last)
        return existing
    container.extend([None] * (index + 1 - len(container)))
    container[index] = new
    return new
