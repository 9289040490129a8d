"""A hosted MCP server's questions during a call reach the client that made the call.

A server that asks (``elicitation/create`` during ``tools/call``) is answered by toolcell's client,
through the same path as a plugin's questions (``runtime.execution.hosted.HostedRunner.ask``): a legacy client
gets our request on the call's stream and its answer goes back to the server; a client that did not
declare elicitation makes the server hear an error, and the call still completes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import HOSTILE, PYTHON, connect, text, write_config
from mcp import types

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated")


@pytest.fixture
def asking_server(make_server: Callable[..., Path]) -> Path:
    plugins = make_server("asker", {"command": [PYTHON, "hostile_server.py"]}, limits={"timeout_s": 20})
    copy = plugins / "asker" / "hostile_server.py"
    shutil.copy(HOSTILE, copy)
    copy.chmod(0o644)
    return plugins


async def test_a_hosted_servers_elicitation_reaches_the_client_and_its_answer_the_server(
        asking_server: Path, tmp_path: Path, state_dir: Path) -> None:
    asked: list[Any] = []

    async def elicit(context: Any, params: Any) -> types.ElicitResult:
        asked.append(params)
        return types.ElicitResult(action="accept", content={"name": "Ada"})

    config = write_config(tmp_path, state_dir)
    async with connect(asking_server, config, tmp_path / "daemon.log", elicitation_callback=elicit) as client:
        result = await client.call_tool("ask_user", {})
    answer = json.loads(text(result))
    assert answer["result"] == {"action": "accept", "content": {"name": "Ada"}}
    assert len(asked) == 1 and asked[0].message == "Your name?"


async def test_a_client_without_elicitation_makes_the_server_hear_an_error_and_the_call_completes(
        asking_server: Path, tmp_path: Path, state_dir: Path) -> None:
    config = write_config(tmp_path, state_dir)
    async with connect(asking_server, config, tmp_path / "daemon.log") as client:  # no elicitation callback
        result = await client.call_tool("ask_user", {})
        again = await client.call_tool("echo", {"text": "still serving"})
    answer = json.loads(text(result))
    assert answer["error"]["code"] == -32601 and "elicitation" in answer["error"]["message"]
    assert text(again) == "still serving"


async def test_a_servers_request_toolcell_cannot_serve_gets_the_error_tables_answer_and_the_call_completes(
        asking_server: Path, tmp_path: Path, state_dir: Path) -> None:
    """The daemon answers a hosted server's own requests with codes from the one error table: an
    unknown method -32601, params too deep to relay -32602, params that are not an object -32603."""
    config = write_config(tmp_path, state_dir)
    async with connect(asking_server, config, tmp_path / "daemon.log") as client:
        unknown = json.loads(text(await client.call_tool("ask_raw", {"method": "resources/steal", "params": {}})))
        too_deep = json.loads(text(await client.call_tool("ask_raw", {"method": "elicitation/create", "depth": 100})))
        not_object = json.loads(text(await client.call_tool("ask_raw", {"method": "elicitation/create", "params": [1]})))
        again = await client.call_tool("echo", {"text": "still serving"})
    assert unknown["error"] == {"code": -32601, "message": "Method not found: resources/steal"}
    assert too_deep["error"]["code"] == -32602 and "nested deeper" in too_deep["error"]["message"]
    assert not_object["error"]["code"] == -32603 and "which call" in not_object["error"]["message"]
    assert text(again) == "still serving"
