"""Checking tool definitions a plugin declared (untrusted) and compiling their validators.

Every problem is collected, not just the first, so ``toolcell check`` can report them at once.
Validators are compiled once per tool with jsonschema-rs, offline (no remote ``$ref`` is ever
fetched) and with the linear-time regex engine (no ReDoS through a ``pattern``).

A schema is bounded as written (bytes, nodes, depth) and as it expands through ``$ref``: a few
definitions that each reference the previous one twice describe a tree of 2^n subschemas, and the
validator walks all of them for every value (``_expansion_problem``).
"""

from __future__ import annotations

import re
from urllib.parse import unquote
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
import msgspec

from sandbox.wire import ToolSpec

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TCHAR = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_DIALECTS = {
    None: jsonschema_rs.Draft202012Validator,
    "https://json-schema.org/draft/2020-12/schema": jsonschema_rs.Draft202012Validator,
    "https://json-schema.org/draft/2020-12/schema#": jsonschema_rs.Draft202012Validator,
    "http://json-schema.org/draft-07/schema#": jsonschema_rs.Draft7Validator,
    "http://json-schema.org/draft-07/schema": jsonschema_rs.Draft7Validator,
}
MAX_SCHEMA_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 48
MAX_SCHEMA_NODES = 20_000
#: Nodes a schema may have with every ``$ref`` inlined: no more than one written out in full may have.
MAX_SCHEMA_EXPANSION = MAX_SCHEMA_NODES
#: What a recursion nested inside another recursion is charged per level of the value (its depth).
_RECURSION_DEPTH = 64
MAX_DESCRIPTION = 16 * 1024
_REGEX = jsonschema_rs.RegexOptions(size_limit=1 << 20, dfa_size_limit=1 << 20)
_ANNOTATION_BOOLS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
_encoder = msgspec.json.Encoder()
MAX_SAFE_INT = 2**53 - 1


@dataclass
class CheckedTool:
    """A tool definition that passed every check, with its compiled validators."""

    spec: ToolSpec
    validator: Any
    output_validator: Any | None
    #: x-mcp-header annotations: header name (lowercase) -> (property, json type).
    headers: dict[str, tuple[str, str]] = field(default_factory=dict)


def _walk(node: Any, depth: int, counter: list[int], refs: list[str]) -> None:
    counter[0] += 1
    if counter[0] > MAX_SCHEMA_NODES:
        raise ValueError(f"more than {MAX_SCHEMA_NODES} schema nodes")
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(value, str):
                refs.append(value)
            _walk(value, depth + 1, counter, refs)
    elif isinstance(node, list):
        for value in node:
            _walk(value, depth + 1, counter, refs)


# -- expansion through $ref ---------------------------------------------------------------------
# The validator applies subschemas to a value node by node, without memoizing (subschema, value)
# pairs; a subschema reached by k paths at the same value node is walked k times. So:
# * acyclic: the work per value node is at most the schema's size with every $ref inlined;
# * a $ref cycle that descends into the value (a tree type) repeats once per level of the value,
#   which is fine, unless it can reach the same child value along two paths per level (then it is
#   2^depth), or it never descends (it would loop on one value);
# * a recursion reached from inside another repeats per level of each: charged _RECURSION_DEPTH.
# Subschemas are the values of applicator keywords; an edge to one is in place (same value) or
# descends to a child labelled by the key/index it applies to.

_IN_PLACE_ONE = ("not", "if", "then", "else", "contentSchema")
_IN_PLACE_LIST = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas", "dependencies")
_ANY_INDEX = ("additionalItems", "unevaluatedItems", "contains")
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_LABEL_CAP = 256
#: A child a subschema applies to: ("key", name), ("anykey", names excluded), ("index", i),
#: ("anyindex",) or ("name",) (the property names themselves). None: the same value.
_Label = tuple[Any, ...]


