"""Garbage in, well-formed answers out: property-based tests of ``Core.receive``.

Whatever bytes arrive, the core returns an action (never raises), every reply it produces is one
line of well-formed JSON-RPC, requests with a readable id are answered with that id, notifications
are never answered, and the connection keeps working afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_fakes import (
    ACTION_TYPES,
    Batch,
    Cancel,
    ConnState,
    Listen,
    Reply,
    ToolCall,
    catalog,
    core_for,
    decode,
    initialized,
    many,
    modern_meta,
    msg,
    result_of,
    well_formed,
)

CORE = core_for(catalog(many(5) + list(catalog().entries), page_size=2))
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Message-shaped strategies are costly to generate; fewer examples keep the file within seconds.
FUZZ_MESSAGES = settings(FUZZ, max_examples=100)
METHODS = ["initialize", "ping", "tools/list", "tools/call", "logging/setLevel", "server/discover",
           "subscriptions/listen", "notifications/initialized", "notifications/cancelled", "resources/list", "x"]

finite = st.floats(allow_nan=False, allow_infinity=False)  # NaN/Infinity would not be JSON at all
json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64) | finite | st.text()
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
ids = st.integers(-(2**53), 2**53) | st.text(max_size=10) | st.none() | st.booleans() | finite
metas = st.none() | json_values | st.fixed_dictionaries(
    {"io.modelcontextprotocol/protocolVersion": st.sampled_from(["2026-07-28", "2025-06-18", "bogus"]) | json_values},
    optional={"io.modelcontextprotocol/clientCapabilities": st.just({}) | json_values,
              "io.modelcontextprotocol/logLevel": st.sampled_from(["debug", "error", "nope"]) | json_values,
              "progressToken": ids})
params = st.none() | json_values | st.fixed_dictionaries(
    {}, optional={"name": st.sampled_from(["plain", "rich", "typed", "tool0001", "ghost"]) | json_values,
                  "arguments": json_values, "cursor": json_values, "protocolVersion": st.sampled_from(
                      ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"]) | json_values,
                  "capabilities": json_values, "level": st.sampled_from(["info", "bad"]) | json_values,
                  "requestId": ids, "_meta": metas})
messages = st.fixed_dictionaries(
    {}, optional={"jsonrpc": st.just("2.0") | json_values, "id": ids, "method": st.sampled_from(METHODS) | st.text(),
                  "params": params, "result": json_values, "error": json_values})


def check(action: Any) -> None:
    """``action`` is a valid action; every byte it would send is well-formed JSON-RPC."""
    assert isinstance(action, ACTION_TYPES), action
    if isinstance(action, Reply) and action.data is not None:
        well_formed(action.data)
    elif isinstance(action, Batch):
        assert action.actions
        for member in action.actions:
            assert not isinstance(member, Batch)
            check(member)
    elif isinstance(action, ToolCall):
        assert isinstance(action.arguments, dict)
        assert type(action.request_id) in (int, str)


def still_serves(state: ConnState) -> None:
    """The connection answers a ping, and a modern request, after whatever came before."""
    assert decode(CORE.receive(state, msg("ping", id="after")))["result"] == {}
    assert result_of(CORE.receive(state, msg("server/discover", {"_meta": modern_meta()})))["resultType"] == "complete"


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_always_get_a_well_formed_answer(data: bytes) -> None:
    state = ConnState()
    check(CORE.receive(state, data))
    still_serves(state)


@FUZZ
@given(json_values)
def test_random_json_values_always_get_a_well_formed_answer(value: Any) -> None:
    state = initialized(CORE, "2025-03-26")  # the one revision that also parses batches
    check(CORE.receive(state, json.dumps(value).encode()))
    still_serves(state)


@FUZZ_MESSAGES
@given(messages, st.sampled_from([None, "2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]))
def test_message_shaped_garbage_is_answered_by_id_and_notifications_never(message: dict, version: str | None) -> None:
    state = ConnState() if version is None else initialized(CORE, version)
    action = CORE.receive(state, json.dumps(message).encode())
    check(action)
    request_id = message.get("id")
    is_request = (isinstance(message.get("method"), str) and message.get("jsonrpc") == "2.0"
                  and "id" in message and type(request_id) in (int, str))
    is_notification = (isinstance(message.get("method"), str) and message.get("jsonrpc") == "2.0"
                       and "id" not in message)
    if is_request:
        if isinstance(action, Reply):
            body = decode(action)
            assert body["id"] == request_id and type(body["id"]) is type(request_id)
        else:
            assert isinstance(action, (ToolCall, Listen)) and action.request_id == request_id
    elif is_notification:
        assert action == Reply(None) or isinstance(action, Cancel)
    still_serves(state)


@FUZZ_MESSAGES
@given(st.lists(st.binary(max_size=60) | messages.map(lambda m: json.dumps(m).encode()), max_size=6))
def test_a_stream_of_garbage_never_breaks_the_connection(stream: list[bytes]) -> None:
    state = ConnState()
    for data in stream:
        check(CORE.receive(state, data))
    still_serves(state)


@FUZZ
@given(st.binary(min_size=1, max_size=200).filter(lambda b: not _utf8(b)))
def test_invalid_utf8_is_a_parse_error(data: bytes) -> None:
    action = CORE.receive(ConnState(), b'{"jsonrpc":"2.0","id":1,"method":"' + data + b'"}')
    check(action)
    assert decode(action)["error"]["code"] in (-32700, -32600)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- pathological inputs, one at a time ---------------------------------------------------------------


@pytest.mark.parametrize("opener,closer", [(b"[", b"]"), (b'{"a":', b"}")])
def test_a_hundred_thousand_levels_of_nesting_are_a_parse_error(opener: bytes, closer: bytes) -> None:
    data = opener * 100_000 + (b"1" if opener.startswith(b"{") else b"") + closer * 100_000
    action = CORE.receive(ConnState(), data)
    check(action)
    assert decode(action)["error"]["code"] == -32700


@pytest.mark.parametrize("where", ["id", "params", "method"])
def test_deep_nesting_inside_a_request_is_answered_not_raised(where: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    fields = {"jsonrpc": '"2.0"', "id": "1", "method": '"ping"', "params": "{}"}
    fields[where] = deep
    data = ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}").encode()
    action = CORE.receive(ConnState(), data)
    check(action)
    assert "error" in decode(action)


@pytest.mark.parametrize("depth", [100, 254])
def test_nested_tool_arguments_below_the_validator_limit_are_validated(depth: int) -> None:
    state = initialized(CORE, "2025-06-18")
    args = '{"count":' + "[" * depth + "]" * depth + "}"
    data = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"typed","arguments":'
            + args.encode() + b"}}")
    action = CORE.receive(state, data)
    check(action)
    assert decode(action)["error"]["code"] == -32602


@pytest.mark.parametrize("tool", ["typed", "plain"])
@pytest.mark.parametrize("depth", [256, 900])
def test_deeply_nested_tool_arguments_are_invalid_params_not_an_exception(tool: str, depth: int) -> None:
    state = initialized(CORE, "2025-06-18")
    args = '{"count":' + "[" * depth + "]" * depth + "}"
    data = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"' + tool.encode()
            + b'","arguments":' + args.encode() + b"}}")
    action = CORE.receive(state, data)
    check(action)
    assert decode(action)["error"]["code"] == -32602


def test_duplicate_keys_are_answered_with_one_of_the_ids() -> None:
    action = CORE.receive(ConnState(), b'{"jsonrpc":"2.0","id":1,"method":"ping","id":"second"}')
    check(action)
    body = decode(action)
    assert body["id"] in (1, "second")
    assert body["result"] == {}


def test_duplicate_method_keys_do_not_confuse_the_core() -> None:
    action = CORE.receive(ConnState(), b'{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"ping"}')
    check(action)
    assert decode(action)["id"] == 1


@pytest.mark.parametrize("size", [1 << 20, 8 << 20])
def test_huge_strings_are_handled(size: int) -> None:
    big = "x" * size
    state = initialized(CORE, "2025-06-18")
    for data in (msg("ping", {"junk": big}), msg("tools/call", {"name": "plain", "arguments": {"s": big}}),
                 msg("tools/list", {"cursor": big}), json.dumps(big).encode()):
        check(CORE.receive(state, data))
    still_serves(state)


def test_error_messages_stay_short_whatever_the_client_sent() -> None:
    big = "m" * (1 << 20)
    state = initialized(CORE, "2025-06-18")
    for data in (msg(big, {}), msg("tools/call", {"name": big})):
        action = CORE.receive(state, data)
        assert len(action.data) < 4096
