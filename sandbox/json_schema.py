"""JSON schemas generated from type hints, shaped for clients (local ``$ref``s inlined)."""

from __future__ import annotations

from typing import Any


def inline_refs(schema: Any) -> Any:
    """Inline local ``$ref``s of a msgspec-generated schema (some clients cannot follow them).

    Recursive types cannot be inlined; those keep ``$defs`` and their ``$ref``s.
    """
    if not isinstance(schema, dict):
        return schema
    defs = schema.get("$defs", {})

    def resolve(node: Any, stack: tuple[str, ...]) -> tuple[Any, bool]:
        if isinstance(node, list):
            items = [resolve(x, stack) for x in node]
            return [x for x, _ in items], any(r for _, r in items)
        if not isinstance(node, dict):
            return node, False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref[len("#/$defs/") :]
            if name in stack or name not in defs:
                return node, True
            target, recursive = resolve(defs[name], stack + (name,))
            merged = dict(target)
            for k, v in node.items():
                if k not in ("$ref", "$defs"):
                    merged[k] = resolve(v, stack)[0]
            return merged, recursive
        out: dict[str, Any] = {}
        recursive = False
        for k, v in node.items():
            if k == "$defs":
                continue
            out[k], r = resolve(v, stack)
            recursive = recursive or r
        return out, recursive

    result, recursive = resolve(schema, ())
    if recursive and defs:
        result["$defs"] = defs
    result.pop("title", None)
    if result.get("required") == []:
        del result["required"]
    return result
