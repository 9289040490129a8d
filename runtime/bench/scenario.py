"""What the load consists of: a weighted mix of operations, from flags or a small TOML file.

An operation is a ``tools/call`` of one tool with templated arguments and what its answer must
show, or a full ``tools/list`` walk (every page, following ``nextCursor``). The mix is drawn by
smooth weighted round-robin, so it is exact and the same on every run (weights 3 and 1 give
A A B A, A A B A, ...), not random.

    # scenario.toml
    [[call]]
    tool = "echo"
    weight = 3
    arguments = { text = "hello {{seq}}" }
    expect_text = "hello {{seq}}"          # the text content, exactly (placeholders filled in)
    # expect_contains = "hello"            # or a substring
    # expect_schema = { type = "object" }  # structuredContent checked against a JSON Schema
    # expect_error = false                 # true: the call must answer isError (measure error paths)

    [list]
    weight = 1                             # full tools/list walks in the mix
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

import jsonschema_rs
import msgspec

from runtime import plugin_files
from runtime.bench import wire


#: A scenario file larger than this is refused unread.
MAX_SCENARIO_BYTES = 1024 * 1024


class ScenarioError(ValueError):
    """The scenario (flags or file) is not usable; the message says why."""


class CallSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One ``[[call]]`` entry."""

    tool: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    weight: int = 1
    expect_text: str | None = None
    expect_contains: str | None = None
    expect_schema: dict[str, Any] | None = None
    expect_error: bool = False


class ListSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The ``[list]`` entry: full ``tools/list`` walks."""

    weight: int = 1
    max_pages: int = 1000


class Scenario(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The whole mix."""

    call: list[CallSpec] = msgspec.field(default_factory=list)
    listing: ListSpec | None = msgspec.field(default=None, name="list")

    def labels(self) -> list[str]:
        """One label per operation, in order (calls by tool name, then ``tools/list``)."""
        names = [f"call {c.tool}" for c in self.call]
        duplicates = {n for n in names if names.count(n) > 1}
        counter: dict[str, int] = {}
        out = []
        for n in names:
            if n in duplicates:
                counter[n] = counter.get(n, 0) + 1
                n = f"{n} #{counter[n]}"
            out.append(n)
        if self.listing is not None:
            out.append("tools/list walk")
        return out

    def weights(self) -> list[int]:
        """Weights of the operations, in the order of ``labels``."""
        return [c.weight for c in self.call] + ([self.listing.weight] if self.listing is not None else [])

    def without_expectations(self) -> Scenario:
        """The same mix with no content expectations (for the trivial server of the client ceiling)."""
        return Scenario(call=[CallSpec(c.tool, c.arguments, c.weight) for c in self.call], listing=self.listing)


def validate(scenario: Scenario) -> Scenario:
    """Check weights, names and expectations; compile nothing yet."""
    if not scenario.call and scenario.listing is None:
        raise ScenarioError("the scenario has no operation: give --call/--tool, --list, or a scenario file")
    for c in scenario.call:
        if not c.tool:
            raise ScenarioError("a call has an empty tool name")
        if c.weight < 0 or (scenario.listing is not None and scenario.listing.weight < 0):
            raise ScenarioError("weights must be >= 0")
        if c.expect_schema is not None:
            schema_check(c.expect_schema)
    if scenario.listing is not None and scenario.listing.max_pages < 1:
        raise ScenarioError("list.max_pages must be >= 1")
    if sum(scenario.weights()) <= 0:
        raise ScenarioError("every weight is 0: nothing to send")
    return scenario


