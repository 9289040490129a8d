"""Tools that ask, end to end with the official MCP Python SDK client (``mcp``) as the client that
answers: over stdio (the SDK spawns ``toolcell serve --stdio``) and over HTTP (a daemon in this
trio run), as a legacy client (server->client requests) and as a 2026-07-28 client (the SDK's own
``input_required`` retry loop). Its sampling, elicitation and roots callbacks are the user.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from ask_harness import serve_http
from ask_plugins import ASKER
from mcp import Client, types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from stdio_peer import CONFORMANCE, REPO, open_log

WAIT_S = 30.0
MODES = ["legacy", "2026-07-28"]

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated",
                                        "ignore:The roots capability is deprecated")


@pytest.fixture
def plugins(make_plugin: Callable[..., Path]) -> Path:
    return make_plugin("asker", ASKER, limits={"timeout_s": 20, "ask_timeout_s": 20, "max_concurrency": 2})


class User:
    """The person (and model) behind the client: answers what the tools ask, records every question."""

    def __init__(self) -> None:
        self.action = "accept"
        self.content: dict[str, Any] = {"ok": True, "note": "fine"}
        self.asked: list[tuple[str, Any]] = []
        self.refuse_sampling = False

    async def elicit(self, context: Any, params: Any) -> types.ElicitResult:
        self.asked.append(("elicit", params))
        content = self.content
        if params.message in ("What is your name?", "Name?"):
            content = {"name": "Ann"}
        if self.action != "accept":
            return types.ElicitResult(action=self.action)
        return types.ElicitResult(action="accept", content=content)

    async def sample(self, context: Any, params: types.CreateMessageRequestParams) -> Any:
        self.asked.append(("sample", params))
        if self.refuse_sampling:
            return types.ErrorData(code=-1, message="the user said no")
        prompt = params.messages[0].content
        said = getattr(prompt, "text", "?")
        return types.CreateMessageResult(role="assistant", model="fake-model",
                                         content=types.TextContent(type="text", text=f"reply to {said}"))

    async def roots(self, context: Any) -> types.ListRootsResult:
        self.asked.append(("roots", None))
        return types.ListRootsResult(roots=[types.Root(uri="file:///work", name="work"),
                                            types.Root(uri="file:///tmp")])

    def callbacks(self) -> dict[str, Any]:
        return {"elicitation_callback": self.elicit, "sampling_callback": self.sample,
                "list_roots_callback": self.roots}


def text(result: Any) -> str:
    return " ".join(c.text for c in result.content if c.type == "text")


def stdio_server(*plugin_dirs: Path) -> StdioServerParameters:
    args = ["-m", "runtime.cli", "serve", "--stdio", "--no-watch", "--policy", "none"]
    for d in plugin_dirs:
        args += ["--plugins", str(d)]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(REPO))


@asynccontextmanager
async def clients(transport: str, mode: str, plugins: Path, tmp_path: Path, user: User
                  ) -> AsyncIterator[tuple[Client, Client]]:
    """A client that declares sampling, elicitation and roots, and one that declares nothing."""
    if transport == "stdio":
        params = stdio_server(plugins, CONFORMANCE)
        with open_log(tmp_path / "daemon.log", "w") as err, open_log(tmp_path / "bare.log", "w") as err2, \
                trio.fail_after(WAIT_S * 3):
            async with Client(stdio_client(params, errlog=err), mode=mode, **user.callbacks()) as able, \
                    Client(stdio_client(params, errlog=err2), mode=mode) as bare:
                yield able, bare
    else:
        async with serve_http([plugins, CONFORMANCE], tmp_path / "state") as srv:
            with trio.fail_after(WAIT_S * 3):
                async with Client(srv.url, mode=mode, **user.callbacks()) as able, Client(srv.url, mode=mode) as bare:
                    yield able, bare


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_the_sdk_client_answers_what_tools_ask(transport: str, mode: str, plugins: Path, tmp_path: Path) -> None:
    user = User()
    async with clients(transport, mode, plugins, tmp_path, user) as (client, bare):
        assert client.protocol_version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
        # A confirmation: every answer reaches the tool; accepted content becomes the Struct asked for.
        accepted = await client.call_tool("confirm", {})
        assert text(accepted) == "accept:Confirm:True:fine" and not accepted.is_error
        kind, params = user.asked[-1]
        assert kind == "elicit" and params.message == "Proceed?"
        schema = params.requested_schema
        assert schema["type"] == "object" and set(schema["properties"]) == {"ok", "note"} and schema["required"] == ["ok"]
        user.content = {"ok": "yes please"}
        refused = await client.call_tool("confirm", {})
        assert text(refused).startswith("refused:") and "does not fit" in text(refused)
        for action in ("decline", "cancel"):
            user.action = action
            assert text(await client.call_tool("confirm", {})) == f"{action}:None"
        user.action = "accept"
        # The model.
        sampled = await client.call_tool("sample", {"prompt": "what is 6x7?"})
        assert text(sampled) == "assistant:fake-model:reply to what is 6x7?"
        kind, params = user.asked[-1]
        assert kind == "sample" and params.max_tokens == 50 and params.system_prompt == "be brief"
        if mode == "legacy":  # (a 2026-07-28 SDK client raises its callback's error itself)
            user.refuse_sampling = True
            no = await client.call_tool("sample", {"prompt": "x"})
            assert no.is_error and "the client answered with an error: the user said no" in text(no)
            user.refuse_sampling = False
        # Two rounds, and three questions in one round.
        before = len(user.asked)
        two = await client.call_tool("two_rounds", {})
        assert text(two).endswith("who=Ann greeting=reply to Greet Ann")
        assert [k for k, _ in user.asked[before:]] == ["elicit", "sample"]
        three = await client.call_tool("one_round", {})
        assert text(three).endswith("who=Ann greeting=reply to Hello roots=2")
        # Roots.
        assert text(await client.call_tool("roots", {})) == "file:///work|work;file:///tmp|None"
        # The conformance fixtures.
        fixture = await client.call_tool("test_sampling", {"prompt": "ping"})
        assert "reply to ping" in text(fixture) and not fixture.is_error
        multi = await client.call_tool("test_input_required_result_multiple_inputs", {})
        assert not multi.is_error and "2 roots" in text(multi)

        # The client that declared nothing is never asked: each tool hears CapabilityMissing.
        asked_so_far = len(user.asked)
        assert text(await bare.call_tool("confirm", {})) == "missing:elicitation"
        said = text(await bare.call_tool("sample_or_say", {"prompt": "p"}))
        assert said.startswith("missing:sampling:") and "sampling" in said
        if mode == "legacy":
            uncaught = await bare.call_tool("must_sample", {})
            assert uncaught.is_error and "sampling" in text(uncaught)
        else:
            with pytest.raises(MCPError) as caught:
                await bare.call_tool("must_sample", {})
            assert caught.value.error.code == -32021
            assert caught.value.error.data == {"requiredCapabilities": {"sampling": {}}}
        assert len(user.asked) == asked_so_far