class _Labels:
    """An over-approximated set of child labels, to ask whether two sets can share a child."""

    __slots__ = ("keys", "anykey", "indices", "anyindex", "name")

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.anykey: frozenset[str] | None = None
        self.indices: set[int] = set()
        self.anyindex = False
        self.name = False

    def add(self, label: _Label) -> None:
        kind = label[0]
        if kind == "key":
            self.keys.add(label[1])
        elif kind == "anykey":
            self.anykey = label[1] if self.anykey is None else self.anykey & label[1]
        elif kind == "index":
            self.indices.add(label[1])
        elif kind == "anyindex":
            self.anyindex = True
        else:
            self.name = True
        self._cap()

    def merge(self, other: _Labels) -> None:
        self.keys |= other.keys
        if other.anykey is not None:
            self.anykey = other.anykey if self.anykey is None else self.anykey & other.anykey
        self.indices |= other.indices
        self.anyindex |= other.anyindex
        self.name |= other.name
        self._cap()

    def _cap(self) -> None:
        if len(self.keys) > _LABEL_CAP:
            self.keys, self.anykey = set(), frozenset()
        if len(self.indices) > _LABEL_CAP:
            self.indices, self.anyindex = set(), True

    def meets(self, other: _Labels) -> bool:
        if (self.name and other.name) or (self.anykey is not None and other.anykey is not None):
            return True
        if self.keys & other.keys or self.indices & other.indices:
            return True
        if (self.anyindex and (other.anyindex or other.indices)) or (other.anyindex and self.indices):
            return True
        if self.anykey is not None and any(k not in self.anykey for k in other.keys):
            return True
        return other.anykey is not None and any(k not in other.anykey for k in self.keys)


def _raw_size(value: Any) -> int:
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _resources(schema: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[str, list[Any]]]:
    """Each object's resource root (nearest enclosing ``$id``) and every anchor's candidates."""
    owner: dict[int, dict[str, Any]] = {}
    anchors: dict[str, list[Any]] = {}
    stack: list[tuple[Any, dict[str, Any]]] = [(schema, schema)]
    while stack:
        node, root = stack.pop()
        if isinstance(node, dict):
            ident = node.get("$id")
            if isinstance(ident, str) and not ident.startswith("#"):
                root = node
            elif isinstance(ident, str):  # draft-07 "$id": "#name" is an anchor
                anchors.setdefault(ident[1:], []).append(node)
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    anchors.setdefault(node[key], []).append(node)
            owner.setdefault(id(node), root)
            stack.extend((v, root) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, root) for v in node)
    return owner, anchors


def _pointer(base: Any, pointer: str) -> tuple[bool, Any]:
    node = base
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _subschemas(node: dict[str, Any]) -> tuple[list[tuple[Any, _Label | None]], int]:
    """The subschemas ``node`` applies (with their label), and its size besides them."""
    subs: list[tuple[Any, _Label | None]] = []
    size = 1
    for key, value in node.items():
        size += 1  # the key
        if key in _IN_PLACE_ONE:
            subs.append((value, None))
        elif key in _IN_PLACE_LIST and isinstance(value, list):
            size += 1
            subs.extend((v, None) for v in value)
        elif key in _IN_PLACE_MAP and isinstance(value, dict):
            size += 1
            for v in value.values():
                if isinstance(v, dict):
                    subs.append((v, None))
                else:
                    size += _raw_size(v)
        elif key == "properties" and isinstance(value, dict):
            size += 1
            subs.extend((v, ("key", k)) for k, v in value.items())
        elif key == "patternProperties" and isinstance(value, dict):
            size += 1
            subs.extend((v, ("anykey", frozenset())) for v in value.values())
        elif key == "additionalProperties":
            props = node.get("properties")
            subs.append((value, ("anykey", frozenset(props) if isinstance(props, dict) else frozenset())))
        elif key == "unevaluatedProperties":
            subs.append((value, ("anykey", frozenset())))
        elif key == "propertyNames":
            subs.append((value, ("name",)))
        elif key in ("items", "prefixItems") and isinstance(value, list):
            size += 1
            subs.extend((v, ("index", i)) for i, v in enumerate(value))
        elif key == "items" or key in _ANY_INDEX:
            subs.append((value, ("anyindex",)))
        else:
            size += _raw_size(value)
    return subs, size


