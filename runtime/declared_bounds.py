"""Bounds declared on config fields, reported all at once.

Config Structs (the daemon's ``Config``, ``HttpConfig``, a manifest's ``Limits``) declare their
bounds and choices on the fields themselves, as ``Annotated[int, msgspec.Meta(ge=…, le=…)]`` and
``Literal[…]``; msgspec enforces them when it converts. msgspec stops at the first violation,
though, and a person fixing a config file wants every problem in one go, so ``problems`` walks the
raw TOML data against the same declarations first and words each violation. Nothing here knows a
particular field: a new bound is written once, on its field.

Two bounds hold for every number field, declared or not: a float is finite (TOML has ``inf`` and
``nan``; a timeout of ``nan`` fails at its first use, deep in the daemon) and an integer fits in 64
bits (TOML integers, and so Python's, are unbounded; msgspec would accept ``10**40``).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import msgspec.inspect as mi


def problems(raw: Any, struct: type[msgspec.Struct], prefix: str = "") -> list[str]:
    """Every declared bound or choice that ``raw`` (decoded TOML) violates, as readable sentences."""
    return [message for _keys, message in violations(raw, struct, prefix)]


def violations(raw: Any, struct: type[msgspec.Struct], prefix: str = "") -> list[tuple[tuple[Any, ...], str]]:
    """Like ``problems``, with where each one is in ``raw`` (the keys that lead to it)."""
    out: list[tuple[tuple[Any, ...], str]] = []
    _walk(raw, mi.type_info(struct), prefix, (), out)
    return out


def without(raw: Any, violated: list[tuple[tuple[Any, ...], str]]) -> Any:
    """A copy of ``raw`` without the values that violate their declarations (their defaults apply),
    so that the rest can still be decoded and checked, and every problem reported at once."""
    if not isinstance(raw, dict):
        return raw
    keys = [k for k, _message in violated if k]
    return _prune(raw, keys)


def _prune(node: Any, keys: list[tuple[Any, ...]]) -> Any:
    drop = {k[0] for k in keys if len(k) == 1}
    deeper: dict[Any, list[tuple[Any, ...]]] = {}
    for k in keys:
        if len(k) > 1:
            deeper.setdefault(k[0], []).append(k[1:])
    if isinstance(node, dict):
        return {key: (_prune(value, deeper[key]) if key in deeper else value)
                for key, value in node.items() if key not in drop}
    if isinstance(node, list):
        return [(_prune(value, deeper[i]) if i in deeper else value) for i, value in enumerate(node) if i not in drop]
    return node


def _walk(value: Any, info: mi.Type, path: str, keys: tuple[Any, ...], out: list[tuple[tuple[Any, ...], str]]) -> None:
    if isinstance(info, mi.StructType):
        if not isinstance(value, dict):
            return
        for field in info.fields:
            if field.encode_name in value:
                name = f"{path}.{field.encode_name}" if path else field.encode_name
                _walk(value[field.encode_name], field.type, name, keys + (field.encode_name,), out)
    elif isinstance(info, mi.UnionType):
        for member in info.types:
            if _matches(value, member):
                _walk(value, member, path, keys, out)
                return
    elif isinstance(info, mi.DictType):
        if isinstance(value, dict):
            for key, item in value.items():
                _walk(item, info.value_type, f"{path}.{key}", keys + (key,), out)
    elif isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        item_type = getattr(info, "item_type", None)
        if isinstance(value, list) and item_type is not None:
            for i, item in enumerate(value):
                _walk(item, item_type, f"{path}[{i}]", keys + (i,), out)
    elif isinstance(info, (mi.IntType, mi.FloatType)):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            problem = _out_of_bounds(value, info) or _unrepresentable(value, info)
            if problem:
                shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
                out.append((keys, f"{path} = {shown}: {problem}"))
    elif isinstance(info, mi.LiteralType):
        if value not in info.values or type(value) is not type(info.values[0]):
            choices = [str(v) for v in info.values]
            listed = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
            out.append((keys, f"{path} {value!r}: use {listed}"))


def _matches(value: Any, info: mi.Type) -> bool:
    """Whether ``value`` is of the kind ``info`` describes (to pick a union's member)."""
    if isinstance(info, mi.NoneType):
        return value is None
    if isinstance(info, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(info, mi.FloatType):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(info, (mi.StructType, mi.DictType)):
        return isinstance(value, dict)
    if isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        return isinstance(value, list)
    if isinstance(info, mi.LiteralType):
        return True
    return False


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _unrepresentable(value: float, info: mi.IntType | mi.FloatType) -> str | None:
    """What is wrong with a number no field may hold (declared bounds aside)."""
    if isinstance(info, mi.IntType):
        if isinstance(value, int) and value > _INT64_MAX:
            return f"must be at most {_INT64_MAX}"
        if isinstance(value, int) and value < _INT64_MIN:
            return f"must be at least {_INT64_MIN}"
        return None
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # an integer too large for a float
        finite = False
    return None if finite else "must be a finite number (not inf or nan)"


def _out_of_bounds(value: float, info: mi.IntType | mi.FloatType) -> str | None:
    low = info.ge if info.ge is not None else info.gt
    high = info.le if info.le is not None else info.lt
    too_low = (info.ge is not None and value < info.ge) or (info.gt is not None and value <= info.gt)
    too_high = (info.le is not None and value > info.le) or (info.lt is not None and value >= info.lt)
    if not (too_low or too_high):
        return None
    if info.ge is not None and info.le is not None:
        return f"must be between {_fmt(info.ge)} and {_fmt(info.le)}"
    words = []
    if low is not None:
        words.append(f"{'>=' if info.ge is not None else '>'} {_fmt(low)}")
    if high is not None:
        words.append(f"{'<=' if info.le is not None else '<'} {_fmt(high)}")
    return "must be " + " and ".join(words)


def _fmt(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)
