"""A tool schema is bounded by what it expands to through ``$ref``, not only by what is written.

The validator walks a subschema once per path that reaches it, for every value node. None of these
checks may itself expand a schema: each one below would hang (2^40 steps) if it did.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.protocol.schemas import MAX_SCHEMA_EXPANSION, check_tool, describe_validation_error
from sandbox.wire import ToolSpec

EXPANDS = f"expands to more than {MAX_SCHEMA_EXPANSION} nodes through $ref"
TWO_PATHS = "a recursive $ref reaches the same part of the value along two paths"


def chain(n: int, combinator: str = "oneOf", defs_key: str = "$defs") -> dict[str, Any]:
    """``a_i`` refers to ``a_(i-1)`` twice: 2^n subschemas once inlined, ~5n written."""
    defs: dict[str, Any] = {"a0": {"type": "integer"}}
    for i in range(1, n + 1):
        defs[f"a{i}"] = {combinator: [{"$ref": f"#/{defs_key}/a{i - 1}"}, {"$ref": f"#/{defs_key}/a{i - 1}"}]}
    return {"type": "object", defs_key: defs, "properties": {"x": {"$ref": f"#/{defs_key}/a{n}"}}}


def check(input_schema: dict[str, Any], output_schema: dict[str, Any] | None = None) -> tuple[Any, list[str]]:
    spec = ToolSpec(name="t", description="a tool", input_schema=input_schema, output_schema=output_schema)
    return check_tool(spec, "t")


TREE: dict[str, Any] = {  # a two-node $ref cycle: node -> children[i] -> node
    "type": "object",
    "properties": {"root": {"$ref": "#/$defs/node"}},
    "required": ["root"],
    "$defs": {"node": {"type": "object", "required": ["value"],
                       "properties": {"value": {"type": "integer"},
                                      "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
}


@pytest.mark.parametrize("combinator", ["oneOf", "anyOf", "allOf"])
def test_a_ref_chain_that_doubles_per_level_is_refused_as_input(combinator: str) -> None:
    checked, problems = check(chain(40, combinator))
    assert checked is None
    assert problems == [f"tool 't' inputSchema: {EXPANDS}"]


def test_a_ref_chain_is_refused_as_output_schema_and_through_draft_07_definitions() -> None:
    output = dict(chain(40, defs_key="definitions"), **{"$schema": "http://json-schema.org/draft-07/schema#"})
    checked, problems = check({"type": "object"}, output)
    assert checked is None
    assert problems == [f"tool 't' outputSchema: {EXPANDS}"]


def test_a_ref_chain_through_anchors_and_pointers_into_properties_is_refused() -> None:
    defs: dict[str, Any] = {"a0": {"$anchor": "a0", "type": "integer"}}
    for i in range(1, 41):
        defs[f"a{i}"] = {"$anchor": f"a{i}", "anyOf": [{"$ref": f"#a{i - 1}"}, {"$ref": f"#/$defs/a{i - 1}"}]}
    checked, problems = check({"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#a40"}},
                               "additionalProperties": {"$ref": "#/properties/x"}})
    assert checked is None and problems == [f"tool 't' inputSchema: {EXPANDS}"]


def test_a_chain_under_the_bound_is_accepted_and_validates() -> None:
    checked, problems = check(chain(8))
    assert problems == [] and checked is not None
    assert describe_validation_error(checked.validator, {"x": 3}) is not None  # oneOf of twins: never one
    checked, problems = check(chain(8, "anyOf"))
    assert problems == [] and checked is not None
    assert describe_validation_error(checked.validator, {"x": 3}) is None
    assert describe_validation_error(checked.validator, {"x": "three"}) is not None


def test_a_recursive_tree_schema_is_accepted_and_validates() -> None:
    checked, problems = check(TREE, TREE)
    assert problems == [] and checked is not None
    good = {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": 4}]}}
    assert describe_validation_error(checked.validator, good) is None
    bad = {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": "three"}]}]}}
    problem = describe_validation_error(checked.validator, bad)
    assert problem is not None and "root/children/0/children/0/value" in problem
    assert checked.output_validator is not None and checked.output_validator.is_valid(good)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"left": {"$ref": "#"}, "right": {"$ref": "#"}, "v": {"type": "integer"}}},
    {"type": "object", "additionalProperties": {"$ref": "#/$defs/json"},
     "$defs": {"json": {"anyOf": [{"type": ["string", "number", "boolean", "null"]},
                                  {"type": "array", "items": {"$ref": "#/$defs/json"}},
                                  {"type": "object", "additionalProperties": {"$ref": "#/$defs/json"}}]}}},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
], ids=["binary-tree", "any-json-value", "linked-list"])
def test_recursions_that_reach_each_child_one_way_are_accepted(schema: dict[str, Any]) -> None:
    checked, problems = check(schema)
    assert problems == [] and checked is not None


def test_ordinary_schemas_with_a_few_refs_are_accepted() -> None:
    address = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}}}
    schema = {"type": "object", "$defs": {"address": dict(address, **{"$anchor": "addr"}), "when": {"type": "string"}},
              "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#addr"},
                             "since": {"$ref": "#/$defs/when"},
                             "past": {"type": "array", "items": {"$ref": "#/$defs/address"}}}}
    checked, problems = check(schema, schema)
    assert problems == [] and checked is not None
    assert describe_validation_error(checked.validator, {"home": {"zip": "1"}, "past": [{"street": "s"}]}) is None
    assert describe_validation_error(checked.validator, {"work": {"zip": 1}}) is not None


def test_a_recursion_that_reaches_one_child_two_ways_is_refused() -> None:
    # Small and cyclic, yet 2^depth: both branches validate the same "c" child at every level.
    checked, problems = check({"type": "object", "properties": {"c": {"oneOf": [{"$ref": "#"}, {"$ref": "#"}]}}})
    assert checked is None and len(problems) == 1 and TWO_PATHS in problems[0]
    # The same through two definitions, one key for both: still two paths per level.
    expr = {"type": "object", "properties": {"e": {"$ref": "#/$defs/e"}},
            "$defs": {"e": {"oneOf": [{"type": "object", "properties": {"op": {"const": op}, "l": {"$ref": "#/$defs/e"}}}
                                      for op in ("add", "mul")] + [{"type": "integer"}]}}}
    checked, problems = check(expr)
    assert checked is None and len(problems) == 1 and TWO_PATHS in problems[0]


def test_a_ref_cycle_that_never_descends_into_the_value_is_refused() -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
              "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "integer"}]}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}}
    checked, problems = check(schema)
    assert checked is None and len(problems) == 1 and "never descends into the value" in problems[0]


def test_a_recursion_inside_a_recursion_is_charged_per_level() -> None:
    # "t" recurses through "k" and reaches "u", itself recursive: u's work repeats at every level of t.
    def nested(width: int) -> dict[str, Any]:
        return {"type": "object", "properties": {"x": {"$ref": "#/$defs/t"}},
                "$defs": {"t": {"type": "object", "properties": {"k": {"$ref": "#/$defs/t"}, "u": {"$ref": "#/$defs/u"}}},
                          "u": {"type": "array", "items": {"$ref": "#/$defs/u"},
                                "allOf": [{"type": "array"} for _ in range(width)]}}}
    assert check(nested(2))[1] == []
    checked, problems = check(nested(200))  # ~600 nodes written, far under the raw cap
    assert checked is None and problems == [f"tool 't' inputSchema: {EXPANDS}"]


def test_a_local_ref_that_does_not_resolve_is_refused() -> None:
    checked, problems = check({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})
    assert checked is None
    assert problems == ["tool 't' inputSchema: $ref '#/$defs/missing' does not resolve within the schema"]