def _expansion_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is too costly to validate through its ``$ref``s, or None.

    Linear in the schema: a graph of its subschemas (``$ref`` is an in-place edge to the target),
    its strongly connected components (Tarjan), sizes summed over them in topological order.
    """
    owner, anchors = _resources(schema)
    nodes: dict[int, dict[str, Any]] = {id(schema): schema}
    edges: dict[int, list[tuple[int, _Label | None]]] = {}
    own: dict[int, int] = {}
    todo = [schema]
    while todo:
        node = todo.pop()
        subs, size = _subschemas(node)
        for key in _REF_KEYS:
            ref = node.get(key)
            if not isinstance(ref, str) or not ref.startswith("#"):
                continue
            frag = unquote(ref[1:])
            root = owner.get(id(node), schema)
            if key == "$recursiveRef":
                targets: list[Any] = [root, schema]
            elif frag == "":
                targets = [root]
            elif frag.startswith("/"):
                found, target = _pointer(root, frag)
                targets = [target] if found else []
            else:
                targets = list(anchors.get(frag, ()))
            if not targets:
                return f"{key} {ref!r} does not resolve within the schema"
            subs.extend((t, None) for t in {id(t): t for t in targets}.values())
        out = edges[id(node)] = []
        for sub, label in subs:
            if isinstance(sub, dict):
                out.append((id(sub), label))
                if id(sub) not in nodes:
                    nodes[id(sub)] = sub
                    todo.append(sub)
            else:
                size += _raw_size(sub)
        own[id(node)] = size

    comp_of: dict[int, int] = {}
    expanded: list[int] = []
    recursive: list[bool] = []
    limit = MAX_SCHEMA_EXPANSION + 1
    for members in _components(edges, id(schema)):
        c = len(expanded)
        for m in members:
            comp_of[m] = c
        inside = set(members)
        cyclic = len(members) > 1 or any(t == members[0] for t, _ in edges[members[0]])
        if cyclic:
            problem = _recursion_problem(members, inside, edges)
            if problem is not None:
                return problem
        total, reaches = 0, cyclic
        for m in members:
            total += own[m]
            for t, _ in edges[m]:
                if t not in inside:
                    d = comp_of[t]
                    reaches |= recursive[d]
                    total += expanded[d] * (_RECURSION_DEPTH if cyclic and recursive[d] else 1)
        expanded.append(min(total, limit))
        recursive.append(reaches)
    if expanded[-1] > MAX_SCHEMA_EXPANSION:
        return f"expands to more than {MAX_SCHEMA_EXPANSION} nodes through $ref"
    return None


def _components(edges: dict[int, list[tuple[int, _Label | None]]], root: int) -> list[list[int]]:
    """Strongly connected components reachable from ``root``, successors first (Tarjan, iterative)."""
    index: dict[int, int] = {root: 0}
    low: dict[int, int] = {root: 0}
    stack, on_stack, out = [root], {root}, []
    work = [(root, 0)]
    while work:
        v, i = work[-1]
        if i < len(edges[v]):
            work[-1] = (v, i + 1)
            w = edges[v][i][0]
            if w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, 0))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
            continue
        work.pop()
        if work:
            u = work[-1][0]
            low[u] = min(low[u], low[v])
        if low[v] == index[v]:
            members: list[int] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            out.append(members)
    return out


def _recursion_problem(members: list[int], inside: set[int],
                       edges: dict[int, list[tuple[int, _Label | None]]]) -> str | None:
    """Refuse a recursion that loops on one value or can reach one child value two ways.

    Two different cycles through one subschema with the same labels would double the work per
    level of the value; where two such cycles part, their next child labels must overlap. So each
    subschema's edges into the recursion must lead to disjoint next labels (over-approximated).
    """
    first: dict[int, _Labels] = {}  # labels of the next descent, through in-place edges
    for start in members:
        if start in first:
            continue
        path: set[int] = {start}
        work = [(start, 0)]
        while work:
            v, i = work[-1]
            places = [t for t, label in edges[v] if label is None and t in inside]
            if i < len(places):
                work[-1] = (v, i + 1)
                t = places[i]
                if t in path:
                    return "a $ref cycle never descends into the value (it would loop on one value)"
                if t not in first:
                    path.add(t)
                    work.append((t, 0))
                continue
            work.pop()
            path.discard(v)
            labels = _Labels()
            for t, label in edges[v]:
                if t in inside:
                    if label is None:
                        labels.merge(first[t])
                    else:
                        labels.add(label)
            first[v] = labels
    for v in members:
        seen = _Labels()
        for t, label in edges[v]:
            if t not in inside:
                continue
            if label is None:
                nxt = first[t]
            else:
                nxt = _Labels()
                nxt.add(label)
            if seen.meets(nxt):
                return ("a recursive $ref reaches the same part of the value along two paths "
                        "(validation would double with every level)")
            seen.merge(nxt)
    return None


def compile_schema(schema: Any, where: str, problems: list[str]) -> Any | None:
    """Compile ``schema`` under its declared dialect, or record why it cannot be used."""
    if not isinstance(schema, dict):
        problems.append(f"{where}: must be a JSON object, got {type(schema).__name__}")
        return None
    try:
        size = len(_encoder.encode(schema))
    except (TypeError, ValueError, RecursionError) as exc:
        problems.append(f"{where}: not JSON-encodable ({exc})")
        return None
    if size > MAX_SCHEMA_BYTES:
        problems.append(f"{where}: {size} bytes exceeds the {MAX_SCHEMA_BYTES}-byte cap")
        return None
    refs: list[str] = []
    try:
        _walk(schema, 0, [0], refs)
    except (ValueError, RecursionError) as exc:
        problems.append(f"{where}: {exc}")
        return None
    remote = [r for r in refs if not r.startswith("#")]
    if remote:
        problems.append(f"{where}: remote $ref not allowed ({', '.join(sorted(set(remote))[:3])})")
        return None
    if refs:
        expansion = _expansion_problem(schema)
        if expansion is not None:
            problems.append(f"{where}: {expansion}")
            return None
    dialect = schema.get("$schema")
    cls = _DIALECTS.get(dialect) if (dialect is None or isinstance(dialect, str)) else None
    if cls is None:
        problems.append(f"{where}: unsupported $schema {dialect!r} (use JSON Schema 2020-12 or draft-07)")
        return None
    try:
        return cls(schema, offline=True, pattern_options=_REGEX, validate_formats=False)
    except (jsonschema_rs.ValidationError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problems.append(f"{where}: does not compile: {first}")
        return None


def check_param_headers(schema: dict[str, Any], where: str, problems: list[str]) -> dict[str, tuple[str, str]]:
    """Enforce the x-mcp-header rules (each problem appended to ``problems``); return the header map,
    lowercased header name -> (property, JSON type). Also the bench's check of a server's schemas."""
    headers: dict[str, tuple[str, str]] = {}
    props = schema.get("properties")
    if isinstance(props, dict):
        for prop, sub in props.items():
            if not isinstance(sub, dict) or "x-mcp-header" not in sub:
                continue
            value = sub["x-mcp-header"]
            if not isinstance(value, str) or not value or not _TCHAR.match(value):
                problems.append(f"{where}.properties.{prop}: x-mcp-header must be a non-empty RFC 9110 token")
                continue
            kind = sub.get("type")
            if kind not in ("string", "integer", "boolean"):
                problems.append(f"{where}.properties.{prop}: x-mcp-header only on string, integer or boolean properties")
                continue
            if kind == "integer":
                lo, hi = sub.get("minimum"), sub.get("maximum")
                if not (isinstance(lo, int) and isinstance(hi, int) and -MAX_SAFE_INT <= lo and hi <= MAX_SAFE_INT):
                    problems.append(f"{where}.properties.{prop}: integer x-mcp-header needs minimum/maximum within ±(2^53-1)")
                    continue
            key = value.lower()
            if key in headers:
                problems.append(f"{where}: x-mcp-header {value!r} is used twice")
                continue
            headers[key] = (prop, kind)
    # Annotations anywhere else (under items, composition, $defs) are not reachable by properties alone.
    nested: list[str] = []

    def find(node: Any, path: str, reachable: bool) -> None:
        if isinstance(node, dict):
            if "x-mcp-header" in node and not reachable:
                nested.append(path)
            for k, v in node.items():
                if k == "properties" and isinstance(v, dict) and reachable and path == "":
                    for pk, pv in v.items():
                        if isinstance(pv, dict):
                            for k2, v2 in pv.items():
                                find(v2, f"/properties/{pk}/{k2}", False)
                elif k != "x-mcp-header":
                    find(v, f"{path}/{k}", False)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                find(v, f"{path}/{i}", False)

    find(schema, "", True)
    for path in nested:
        problems.append(f"{where}{path}: x-mcp-header is only allowed on top-level properties")
    return headers


def _check_icons(icons: Any, where: str, problems: list[str]) -> None:
    if not isinstance(icons, list):
        problems.append(f"{where}: must be a list")
        return
    for i, icon in enumerate(icons):
        if not isinstance(icon, dict) or not isinstance(icon.get("src"), str):
            problems.append(f"{where}[{i}]: needs a string 'src'")
            continue
        if not icon["src"].startswith(("https:", "data:")):
            problems.append(f"{where}[{i}].src: only https: and data: URIs are allowed")
        if "theme" in icon and icon["theme"] not in ("light", "dark"):
            problems.append(f"{where}[{i}].theme: must be 'light' or 'dark'")
        sizes = icon.get("sizes")
        if sizes is not None and not (isinstance(sizes, list) and all(isinstance(s, str) for s in sizes)):
            problems.append(f"{where}[{i}].sizes: must be a list of strings")


def check_tool(spec: ToolSpec, public_name: str) -> tuple[CheckedTool | None, list[str]]:
    """Check one definition; returns the compiled tool, or None with every problem found."""
    where = f"tool {public_name!r}"
    problems: list[str] = []
    if not TOOL_NAME.match(public_name):
        problems.append(f"{where}: name must be 1-64 characters of [A-Za-z0-9_.-]")
    if len(spec.description) > MAX_DESCRIPTION:
        problems.append(f"{where}: description longer than {MAX_DESCRIPTION} characters")
    if spec.title is not None and (not isinstance(spec.title, str) or len(spec.title) > 256):
        problems.append(f"{where}: title must be a string of at most 256 characters")
    schema = spec.input_schema
    validator = compile_schema(schema, f"{where} inputSchema", problems)
    headers: dict[str, tuple[str, str]] = {}
    if isinstance(schema, dict):
        if schema.get("type") != "object":
            problems.append(f"{where} inputSchema: the root must have \"type\": \"object\"")
        headers = check_param_headers(schema, f"{where} inputSchema", problems)
    output_validator = None
    if spec.output_schema is not None:
        output_validator = compile_schema(spec.output_schema, f"{where} outputSchema", problems)
        if isinstance(spec.output_schema, dict) and spec.output_schema.get("type") != "object":
            problems.append(f"{where} outputSchema: the root must have \"type\": \"object\"")
    if spec.annotations is not None:
        for key in _ANNOTATION_BOOLS:
            if key in spec.annotations and not isinstance(spec.annotations[key], bool):
                problems.append(f"{where} annotations.{key}: must be a boolean")
        if "title" in spec.annotations and not isinstance(spec.annotations["title"], str):
            problems.append(f"{where} annotations.title: must be a string")
    if spec.icons is not None:
        _check_icons(spec.icons, f"{where} icons", problems)
    if spec.task_support not in ("forbidden", "optional", "required"):
        problems.append(f"{where}: task_support must be forbidden, optional or required")
    if spec.task_after_ms is not None and not 0 <= spec.task_after_ms <= 3_600_000:
        problems.append(f"{where}: task_after_ms must be between 0 and 3600000")
    if problems:
        return None, problems
    return CheckedTool(spec, validator, output_validator, headers), []


def describe_validation_error(validator: Any, instance: Any) -> str | None:
    """None if ``instance`` is valid, else one sentence naming the offending field(s)."""
    if validator.is_valid(instance):
        return None
    parts: list[str] = []
    for err in validator.iter_errors(instance):
        path = "/".join(str(p) for p in err.instance_path)
        parts.append(f"{path}: {err.message}" if path else err.message)
        if len(parts) == 5:
            break
    return "; ".join(parts)
