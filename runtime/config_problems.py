"""Every problem of a TOML config or manifest at once, each with where it is and how to fix it.

msgspec stops at the first error it meets, and a person fixing a file wants them all in one go. So
``decode`` finds them first, each with the keys that lead to it: the bounds and choices declared on
the fields (``runtime.declared_bounds``), unknown keys (with the nearest known one), missing required
keys, and values of the wrong type (each leaf checked by msgspec itself against its field's
annotation). The values at fault are left out and the rest is decoded, so that the semantic checks
that follow see everything else. ``Located`` pairs a problem with its ``line:column`` in the source
(``runtime.toml_positions``).
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any, NamedTuple, TypeVar

import msgspec
import msgspec.inspect as mi

from runtime import declared_bounds
from runtime.toml_positions import Key, Position, key_positions, locate

T = TypeVar("T", bound=msgspec.Struct)

_EXPECTED = re.compile(r"Expected `(.+?)`, got `(.+?)`")
_KINDS = {"int": "an integer", "str": "a string", "float": "a number", "bool": "true or false", "array": "a list",
          "object": "a table", "null": "nothing"}
#: A problem sentence that begins with the dotted key it is about (``limits.timeout_s = 0: ...``).
_LEADING_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


class Problem(NamedTuple):
    keys: Key
    message: str
    #: Whether the value at ``keys`` is left out so that the rest decodes (not for a missing key).
    prune: bool = True


class Located(NamedTuple):
    """A problem and where it is in the file (None: nowhere in particular, e.g. a missing key)."""

    position: Position | None
    message: str

    def render(self, path: str) -> str:
        """``path:line:column: message`` (``path: message`` without a position)."""
        if self.position is None:
            return f"{path}: {self.message}"
        return f"{path}:{self.position[0]}:{self.position[1]}: {self.message}"


def decode(raw: dict[str, Any], struct: type[T]) -> tuple[T | None, list[Problem]]:
    """``raw`` as ``struct`` with every problem found; None when the struct cannot be made at all."""
    violated = declared_bounds.violations(raw, struct)
    problems = [Problem(keys, message) for keys, message in violated]
    pruned = declared_bounds.without(raw, violated)
    found: list[Problem] = []
    _check_struct(pruned, struct, (), found)
    problems += found
    cleaned = declared_bounds.without(pruned, [(p.keys, p.message) for p in found if p.keys and p.prune])
    try:
        return msgspec.convert(cleaned, struct), problems
    except msgspec.ValidationError as exc:
        if all(p.prune for p in found):
            problems.append(Problem((), str(exc)))  # what the walk above did not foresee, in msgspec's words
        return None, problems


def locate_all(source: str, problems: list[Problem | str]) -> list[Located]:
    """Each problem with its position in ``source``: by its keys, or (for a sentence from a semantic
    check) by the dotted key it begins with."""
    positions = key_positions(source)
    out = []
    for problem in problems:
        if isinstance(problem, Problem):
            out.append(Located(locate(positions, problem.keys) if problem.keys else None, problem.message))
            continue
        m = _LEADING_KEY.match(problem)
        keys: Key = tuple(m.group(1).split(".")) if m else ()
        out.append(Located(locate(positions, keys) if keys and keys[:1] in positions else None, problem))
    return sorted(out, key=lambda p: p.position or (0, 0))


def _dotted(keys: Key) -> str:
    text = ""
    for k in keys:
        text += f"[{k}]" if isinstance(k, int) else (f".{k}" if text else str(k))
    return text


def _check_struct(value: Any, struct: type[msgspec.Struct], keys: Key, out: list[Problem]) -> None:
    if not isinstance(value, dict):
        out.append(Problem(keys, f"{_dotted(keys)}: must be a table, not {_kind_of(value)}"))
        return
    fields = msgspec.structs.fields(struct)
    names = [f.encode_name for f in fields]
    if getattr(struct.__struct_config__, "forbid_unknown_fields", False):
        for key in value:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
                known = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {known}"
                out.append(Problem((*keys, key), f"{_dotted((*keys, key))}: unknown key ({hint})"))
    for field in fields:
        if field.encode_name in value:
            _check(value[field.encode_name], field.type, (*keys, field.encode_name), out)
        elif field.required:
            out.append(Problem(keys, f"missing required key {_dotted((*keys, field.encode_name))!r}", prune=False))


def _check(value: Any, annotation: Any, keys: Key, out: list[Problem]) -> None:
    try:
        msgspec.convert(value, annotation)
        return
    except msgspec.ValidationError as exc:
        error = str(exc)
    except (TypeError, ValueError, RecursionError, OverflowError) as exc:
        out.append(Problem(keys, f"{_dotted(keys)}: {exc}"))
        return
    inner = _unwrap(annotation)
    info = mi.type_info(inner)
    if isinstance(info, mi.UnionType):
        members = [m for m in typing.get_args(inner) if m is not type(None)]
        structs = [m for m in members if isinstance(mi.type_info(m), mi.StructType)]
        if isinstance(value, dict) and len(structs) == 1:
            _check_struct(value, structs[0], keys, out)
            return
    elif isinstance(info, mi.StructType):
        _check_struct(value, info.cls, keys, out)
        return
    elif isinstance(info, mi.DictType) and isinstance(value, dict):
        args = typing.get_args(inner)
        for key, item in value.items():
            _check(item, args[1] if len(args) == 2 else Any, (*keys, key), out)
        return
    elif isinstance(info, mi.ListType) and isinstance(value, list):
        args = typing.get_args(inner)
        for i, item in enumerate(value):
            _check(item, args[0] if args else Any, (*keys, i), out)
        return
    out.append(Problem(keys, f"{_dotted(keys)} = {_short(value)}: {_reword(error)}"))


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _reword(error: str) -> str:
    error = error.split(" - at `", 1)[0]
    m = _EXPECTED.match(error)
    if m is None:
        return error
    wanted = " or ".join(_KINDS.get(k.strip(), k.strip()) for k in m.group(1).split("|") if k.strip() != "null")
    return f"must be {wanted}, not {_KINDS.get(m.group(2), m.group(2))}"


def _kind_of(value: Any) -> str:
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a table"}
    return kinds.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
