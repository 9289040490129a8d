"""The stdio transport (``runtime.transports.stdio.serve_stdio``) over in-memory streams.

A real daemon (its workers are real processes) is opened in-process; the client side is a
``trio.testing.memory_stream_pair``, so line splitting, EOF handling and output framing are tested
without a subprocess for the daemon itself. Garbage through a real ``toolcell serve --stdio``
process closes the file.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import probe_plugins
import psutil
import pytest
import trio
import trio.lowlevel
import trio.testing
from stdio_peer import open_toolcell, text_of

from runtime.config import load_config
from runtime.daemon import Daemon, open_daemon
from runtime.transports.stdio import _Writer, serve_stdio

MAX_LINE = 4096
WAIT_S = 15.0


@pytest.fixture(autouse=True)
def _not_a_subreaper_afterwards() -> Any:
    """``open_daemon`` makes this process a child subreaper; undo that for the tests that follow."""
    yield
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


@pytest.fixture
async def daemon(make_plugin: Callable[..., Path], tmp_path: Path) -> AsyncIterator[Daemon]:
    # One worker per plugin, never more: no worker is ever being started when the daemon closes
    # (see test_workers_via_daemon: closing while a worker starts hangs). Two plugins give two
    # workers for the tests that need calls running side by side.
    limits = {"timeout_s": 10, "max_concurrency": 1}
    make_plugin("probe", probe_plugins.PROBE, limits=limits)
    plugins = make_plugin("other", probe_plugins.PROBE, limits=limits, prefix="b_")
    cfg = load_config(None, {"plugins": [str(plugins)], "policy": "none", "max_message_bytes": MAX_LINE,
                             "watch": False, "state_dir": str(tmp_path / "state"), "log_level": "error"})
    stuck = trio.Event()

    async def guard() -> None:
        # A safety net, so that a daemon that cannot close fails this test instead of hanging the suite.
        await trio.sleep(10)
        stuck.set()
        for child in psutil.Process().children(recursive=True):
            try:
                if "from sandbox.worker import main" in " ".join(child.cmdline()):
                    child.kill()
            except psutil.Error:
                pass

    guard_scope = trio.CancelScope()
    async with open_daemon(cfg) as d:
        yield d
        trio.lowlevel.spawn_system_task(_run_in, guard_scope, guard)
    guard_scope.cancel()
    if stuck.is_set():
        pytest.fail("the in-process daemon did not close within 10 s; its workers were killed")


async def _run_in(scope: trio.CancelScope, fn: Callable[[], Any]) -> None:
    with scope:
        await fn()


class Conversation:
    """One stdio connection: what the client sent, everything the server wrote."""

    def __init__(self, client: trio.StapledStream) -> None:
        self.client = client
        self.output = bytearray()
        self.served = trio.Event()

    async def send(self, data: bytes) -> None:
        await self.client.send_all(data)

    async def hang_up(self) -> None:
        await self.client.send_stream.aclose()

    def lines(self) -> list[bytes]:
        assert self.output.endswith(b"\n") or not self.output, bytes(self.output[-200:])
        return [line for line in bytes(self.output).split(b"\n") if line]

    def messages(self) -> list[Any]:
        out: list[Any] = []
        for line in self.lines():
            out.append(json.loads(line))
        return out

    def responses(self) -> dict[Any, Any]:
        found: dict[Any, Any] = {}
        for m in self.messages():
            for item in (m if isinstance(m, list) else [m]):
                if "method" not in item:
                    found[json.dumps(item.get("id"))] = item
        return found

    async def wait_for_line_count(self, count: int) -> None:
        with trio.fail_after(WAIT_S):
            while len(bytes(self.output).split(b"\n")) - 1 < count:
                await trio.sleep(0.01)


async def converse(daemon: Daemon, script: Callable[[Conversation], Any]) -> Conversation:
    """Run ``serve_stdio`` on a memory stream pair; ``script`` plays the client, then hangs up."""
    client, server = trio.testing.memory_stream_pair()
    conv = Conversation(client)

    async def read_all() -> None:
        while True:
            data = await client.receive_some(1 << 16)
            if not data:
                return
            conv.output += data

    async def serve() -> None:
        await serve_stdio(daemon, server.receive_stream, server.send_stream)
        conv.served.set()
        await server.send_stream.aclose()

    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            nursery.start_soon(serve)
            await script(conv)
            await conv.served.wait()
    return conv


def req(method: str, params: Any = None, id: Any = 1) -> bytes:
    obj: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        obj["params"] = params
    return json.dumps(obj).encode() + b"\n"


INIT = req("initialize", {"protocolVersion": "2025-06-18", "capabilities": {}}, id=0)


def key(request_id: Any) -> str:
    return json.dumps(request_id)


# -- framing --------------------------------------------------------------------------------------


async def test_each_response_is_one_line_of_json_on_stdout(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        await c.send(INIT + req("ping", id=1) + req("tools/list", {}, id=2))
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    assert [m["id"] for m in conv.messages()] == [0, 1, 2]
    names = [t["name"] for t in conv.messages()[2]["result"]["tools"]]
    assert names == sorted(names) and "echo" in names


async def test_a_message_split_across_many_writes_is_reassembled(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        data = INIT + req("tools/call", {"name": "echo", "arguments": {"text": "pieces"}}, id="p")
        for i in range(0, len(data), 7):
            await c.send(data[i:i + 7])
            await trio.lowlevel.checkpoint()
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    assert text_of(conv.responses()[key("p")]) == "pieces"


async def test_crlf_line_endings_and_blank_lines_are_accepted(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        await c.send(INIT.replace(b"\n", b"\r\n") + b"\n\r\n   \n" + req("ping", id=5).replace(b"\n", b"\r\n"))
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    assert set(conv.responses()) == {key(0), key(5)}
    assert all("error" not in m for m in conv.messages())


async def test_a_line_over_the_size_cap_gets_a_clear_error_and_the_next_line_is_served(daemon: Daemon) -> None:
    huge = req("ping", {"pad": "x" * (MAX_LINE * 3)}, id="huge")

    async def script(c: Conversation) -> None:
        await c.send(INIT)
        # Sent in pieces so that the cap is hit before the newline arrives.
        for i in range(0, len(huge), 1000):
            await c.send(huge[i:i + 1000])
            await trio.lowlevel.checkpoint()
        await c.send(req("ping", id="after"))
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    messages = conv.messages()
    errors = [m for m in messages if "error" in m]
    assert len(errors) == 1, messages  # one error for the whole long line, none for its tail
    assert errors[0]["error"]["code"] == -32600
    assert str(MAX_LINE) in errors[0]["error"]["message"]
    assert conv.responses()[key("after")]["result"] == {}


async def test_a_long_line_arriving_in_one_chunk_is_refused_too(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        await c.send(INIT + req("ping", {"pad": "y" * (MAX_LINE + 10)}, id="big") + req("ping", id="ok"))
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    errors = [m for m in conv.messages() if "error" in m]
    assert len(errors) == 1 and errors[0]["error"]["code"] == -32600
    assert conv.responses()[key("ok")]["result"] == {}


async def test_a_line_of_exactly_the_size_cap_is_accepted(daemon: Daemon) -> None:
    head = b'{"jsonrpc":"2.0","id":"edge","method":"ping","params":{"pad":"'
    tail = b'"}}'
    line = head + b"z" * (MAX_LINE - len(head) - len(tail)) + tail
    assert len(line) == MAX_LINE

    async def script(c: Conversation) -> None:
        await c.send(INIT + line + b"\n" + line[:-3] + b'zz"}}\n' + req("ping", id="tail"))
        await c.wait_for_line_count(4)
        await c.hang_up()

    conv = await converse(daemon, script)
    messages = conv.messages()
    assert conv.responses()[key("edge")]["result"] == {}
    assert [m["error"]["code"] for m in messages if "error" in m] == [-32600]  # the line one byte over
    assert conv.responses()[key("tail")]["result"] == {}


async def test_a_batch_of_only_notifications_gets_no_answer(daemon: Daemon) -> None:
    init = req("initialize", {"protocolVersion": "2025-03-26", "capabilities": {}}, id=0)
    batch = json.dumps([{"jsonrpc": "2.0", "method": "notifications/initialized"},
                        {"jsonrpc": "2.0", "method": "notifications/whatever"}]).encode() + b"\n"

    async def script(c: Conversation) -> None:
        await c.send(init + batch + req("ping", id="after"))
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    assert [m["id"] for m in conv.messages()] == [0, "after"]


async def test_a_subscription_is_acknowledged_first_and_ended_by_cancelling_it(daemon: Daemon) -> None:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}

    async def script(c: Conversation) -> None:
        await c.send(req("subscriptions/listen", {"_meta": meta, "notifications": {"toolsListChanged": True,
                                                                                   "promptsListChanged": True}},
                         id="sub"))
        await c.wait_for_line_count(1)
        await c.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": "sub"}}).encode() + b"\n")
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    ack, end = conv.messages()
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert ack["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "sub"
    assert ack["params"]["notifications"] == {"toolsListChanged": True}  # prompts are not served
    assert end["id"] == "sub" and end["result"]["resultType"] == "complete"


# -- end of input -----------------------------------------------------------------------------------


async def test_every_request_sent_before_stdin_closes_is_answered(daemon: Daemon) -> None:
    for round_ in range(3):
        ids = [f"r{round_}-{i}" for i in range(4)]

        async def script(c: Conversation, ids: list[str] = ids) -> None:
            data = INIT + req("ping", id=ids[0]) + req("tools/list", {}, id=ids[1])
            data += req("tools/call", {"name": "echo", "arguments": {"text": "last"}}, id=ids[2])
            data += req("tools/call", {"name": "slow", "arguments": {"seconds": 0.05}}, id=ids[3])
            await c.send(data)
            await c.hang_up()  # at once: in-flight calls must still be answered

        conv = await converse(daemon, script)
        got = conv.responses()
        assert {key(i) for i in ids} <= set(got), f"round {round_}: answered only {sorted(got)}"
        assert text_of(got[key(ids[2])]) == "last"


async def test_over_real_pipes_a_client_that_reads_late_loses_nothing(daemon: Daemon) -> None:
    """stdin and stdout as the pipes a client really gives (``FdStream``s, read and written directly
    by the transport): all requests arrive before the daemon reads, the answers overflow the pipe
    (the client reads nothing until it has sent everything), and every call is still answered once."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    text = "x" * 2000
    count = 150  # ~300 KB of answers: several times what a pipe holds
    data = INIT + b"".join(req("tools/call", {"name": "echo", "arguments": {"text": f"{i}:{text}"}}, id=i)
                           for i in range(1, count + 1))
    os.write(in_w, data[:60000])  # the rest follows while the daemon is already answering
    stdin = trio.lowlevel.FdStream(in_r)
    stdout = trio.lowlevel.FdStream(out_w)
    client_in = trio.lowlevel.FdStream(in_w)
    client_out = trio.lowlevel.FdStream(out_r)
    output = bytearray()
    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            async def serve() -> None:
                await serve_stdio(daemon, stdin, stdout)
                await stdout.aclose()

            nursery.start_soon(serve)
            await client_in.send_all(data[60000:])
            await trio.sleep(0.3)  # the daemon meanwhile fills the pipe and waits for it to drain
            await client_in.aclose()
            while True:
                chunk = await client_out.receive_some(1 << 16)
                if not chunk:
                    break
                output += chunk
    await stdin.aclose()
    await client_out.aclose()
    answers = [json.loads(line) for line in bytes(output).split(b"\n") if line]
    by_id = {m["id"]: m for m in answers}
    assert len(answers) == count + 1 and sorted(by_id) == list(range(count + 1))
    for i in range(1, count + 1):
        assert text_of(by_id[i]) == f"{i}:{text}"


