"""Checking tool definitions a plugin declared (untrusted) and compiling their validators.

Every problem is collected, not just the first, so ``toolcell check`` can report them at once.
Validators are compiled once per tool with jsonschema-rs, offline (no remote ``$ref`` is ever
fetched) and with the linear-time regex engine (no ReDoS through a ``pattern``).
"""

from __future__ import annotations

import re
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


def _check_headers(schema: dict[str, Any], where: str, problems: list[str]) -> dict[str, tuple[str, str]]:
    """Enforce the x-mcp-header rules; return the header map."""
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
        headers = _check_headers(schema, f"{where} inputSchema", problems)
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
