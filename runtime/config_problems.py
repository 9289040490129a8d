"""Every problem of a TOML config or manifest at once, each with where it is and how to fix it.

msgspec stops at the first error it meets, and a person fixing a file wants them all in one go. So
``decode`` finds them first, each with the keys that lead to it: the bounds and choices declared on
the fields (``runtime.declared_bounds``), unknown keys (with the nearest known one), missing required
keys, and values of the wrong type (each leaf checked by msgspec itself against its field's
annotation). The values at fault are left out and the rest is decoded, so that the semantic checks
that follow see everything else (``find_all``). ``Located`` pairs a problem with its ``line:column``
in the source (``runtime.toml_positions``).

Leaving a value out must not make a problem of its own: a key that is there with a wrong value is
never reported missing, and a value whose absence its table cannot decode without (a required key)
takes its enclosing table with it, up to the nearest one that has a default or is an entry of a
table of tables -- never one item of a list (the items after it would be renumbered, and then
reported under another index): the whole list instead. A semantic check then sees the default where
the value was left out, so its sentences about a left-out key (or about a table that held one) are
not reported either: they would be about a value the file does not hold.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable
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
#: A dotted key anywhere in a sentence (``tasks.max_ttl_ms``, ``http.tokens[0].sha256``).
_DOTTED_KEY = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[[0-9]+\])+")
#: Where msgspec says its error is (``- at `$.http.tokens[0]```).
_MSGSPEC_AT = re.compile(r" - at `\$((?:\.[^.\[`]+|\[[0-9]+\])*)`")


class Problem(NamedTuple):
    """A problem of the decoded data: ``keys`` lead to the value at fault (for a missing key: to the
    table that lacks it), which is left out so that the rest decodes."""

    keys: Key
    message: str


class Located(NamedTuple):
    """A problem and where it is in the file (None: nowhere in particular, e.g. a missing key)."""

    position: Position | None
    message: str

    def render(self, path: str) -> str:
        """``path:line:column: message`` (``path: message`` without a position)."""
        if self.position is None:
            return f"{path}: {self.message}"
        return f"{path}:{self.position[0]}:{self.position[1]}: {self.message}"


def find_all(raw: dict[str, Any], struct: type[T], check: Callable[[T], list[str]]) -> tuple[T | None, list[Problem | str]]:
    """``raw`` as ``struct`` and every problem of it: decoding's, then the sentences of ``check`` (the
    semantic checks) on what decoded -- less those about a value that was left out for its problem."""
    value, problems, left_out = _decode(raw, struct)
    found: list[Problem | str] = list(problems)
    if value is not None:
        found += [sentence for sentence in check(value) if not _about_left_out(sentence, left_out)]
    return value, found


def _decode(raw: dict[str, Any], struct: type[T]) -> tuple[T | None, list[Problem], list[Key]]:
    violated = declared_bounds.violations(raw, struct)
    problems = [Problem(keys, message) for keys, message in violated]
    _check_struct(raw, struct, (), problems, {keys for keys, _message in violated})
    left_out = [_droppable(raw, struct, p.keys) for p in problems]
    if any(keys is None for keys in left_out):
        return None, problems, []  # a required key of the top table itself: nothing to decode without it
    kept = [keys for keys in left_out if keys is not None]
    cleaned = declared_bounds.without(raw, [(keys, "") for keys in kept])
    try:
        return msgspec.convert(cleaned, struct), problems, kept
    except msgspec.ValidationError as exc:
        if not problems:  # what the walk above did not foresee, in msgspec's words
            problems.append(_unforeseen(str(exc)))
        return None, problems, kept


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


def _about_left_out(sentence: str, left_out: list[Key]) -> bool:
    """Whether ``sentence`` names a key whose value was left out, one under it, or a table holding it
    (``secrets.B: give one of env, ...`` when ``secrets.B.env`` was left out for its type)."""
    lead = _LEADING_KEY.match(sentence)
    named = [lead.group(1)] if lead else []
    named += [m.group() for m in _DOTTED_KEY.finditer(sentence)]
    for text in named:
        keys = _keys_of(text)
        if any(keys[:len(out)] == out or out[:len(keys)] == keys for out in left_out if out):
            return True
    return False


def _keys_of(dotted: str) -> Key:
    """``http.tokens[0].sha256`` as ``("http", "tokens", 0, "sha256")``."""
    keys: list[str | int] = []
    for part in dotted.split("."):
        name, _, indices = part.partition("[")
        if name:
            keys.append(name)
        if indices:
            keys += [int(i) for i in indices.rstrip("]").split("][") if i.isdigit()]
    return tuple(keys)


def _unforeseen(error: str) -> Problem:
    """msgspec's own error as a problem, at the keys it names."""
    m = _MSGSPEC_AT.search(error)
    keys = _keys_of(m.group(1).lstrip(".")) if m else ()
    return Problem(keys, f"{_dotted(keys)}: {_reword(error)}" if keys else _reword(error))


