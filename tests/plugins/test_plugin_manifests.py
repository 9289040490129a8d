"""Every bundled plugin: manifest decodes, tools are well described, schemas are usable."""

from __future__ import annotations

import ast
import re
import sys

import pytest
from plugin_harness import PLUGIN_DIRS, jsonschema_rs

from runtime.manifest import load_manifest

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EXPECTED_TOOLS = {
    "textkit": {
        "text_stats",
        "text_regex_search",
        "text_regex_replace",
        "text_diff",
        "text_slugify",
        "text_convert_case",
    },
    "mathkit": {"math_evaluate", "math_statistics", "math_convert_units"},
    "codec": {"codec_hash", "codec_hmac", "codec_encode", "codec_decode", "codec_uuid", "codec_jwt_decode"},
    "timekit": {
        "time_convert",
        "time_add",
        "time_difference",
        "time_list_zones",
        "time_parse",
        "time_format",
        "time_now",
    },
    "jsonkit": {"json_query", "json_validate", "json_format", "json_diff", "json_flatten", "json_unflatten"},
    "conformance": {
        "test_simple_text",
        "test_image_content",
        "test_audio_content",
        "test_embedded_resource",
        "test_multiple_content_types",
        "test_tool_with_logging",
        "test_tool_with_progress",
        "test_error_handling",
        "json_schema_2020_12_tool",
        # tools that ask (legacy requests, 2026-07-28 input_required)
        "test_sampling",
        "test_elicitation",
        "test_elicitation_sep1034_defaults",
        "test_elicitation_sep1330_enums",
        "test_input_required_result_elicitation",
        "test_input_required_result_sampling",
        "test_input_required_result_list_roots",
        "test_input_required_result_request_state",
        "test_input_required_result_multiple_inputs",
        "test_input_required_result_multi_round",
        "test_input_required_result_tampered_state",
        "test_input_required_result_capabilities",
        "test_missing_capability",
        "test_streaming_elicitation",
        "test_logging_tool",
        # x-mcp-header (SEP-2243)
        "test_custom_headers",
        # tasks
        "greet",
        "slow_compute",
        "failing_job",
        "protocol_error_job",
        "confirm_delete",
        "multi_input",
        "test_tool_with_task",
    },
    "echo": {"echo"},
}


@pytest.mark.parametrize("name", sorted(PLUGIN_DIRS))
def test_manifest_decodes_with_sensible_limits(name):
    m = load_manifest(PLUGIN_DIRS[name])
    assert m.name == name
    assert m.description
    assert m.isolation == "pooled"
    # The conformance suite's task fixtures run up to a minute (cancelled sooner); everything else is quick.
    assert m.limits.timeout_s <= (120 if name == "conformance" else 10)
    # The conformance suite runs scenarios side by side, and holds calls that asked for their retry.
    assert m.limits.max_concurrency == (8 if name == "conformance" else 2)
    assert 128 <= m.limits.memory_mb <= 512
    assert m.permissions.network == [] and m.permissions.write == []
    if name == "timekit":
        assert m.permissions.read == ["/usr/share/zoneinfo"]
    else:
        assert m.permissions.read == []


@pytest.mark.parametrize("name", sorted(PLUGIN_DIRS))
def test_tools_are_named_and_described(name, load_plugin):
    plugin = load_plugin(name)
    full_names = {plugin.manifest.prefix + t for t in plugin.tools}
    assert full_names == EXPECTED_TOOLS[name]
    for tool_name, tdef in plugin.tools.items():
        full = plugin.manifest.prefix + tool_name
        assert TOOL_NAME.match(full), full
        assert tdef.description.strip(), f"{full} has no description"
        schema = tdef.input_schema
        assert schema["type"] == "object", full
        for pname, pschema in schema.get("properties", {}).items():
            assert pschema.get("description", "").strip(), f"{full}: parameter {pname} has no description"
        if not schema.get("properties") and tdef.args_type is not None:
            assert schema.get("additionalProperties") is False  # the spec's advice for no-argument tools
        if tdef.output_schema is not None:
            assert tdef.output_schema.get("type") == "object", full
        if jsonschema_rs is not None:  # both schemas must compile
            jsonschema_rs.validator_for(schema)
            if tdef.output_schema is not None:
                jsonschema_rs.validator_for(tdef.output_schema)
        # Docstrings document every parameter: the descriptions above must not be the
        # type name or empty filler.
        for pschema in schema.get("properties", {}).values():
            assert len(pschema["description"]) >= 10


@pytest.mark.parametrize("name", sorted(PLUGIN_DIRS))
def test_plugins_use_only_stdlib_msgspec_and_sandbox(name):
    folder = PLUGIN_DIRS[name]
    allowed = set(sys.stdlib_module_names) | {"msgspec", "sandbox", "__future__"}
    for source in folder.glob("*.py"):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in allowed, f"{source.name} imports {root}"