async def test_a_client_that_sends_without_reading_is_not_read_further_and_loses_nothing(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that keeps sending and never reads its answers: once the answers it has not taken
    pass ``MAX_UNREAD_ANSWERS``, the daemon stops reading its stdin (it used to hold every answer,
    without end). When the client reads, everything is answered."""
    import runtime.transports.stdio as stdio_transport
    monkeypatch.setattr(stdio_transport, "MAX_UNREAD_ANSWERS", 100_000)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    text = "x" * 2000
    count = 600  # ~1.2 MB of requests and of answers: many times the limit and both pipes
    data = INIT + b"".join(req("tools/call", {"name": "echo", "arguments": {"text": f"{i}:{text}"}}, id=i)
                           for i in range(1, count + 1))
    stdin = trio.lowlevel.FdStream(in_r)
    stdout = trio.lowlevel.FdStream(out_w)
    os.set_blocking(in_w, False)
    os.set_blocking(out_r, False)
    output = bytearray()
    sent = 0
    with trio.fail_after(WAIT_S * 2):
        async with trio.open_nursery() as nursery:
            async def serve() -> None:
                await serve_stdio(daemon, stdin, stdout)
                await stdout.aclose()

            nursery.start_soon(serve)
            quiet_since = trio.current_time()
            while trio.current_time() - quiet_since < 1.0 and sent < len(data):  # send, never read
                try:
                    sent += os.write(in_w, data[sent:sent + 65536])
                    quiet_since = trio.current_time()
                except BlockingIOError:
                    await trio.sleep(0.02)
            assert sent < len(data) // 2, sent  # the daemon stopped taking requests
            while sent < len(data) or len(output.split(b"\n")) <= count:  # now the client reads too
                try:
                    sent += os.write(in_w, data[sent:sent + 65536]) if sent < len(data) else 0
                except BlockingIOError:
                    pass
                if sent == len(data) and in_w >= 0:
                    os.close(in_w)
                    in_w = -1
                try:
                    chunk = os.read(out_r, 1 << 16)
                except BlockingIOError:
                    await trio.sleep(0.005)
                    continue
                if not chunk:
                    break
                output += chunk
    os.close(out_r)
    await stdin.aclose()
    answers = [json.loads(line) for line in bytes(output).split(b"\n") if line]
    by_id = {m["id"]: m for m in answers}
    assert len(answers) == count + 1 and sorted(by_id) == list(range(count + 1))
    assert all(text_of(by_id[i]) == f"{i}:{text}" for i in range(1, count + 1))


async def test_the_first_line_of_a_pass_is_in_the_pipe_when_emit_returns_and_a_full_pipe_keeps_the_order() -> None:
    """The writer writes the first answer of a scheduler pass the moment it is made (the client can
    read it while the daemon goes on); the rest of the pass waits for the writer's one write. When
    the pipe fills in the middle of a line, the rest of that line and every line emitted after it
    follow, in order, once the client reads."""
    import fcntl
    out_r, out_w = os.pipe()
    fcntl.fcntl(out_w, 1031, 4096)  # F_SETPIPE_SZ: one page
    size = fcntl.fcntl(out_w, 1032)  # F_GETPIPE_SZ
    os.set_blocking(out_r, False)
    writer = _Writer(trio.lowlevel.FdStream(out_w))
    output = bytearray()

    async def read_until(length: int) -> None:
        while len(output) < length:
            await trio.lowlevel.wait_readable(out_r)
            output.extend(os.read(out_r, 1 << 16))

    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            writer.emit(b"first")
            assert os.read(out_r, 100) == b"first\n"  # there before anything awaited
            writer.emit(b"second")  # the same pass: it waits for the writer
            with pytest.raises(BlockingIOError):
                os.read(out_r, 100)
            await read_until(len(b"second\n"))
            assert output == b"second\n"
            output.clear()
            # A new pass, the pipe nearly full: the first line goes in part, the rest queues.
            filler = b"f" * (size - 100)
            os.write(out_w, filler)
            lines = [bytes([65 + i]) * (size // 3) for i in range(8)]
            for line in lines:
                writer.emit(line)
            assert writer.partial and writer.pending
            await read_until(len(filler) + size // 2)  # some room: the writer goes on
            writer.emit(b"late")  # while part of the queue is still unwritten: it goes after it
            lines.append(b"late")
            writer.close()
            expected = filler + b"".join(line + b"\n" for line in lines)
            await read_until(len(expected))
    assert bytes(output) == expected
    os.close(out_r)


# -- many calls, one connection ---------------------------------------------------------------------


async def test_responses_go_out_as_calls_finish_not_in_request_order(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        await c.send(INIT + req("tools/call", {"name": "slow", "arguments": {"seconds": 1.0}}, id="slow")
                     + req("tools/call", {"name": "b_echo", "arguments": {"text": "fast"}}, id="fast"))
        await c.wait_for_line_count(3)  # initialize, fast, slow
        await c.hang_up()

    conv = await converse(daemon, script)
    order = [m.get("id") for m in conv.messages() if "method" not in m]
    assert order.index("fast") < order.index("slow")


async def test_a_second_request_with_an_in_flight_id_is_refused_without_disturbing_the_first(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        await c.send(INIT + req("tools/call", {"name": "slow", "arguments": {"seconds": 0.5}}, id=7))
        await trio.sleep(0.1)
        await c.send(req("tools/call", {"name": "echo", "arguments": {"text": "dup"}}, id=7))
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    sevens = [m for m in conv.messages() if m.get("id") == 7]
    assert len(sevens) == 2
    assert sevens[0]["error"]["code"] == -32600
    assert text_of(sevens[1]) == "slept 0.5"


async def test_a_2025_03_26_batch_is_answered_with_one_array_once_every_member_is_done(daemon: Daemon) -> None:
    init = req("initialize", {"protocolVersion": "2025-03-26", "capabilities": {}}, id=0)
    batch = json.dumps([
        {"jsonrpc": "2.0", "id": "a", "method": "tools/call",
         "params": {"name": "slow", "arguments": {"seconds": 0.3}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": "b", "method": "ping"},
        {"jsonrpc": "2.0", "id": "c", "method": "tools/call", "params": {"name": "b_echo", "arguments": {"text": "c"}}},
        {"jsonrpc": "2.0", "id": "d", "method": "nope"},
    ]).encode() + b"\n"

    async def script(c: Conversation) -> None:
        await c.send(init + batch)
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    messages = conv.messages()
    assert len(messages) == 2
    array = messages[1]
    assert isinstance(array, list)
    assert sorted(m["id"] for m in array) == ["a", "b", "c", "d"]
    by_id = {m["id"]: m for m in array}
    assert text_of(by_id["a"]) == "slept 0.3" and text_of(by_id["c"]) == "c"
    assert by_id["d"]["error"]["code"] == -32601


async def test_legacy_and_modern_requests_are_served_on_one_connection(daemon: Daemon) -> None:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}

    async def script(c: Conversation) -> None:
        await c.send(req("tools/list", {"_meta": meta}, id="modern") + INIT + req("tools/list", {}, id="legacy"))
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    got = conv.responses()
    assert got[key("modern")]["result"]["resultType"] == "complete"
    assert "resultType" not in got[key("legacy")]["result"]
    assert [t["name"] for t in got[key("modern")]["result"]["tools"]] == \
        [t["name"] for t in got[key("legacy")]["result"]["tools"]]


# -- garbage through a real process -----------------------------------------------------------------


def garbage_lines(seed: int = 1234, count: int = 150) -> list[bytes]:
    rng = random.Random(seed)
    lines: list[bytes] = [
        b"\xff\xfe\xfd", b"{", b"[]", b"[1,2,3]", b"null", b'"just a string"', b"{}" * 3,
        b'{"jsonrpc":"2.0","id":null,"method":"ping"}', b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":{},"method":"ping"}', b'{"jsonrpc":"2.0","id":"x","method":"ping","id":2}',
        b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"echo","arguments":'
        + b"[" * 300 + b"]" * 300 + b"}}",
        b'{"jsonrpc":"2.0","id":"long","method":"' + b"m" * 200_000 + b'"}',
        b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":[[[]]]}}',
        "{\"jsonrpc\":\"2.0\",\"id\":\"\u2028\",\"method\":\"ping\"}".encode(),
    ]
    for _ in range(count):
        size = rng.randrange(1, 400)
        raw = bytes(rng.randrange(256) for _ in range(size)).replace(b"\n", b" ")
        lines.append(raw)
    return lines


async def test_garbage_lines_never_stop_a_real_daemon_from_answering(make_plugin: Callable[..., Path],
                                                                     tmp_path: Path) -> None:
    plugins = make_plugin("probe", probe_plugins.PROBE, limits={"timeout_s": 10})
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as peer:
        for line in garbage_lines():
            await peer.send_raw(line + b"\n")
        await peer.initialize("2025-06-18")
        response = await peer.call("echo", {"text": "after the storm"})
        assert text_of(response) == "after the storm"
        assert await peer.close() == 0
    # Everything the daemon wrote was a JSON-RPC message (the peer parsed every line).
    assert all(isinstance(m, (dict, list)) and (m if isinstance(m, dict) else m[0]).get("jsonrpc") == "2.0"
               for m in peer.messages)
    assert "Traceback" not in peer.stderr()


# -- edges found by fault injection (issue: a daemon that holds) ---------------------------------------

INIT_0326 = req("initialize", {"protocolVersion": "2025-03-26", "capabilities": {}}, id=0)


async def test_a_listen_inside_a_batch_is_refused_with_its_own_id(daemon: Daemon) -> None:
    batch = json.dumps([
        {"jsonrpc": "2.0", "id": "l", "method": "subscriptions/listen",
         "params": {"notifications": {"toolsListChanged": True},
                    "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                              "io.modelcontextprotocol/clientCapabilities": {},
                              "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}},
        {"jsonrpc": "2.0", "id": "p", "method": "ping"},
    ]).encode() + b"\n"

    async def script(c: Conversation) -> None:
        await c.send(INIT_0326 + batch)
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    array = conv.messages()[1]
    by_id = {m["id"]: m for m in array}
    assert set(by_id) == {"l", "p"}
    assert by_id["l"]["error"]["code"] == -32600 and "batch" in by_id["l"]["error"]["message"]
    assert by_id["p"]["result"] == {}


async def test_a_notification_named_initialize_inside_a_batch_is_not_answered(daemon: Daemon) -> None:
    batch = json.dumps([
        {"jsonrpc": "2.0", "method": "initialize", "params": {}},
        {"jsonrpc": "2.0", "id": 5, "method": "ping"},
    ]).encode() + b"\n"

    async def script(c: Conversation) -> None:
        await c.send(INIT_0326 + batch)
        await c.wait_for_line_count(2)
        await trio.sleep(0.2)
        await c.hang_up()

    conv = await converse(daemon, script)
    array = conv.messages()[1]
    assert [m["id"] for m in array] == [5]


def padded_ping(size: int, id: int = 9) -> bytes:
    """A ping request of exactly ``size`` bytes (no line ending)."""
    base = {"jsonrpc": "2.0", "id": id, "method": "ping", "params": {"_pad": ""}}
    short = len(json.dumps(base, separators=(",", ":")).encode())
    base["params"]["_pad"] = "x" * (size - short)
    line = json.dumps(base, separators=(",", ":")).encode()
    assert len(line) == size
    return line


async def test_a_line_of_exactly_the_limit_ending_in_crlf_is_read_when_cr_and_lf_arrive_apart(daemon: Daemon) -> None:
    async def script(c: Conversation) -> None:
        await c.send(INIT)
        await c.send(padded_ping(MAX_LINE) + b"\r")
        await trio.sleep(0.1)
        await c.send(b"\n")
        await c.wait_for_line_count(2)
        await c.hang_up()

    conv = await converse(daemon, script)
    assert conv.responses()[key(9)]["result"] == {}


@pytest.mark.parametrize("version, has_null_id", [("2024-11-05", True), ("2025-11-25", False)])
async def test_an_over_size_line_is_refused_with_the_id_rule_of_the_revision(daemon: Daemon, version: str,
                                                                           has_null_id: bool) -> None:
    init = req("initialize", {"protocolVersion": version, "capabilities": {}}, id=0)

    async def script(c: Conversation) -> None:
        await c.send(init)
        await c.send(padded_ping(MAX_LINE + 10) + b"\n")
        await c.send(req("ping", id=10))
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    errors = [m for m in conv.messages() if "error" in m]
    assert len(errors) == 1 and "limit" in errors[0]["error"]["message"]
    assert ("id" in errors[0]) is has_null_id
    if has_null_id:
        assert errors[0]["id"] is None
    assert conv.responses()[key(10)]["result"] == {}


async def test_fuzz_every_request_with_an_id_gets_exactly_one_answer_however_the_bytes_are_cut(daemon: Daemon) -> None:
    import random

    rng = random.Random(20261124)
    for round_ in range(12):
        version = rng.choice(["2024-11-05", "2025-03-26", "2025-11-25"])
        lines = [req("initialize", {"protocolVersion": version, "capabilities": {}}, id="init")]
        expected: list[str] = ["init"]
        batch_ids: list[str] = []
        for n in range(rng.randint(5, 25)):
            rid = f"r{round_}-{n}"
            kind = rng.choice(["ping", "call", "unknown", "bad_params", "garbage", "notify", "batch"])
            if kind == "ping":
                lines.append(req("ping", id=rid))
            elif kind == "call":
                lines.append(req("tools/call", {"name": "echo", "arguments": {"text": rid}}, id=rid))
            elif kind == "unknown":
                lines.append(req("no/such", id=rid))
            elif kind == "bad_params":
                lines.append(req("tools/call", {"name": 5}, id=rid))
            elif kind == "garbage":
                lines.append(rng.choice([b"{", b"[1,2", b"\xff\xfe", b"null", b'{"id": 1'] ) + b"\n")
                continue
            elif kind == "notify":
                lines.append(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                         "params": {"requestId": "nobody"}}).encode() + b"\n")
                continue
            else:
                if version != "2025-03-26":
                    continue
                members = [{"jsonrpc": "2.0", "id": f"{rid}.{k}", "method": "ping"} for k in range(3)]
                members.append({"jsonrpc": "2.0", "method": "initialize"})
                lines.append(json.dumps(members).encode() + b"\n")
                batch_ids += [m["id"] for m in members if "id" in m]
                continue
            expected.append(rid)
        stream = b"".join(lines)
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(1, 40))))

        async def script(c: Conversation, stream: bytes = stream, cuts: list[int] = cuts) -> None:
            start = 0
            for cut in cuts + [len(stream)]:
                await c.send(stream[start:cut])
                start = cut
                await trio.sleep(0)
            await trio.sleep(0.3)
            await c.hang_up()

        conv = await converse(daemon, script)
        answered: dict[str, int] = {}
        for message in conv.messages():
            for item in message if isinstance(message, list) else [message]:
                if "method" not in item and isinstance(item.get("id"), str):
                    answered[item["id"]] = answered.get(item["id"], 0) + 1
        for rid in expected + batch_ids:
            assert answered.get(rid) == 1, f"round {round_}: {rid} answered {answered.get(rid, 0)} times"
        assert set(answered) <= set(expected + batch_ids)


async def test_a_batch_members_id_follows_the_in_flight_rule_and_a_cancel_stops_it(daemon: Daemon) -> None:
    """Batch members run like single calls: a second member (or request) with an id in flight is
    refused -32600, and ``notifications/cancelled`` stops a member (no answer for it in the array)."""
    batch = json.dumps([
        {"jsonrpc": "2.0", "id": "s", "method": "tools/call", "params": {"name": "slow", "arguments": {"seconds": 5}}},
        {"jsonrpc": "2.0", "id": "s", "method": "tools/call", "params": {"name": "b_echo", "arguments": {"text": "dup"}}},
        {"jsonrpc": "2.0", "id": "e", "method": "tools/call", "params": {"name": "b_echo", "arguments": {"text": "e"}}},
    ]).encode() + b"\n"

    async def script(c: Conversation) -> None:
        await c.send(INIT_0326 + batch)
        await trio.sleep(0.3)
        await c.send(req("tools/call", {"name": "b_echo", "arguments": {"text": "again"}}, id="s"))
        await c.wait_for_line_count(2)
        started = trio.current_time()
        await c.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": "s"}}).encode() + b"\n")
        await c.wait_for_line_count(3)
        assert trio.current_time() - started < 4  # not the 5 s the slow member would take
        await c.hang_up()

    conv = await converse(daemon, script)
    messages = conv.messages()
    single = messages[1]
    assert single["id"] == "s" and single["error"]["code"] == -32600
    array = messages[2]
    assert isinstance(array, list)
    assert [m["id"] for m in array] == ["s", "e"]  # the refused duplicate and e; the cancelled s has no answer
    assert array[0]["error"]["code"] == -32600 and text_of(array[1]) == "e"


async def test_a_batch_over_the_message_cap_is_refused_whole(daemon: Daemon) -> None:
    from runtime.protocol.core import MAX_BATCH_MESSAGES

    # Members that are not requests at all (each answered -32600): the cap counts messages, and
    # these keep the line under this daemon's small size cap.
    batch = json.dumps([0] * (MAX_BATCH_MESSAGES + 1)).encode() + b"\n"
    just = json.dumps([0] * MAX_BATCH_MESSAGES).encode() + b"\n"

    async def script(c: Conversation) -> None:
        await c.send(INIT_0326 + batch + just)
        await c.wait_for_line_count(3)
        await c.hang_up()

    conv = await converse(daemon, script)
    refused, served = conv.messages()[1:]
    assert refused["id"] is None and refused["error"]["code"] == -32600
    assert f"at most {MAX_BATCH_MESSAGES} messages" in refused["error"]["message"]
    assert isinstance(served, list) and len(served) == MAX_BATCH_MESSAGES


async def test_an_embedded_daemon_leaves_the_sigchld_handler_as_it_found_it(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    """The reaper installs a Python-level SIGCHLD handler; left behind, every later SIGCHLD of the host
    (here: pytest) wrote to the signal wake-up fd, which trio closes before restoring it when a run
    ends: an "Exception ignored" (EBADF / EPIPE) failed whatever test ran then."""
    import signal

    assert signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None)
    plugins = make_plugin("probe", probe_plugins.PROBE, limits={"timeout_s": 10, "max_concurrency": 1})
    cfg = load_config(None, {"plugins": [str(plugins)], "policy": "none", "watch": False,
                             "state_dir": str(tmp_path / "state"), "log_level": "error"})
    async with open_daemon(cfg):
        assert signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, None)  # the reaper's, while it runs
    assert signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None)