def _droppable(raw: Any, struct: type[msgspec.Struct], keys: Key) -> Key | None:
    """What to leave out for a problem at ``keys`` so that the rest still decodes: ``keys`` itself, or
    the nearest enclosing value that may be absent (a key with a default, an entry of a table of
    tables, a key the table does not know), never one item of a list (its whole list instead).
    None: only the whole document would do."""
    info: mi.Type = mi.type_info(struct)
    value: Any = raw
    may_be_absent: list[bool] = []
    for key in keys:
        info = _member_for(info, value)
        if isinstance(info, mi.StructType):
            field = next((f for f in info.fields if f.encode_name == key), None)
            may_be_absent.append(field is None or not field.required)
            info = field.type if field is not None else mi.AnyType()
        elif isinstance(info, mi.DictType):
            may_be_absent.append(True)
            info = info.value_type
        elif isinstance(info, (mi.ListType, mi.VarTupleType)):
            may_be_absent.append(False)
            info = info.item_type
        else:
            may_be_absent.append(not isinstance(value, list))
            info = mi.AnyType()
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
            value = value[key]
        else:
            value = None
    for n in range(len(keys), 0, -1):
        if may_be_absent[n - 1]:
            return keys[:n]
    return None


def _member_for(info: mi.Type, value: Any) -> mi.Type:
    """The member of a union that a table or a list would be decoded as (else the union itself)."""
    if not isinstance(info, mi.UnionType):
        return info
    for member in info.types:
        if isinstance(value, dict) and isinstance(member, (mi.StructType, mi.DictType)):
            return member
        if isinstance(value, list) and isinstance(member, (mi.ListType, mi.VarTupleType)):
            return member
    return info


def _check_struct(value: Any, struct: type[msgspec.Struct], keys: Key, out: list[Problem],
                  reported: set[Key]) -> None:
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
            _check(value[field.encode_name], field.type, (*keys, field.encode_name), out, reported)
        elif field.required:
            out.append(Problem(keys, f"missing required key {_dotted((*keys, field.encode_name))!r}"))


def _check(value: Any, annotation: Any, keys: Key, out: list[Problem], reported: set[Key]) -> None:
    if keys in reported:  # out of its declared bounds: said already
        return
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
            _check_struct(value, structs[0], keys, out, reported)
            return
    elif isinstance(info, mi.StructType):
        _check_struct(value, info.cls, keys, out, reported)
        return
    elif isinstance(info, mi.DictType) and isinstance(value, dict):
        args = typing.get_args(inner)
        for key, item in value.items():
            _check(item, args[1] if len(args) == 2 else Any, (*keys, key), out, reported)
        return
    elif isinstance(info, mi.ListType) and isinstance(value, list):
        args = typing.get_args(inner)
        for i, item in enumerate(value):
            _check(item, args[0] if args else Any, (*keys, i), out, reported)
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