def load_file(path: str) -> Scenario:
    """Read a scenario TOML file (unknown keys are refused, so typos fail early)."""
    try:
        # A regular file only (a FIFO would block the command for good), capped.
        raw = plugin_files.read_named(path, MAX_SCENARIO_BYTES)
    except plugin_files.PluginFileError as exc:
        raise ScenarioError(f"cannot read the scenario: {exc.reason}") from None
    if raw is None:
        raise ScenarioError(f"cannot read scenario {path}: No such file or directory")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"scenario {path} is not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise ScenarioError(f"scenario {path} is not valid TOML: nested too deeply") from None
    except ValueError as exc:  # TOMLDecodeError, or an integer of thousands of digits
        raise ScenarioError(f"scenario {path} is not valid TOML: {str(exc)[:300]}") from None
    try:
        return validate(msgspec.convert(data, Scenario))
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"scenario {path}: {exc}") from None


def parse_call_flag(spec: str) -> CallSpec:
    """``--call '[WEIGHT*]TOOL [JSON-ARGUMENTS]'``, e.g. ``--call '3*echo {"text": "hi {{seq}}"}'``."""
    head, _, rest = spec.strip().partition(" ")
    weight = 1
    if "*" in head:
        count, _, head = head.partition("*")
        try:
            weight = int(count)
        except ValueError:
            raise ScenarioError(f"--call {spec!r}: weight {count!r} is not an integer") from None
    arguments: Any = {}
    if rest.strip():
        try:
            arguments = json.loads(rest)
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"--call {spec!r}: arguments are not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ScenarioError(f"--call {spec!r}: arguments must be a JSON object")
    return CallSpec(head, arguments, weight)


def from_flags(calls: list[str], tool: str | None, arguments: str | None, list_weight: int | None,
               expect_text: str | None, expect_contains: str | None) -> Scenario:
    """The scenario the command line describes (``--tool``/``--args`` is one call of weight 1;
    ``--expect-*`` apply to every call given on the command line)."""
    specs = [parse_call_flag(c) for c in calls]
    if tool is not None:
        try:
            args = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"--args is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ScenarioError("--args must be a JSON object")
        specs.append(CallSpec(tool, args))
    if expect_text is not None or expect_contains is not None:
        specs = [msgspec.structs.replace(s, expect_text=expect_text, expect_contains=expect_contains)
                 for s in specs]
    return validate(Scenario(call=specs, listing=ListSpec(weight=list_weight) if list_weight else None))


def schema_check(schema: dict[str, Any]) -> Any:
    """A compiled validator's ``is_valid`` for an expected ``structuredContent`` schema."""
    try:
        return jsonschema_rs.validator_for(schema).is_valid
    except (ValueError, jsonschema_rs.ValidationError) as exc:
        raise ScenarioError(f"expect_schema is not a valid JSON Schema: {exc}") from None


class Mix:
    """Smooth weighted round-robin over the operations: deterministic and exact."""

    def __init__(self, weights: list[int]) -> None:
        self.weights = weights
        self.total = sum(weights)
        self.current = [0] * len(weights)
        self.single = len([w for w in weights if w > 0]) == 1
        self.only = next(i for i, w in enumerate(weights) if w > 0)

    def next(self) -> int:
        """The index of the next operation."""
        if self.single:
            return self.only
        current = self.current
        best = 0
        for i, w in enumerate(self.weights):
            current[i] += w
            if current[i] > current[best]:
                best = i
        current[best] -= self.total
        return best


class CompiledCall:
    """A call operation ready for the load loop: its request template and its checks."""

    def __init__(self, spec: CallSpec, modern: bool) -> None:
        self.spec = spec
        self.template = wire.RequestTemplate("tools/call", {"name": spec.tool, "arguments": spec.arguments}, modern)
        schema = schema_check(spec.expect_schema) if spec.expect_schema is not None else None
        needs_check = spec.expect_contains is not None or schema is not None or spec.expect_error
        self.check = wire.CallCheck(spec.expect_contains, schema, spec.expect_error) if needs_check else None
        templated = spec.expect_text is not None and bool(wire.placeholders(spec.expect_text))
        #: The expected text: fixed, or rendered per call from the call's own variables.
        self.static_text = None if templated else spec.expect_text
        self.text_template = spec.expect_text if templated else None
        self.used = self.template.used | (frozenset(wire.placeholders(self.text_template))
                                          if self.text_template else frozenset())
