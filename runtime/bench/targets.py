"""What can be benchmarked, and a target's life: start it, open it, prove it works, stop it.

Target specs (an optional ``NAME=`` prefix labels any of them):

* ``stdio:COMMAND`` — a server the bench starts and speaks to over stdin/stdout;
* ``http://HOST:PORT/PATH`` or ``https://...`` — a running server (no CPU or memory figures:
  it is not our process);
* ``http:COMMAND`` — a server the bench starts with ``{port}`` in COMMAND replaced by a free
  port, reached at ``http://127.0.0.1:{port}/mcp`` (``--path`` changes the path);
* ``toolcell:PLUGIN_DIR`` / ``toolcell+http:PLUGIN_DIR`` — toolcell itself serving that plugin
  folder over stdio / Streamable HTTP, started by the bench with its metrics on, so the report
  can say where a call's time goes (queue, channel, worker) per plugin;
* ``trivial`` / ``trivial+http`` — the bench's own trivial server (the client's ceiling).

Before any load, the correctness pass opens the target (legacy ``initialize``, or nothing in the
2026-07-28 era), walks ``tools/list`` to the end, and makes one checked call per operation of the
scenario: a target that fails any of it is reported broken, with why, and gets no load.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit

import msgspec

from runtime.bench import wire
from runtime.bench.http_client import Endpoint, HttpTarget
from runtime.bench.load import ListWalk, Op
from runtime.bench.procs import Server, free_port
from runtime.bench.scenario import CompiledCall
from runtime.bench.stdio_client import StdioConnection, TargetDown
from runtime.protocol.schemas import check_param_headers

#: What a server's tools/list may add up to, every page together: the bench keeps each tool's input
#: schema (for the Mcp-Param-* headers and the call checks). Past it the listing check fails.
MAX_LISTING_BYTES = 64 << 20
#: Pages of tools/list followed before the listing is called endless.
MAX_LISTING_PAGES = 1000

_NAMED = re.compile(r"^([A-Za-z][\w.+-]*)=(.+)$", re.DOTALL)
_KINDS = ("stdio:", "http:", "https:", "toolcell:", "toolcell+http:", "trivial")
_INTERPRETERS = {"python", "python3", "node", "npx", "uvx", "uv", "deno", "bun", "sh", "bash", "env", "exec"}


class TargetSpec(msgspec.Struct, frozen=True):
    """A target as the command line names it."""

    name: str
    spec: str
    transport: str  # "stdio" | "http"
    argv: list[str] = msgspec.field(default_factory=list)
    url: str | None = None
    cwd: str | None = None
    toolcell: str | None = None
    #: The ceiling's trivial server: measured beside the targets, never compared with them.
    ceiling: bool = False

    @property
    def local(self) -> bool:
        """Whether the bench starts (and so can measure) the server's processes."""
        return bool(self.argv)


def _default_name(kind: str, argv: list[str], url: str | None) -> str:
    if url is not None and not argv:
        return url.split("//", 1)[-1].split("/", 1)[0]
    for word in argv:
        base = os.path.basename(word)
        if word.startswith("-") or base in _INTERPRETERS or re.fullmatch(r"python3(\.\d+)?", base):
            continue
        return base
    return kind


def parse(spec: str, path: str = "/mcp") -> TargetSpec:
    """One target spec (see the module docstring); raises ValueError with what is wrong."""
    name = None
    if not spec.startswith(_KINDS):
        match = _NAMED.match(spec)
        if match:
            name, spec = match.group(1), match.group(2)
    cwd = os.getcwd()
    if spec.startswith(("http://", "https://")):
        return TargetSpec(name or _default_name("http", [], spec), spec, "http", url=spec)
    kind, sep, rest = spec.partition(":")
    if not sep:
        if spec in ("trivial", "trivial+http"):
            kind, rest = spec, ""
        else:
            raise ValueError(f"target {spec!r}: expected stdio:COMMAND, http:COMMAND, an http(s):// URL, "
                             "toolcell:PLUGIN_DIR, toolcell+http:PLUGIN_DIR or trivial")
    if kind == "stdio":
        argv = shlex.split(rest)
        if not argv:
            raise ValueError(f"target {spec!r}: empty command")
        return TargetSpec(name or _default_name("stdio", argv, None), spec, "stdio", argv=argv, cwd=cwd)
    if kind == "http":
        argv = shlex.split(rest)
        if not argv:
            raise ValueError(f"target {spec!r}: empty command")
        if not any("{port}" in a for a in argv):
            raise ValueError(f"target {spec!r}: an http: command must say where it listens with {{port}} "
                             "(for a running server give its URL, http://...)")
        return TargetSpec(name or _default_name("http", argv, None), spec, "http", argv=argv,
                          url="http://127.0.0.1:{port}" + path, cwd=cwd)
    if kind in ("toolcell", "toolcell+http"):
        folder = os.path.abspath(rest or ".")
        if not os.path.exists(folder):
            raise ValueError(f"target {spec!r}: plugin folder {folder} does not exist")
        http = kind == "toolcell+http"
        return TargetSpec(name or kind, spec, "http" if http else "stdio", argv=["toolcell"],
                          url="http://127.0.0.1:{port}/mcp" if http else None, cwd=cwd, toolcell=folder)
    if kind in ("trivial", "trivial+http"):
        http = kind == "trivial+http"
        argv = [sys.executable, "-m", "runtime.bench.trivial_server"] + (["--http", "--port", "{port}"] if http else [])
        return TargetSpec(name or kind, spec, "http" if http else "stdio", argv=argv,
                          url="http://127.0.0.1:{port}/mcp" if http else None, cwd=None)
    raise ValueError(f"target {spec!r}: unknown kind {kind!r}")


def unique_names(specs: list[TargetSpec]) -> list[TargetSpec]:
    """Labels made unique (``name``, ``name#2`` ...)."""
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        n = seen.get(s.name, 0) + 1
        seen[s.name] = n
        out.append(s if n == 1 else msgspec.structs.replace(s, name=f"{s.name}#{n}"))
    return out


def ceiling_spec(transport: str, tools: list[str]) -> TargetSpec:
    """The trivial server, listing ``tools``, as the client ceiling for ``transport``."""
    spec = parse("trivial+http" if transport == "http" else "trivial")
    argv = [*spec.argv, "--tools", ",".join(tools) or "echo"]
    return msgspec.structs.replace(spec, name=f"ceiling ({transport})", argv=argv, ceiling=True)


class CheckResult(msgspec.Struct):
    """One step of the correctness pass."""

    what: str
    ok: bool
    detail: str | None = None


class Live:
    """A started (or reached) target."""

    def __init__(self, spec: TargetSpec, modern: bool, headers: list[tuple[str, str]], insecure: bool,
                 phases: bool, timeout_s: float, workdir: str) -> None:
        self.spec = spec
        self.modern = modern
        self.headers = headers
        self.insecure = insecure
        self.phases = phases and spec.toolcell is not None
        self.timeout_s = timeout_s
        self.workdir = workdir
        self.conn: StdioConnection | HttpTarget | None = None
        self.server: Server | None = None
        self.ready_s = 0.0
        self.server_info: dict[str, Any] | None = None
        self.protocol_version: str | None = None
        self.tools: dict[str, dict[str, Any]] = {}
        self.checks: list[CheckResult] = []
        #: None while usable; else "broken: ..." (failed its correctness pass) or "down: ...".
        self.problem: str | None = None
        self.metrics_url: str | None = None

    # -- start and open --------------------------------------------------------------------------

    def _argv(self) -> tuple[list[str], str | None]:
        """The command to start (``{port}`` filled in) and the URL it will serve."""
        spec = self.spec
        if spec.toolcell is not None:
            config = self._toolcell_config()
            if spec.transport == "stdio":
                return [sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--config", config], None
            return [sys.executable, "-m", "runtime.cli", "serve", "--config", config, "--http",
                    "127.0.0.1:{port}"], spec.url
        return list(spec.argv), spec.url

    def _toolcell_config(self) -> str:
        path = os.path.join(self.workdir, f"toolcell-{abs(hash(self.spec.name))}.toml")
        lines = [f"plugins = [{wire._encoder.encode(self.spec.toolcell).decode()}]", "watch = false",
                 'log_level = "warning"', f"state_dir = {wire._encoder.encode(os.path.join(self.workdir, 'state')).decode()}",
                 "", "[http]"]
        if self.phases:
            port = free_port()
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
            lines.append(f'metrics_listen = "127.0.0.1:{port}"')
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def start(self) -> None:
        """Start the server (if it is ours) and open it; on failure ``problem`` says why."""
        started = time.monotonic()
        try:
            self._start()
            self._open()
        except TargetDown as exc:
            self.problem = f"down: {exc}"
        except (TimeoutError, OSError) as exc:
            self.problem = f"down: {exc}"
        self.ready_s = time.monotonic() - started

    def _start(self) -> None:
        argv, url = self._argv()
        env = None
        if self.spec.toolcell is not None:
            env = dict(os.environ)
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.spec.transport == "stdio":
            self.conn = StdioConnection(argv, self.spec.cwd, env)
            self.server = self.conn.server
            return
        assert url is not None
        if argv:
            port = free_port()
            argv = [a.replace("{port}", str(port)) for a in argv]
            url = url.replace("{port}", str(port))
            self.server = Server(argv, self.spec.cwd, stdio=False, env=env)
            self._wait_listening(url)
        self.conn = HttpTarget(Endpoint(url, self.headers, self.insecure), self.modern, self.server)

    def _wait_listening(self, url: str) -> None:
        parts = urlsplit(url)
        deadline = time.monotonic() + max(60.0, self.timeout_s)
        assert self.server is not None
        while True:
            if self.server.exited() is not None:
                tail = self.server.stderr_tail(800).strip()
                raise TargetDown(f"the server exited with {self.server.exited()} before listening"
                                 + (f"; its stderr ends: {tail}" if tail else ""))
            try:
                socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TargetDown(f"nothing listens at {url} after {deadline:g} s") from None
                time.sleep(0.05)

    def _request(self, method: str, params: dict[str, Any] | None, name: str | None = None) -> wire.Envelope | wire.Garbage:
        conn = self.conn
        if isinstance(conn, StdioConnection):
            return conn.roundtrip(lambda rid: wire.message(method, params, rid, self.modern), self.timeout_s)
        assert conn is not None
        return conn.request(method, params, self.timeout_s, name)

    def _open(self) -> None:
        conn = self.conn
        if self.modern:
            return
        if isinstance(conn, StdioConnection):
            reply = conn.roundtrip(lambda rid: wire.message("initialize", wire.initialize_params(), rid, False),
                                   max(60.0, self.timeout_s))
        else:
            assert conn is not None
            reply = conn.open_session(max(60.0, self.timeout_s))
        if isinstance(reply, wire.Garbage) or reply.error is not None or not len(reply.result):
            why = reply.reason if isinstance(reply, wire.Garbage) else (
                f"{reply.error.code}: {reply.error.message[:200]}" if reply.error else "no result")
            raise TargetDown(f"initialize failed: {why}")
        try:
            result = wire.decode_value(reply.result)
        except (msgspec.DecodeError, RecursionError):
            raise TargetDown("initialize answered a result that is not JSON") from None
        if isinstance(result, dict):
            info = result.get("serverInfo")
            self.server_info = info if isinstance(info, dict) else None
            version = result.get("protocolVersion")
            self.protocol_version = version if isinstance(version, str) else None
        if isinstance(conn, StdioConnection):
            conn.notify("notifications/initialized")

    # -- the correctness pass --------------------------------------------------------------------

    def check(self, ops: list[Op], labels: list[str]) -> None:
        """Walk tools/list, then one call per operation, each checked; ``problem`` on failure."""
        if self.problem is not None:
            return
        try:
            self._check(ops, labels)
        except TargetDown as exc:
            self.problem = f"down: {exc}"
        except (TimeoutError, OSError) as exc:
            self.checks.append(CheckResult("answers in time", False, str(exc)))
            self.problem = f"broken: {exc} (timeout {self.timeout_s:g} s)"
        if self.problem is None and any(not c.ok for c in self.checks):
            first = next(c for c in self.checks if not c.ok)
            self.problem = f"broken: {first.what}: {first.detail}"

    def _check(self, ops: list[Op], labels: list[str]) -> None:
        cursor: str | None = None
        seen: set[str] = set()
        pages = 0
        listed_bytes = 0
        while True:
            reply = self._request("tools/list", {"cursor": cursor} if cursor else ({} if self.modern else None))
            pages += 1
            if isinstance(reply, wire.Garbage):
                self.checks.append(CheckResult("tools/list", False, reply.reason))
                return
            listed_bytes += len(reply.result)
            if listed_bytes > MAX_LISTING_BYTES:
                self.tools.clear()
                self.checks.append(CheckResult("tools/list", False, f"the listing is over {MAX_LISTING_BYTES} bytes "
                                                                    f"after {pages} page(s)"))
                return
            kind, detail, page = wire.check_list_page(reply)
            if page is None:
                self.checks.append(CheckResult("tools/list", False, f"{kind}: {detail}"))
                return
            self._note_server_info(reply)
            for tool in page.tools:
                self.tools[tool.name] = tool.inputSchema
            cursor = page.nextCursor
            if not cursor:
                break
            if cursor in seen or pages >= MAX_LISTING_PAGES:
                self.checks.append(CheckResult("tools/list", False, "pagination does not end"))
                return
            seen.add(cursor)
        self.checks.append(CheckResult("tools/list", True, f"{len(self.tools)} tools in {pages} page(s)"))
        if isinstance(self.conn, HttpTarget):
            self.conn.param_headers = {}
            for name, schema in list(self.tools.items()):
                headers, problem = _param_headers(schema)
                if problem is not None:
                    # The spec: clients MUST drop a tool whose x-mcp-header annotations break its rules
                    # (a header name from the server goes into our request: no CR/LF, a token).
                    del self.tools[name]
                    self.checks.append(CheckResult("tools/list", False, f"{name[:100]!r} dropped: {problem[:300]}"))
                elif headers:
                    self.conn.param_headers[name] = headers
        for op, label in zip(ops, labels, strict=False):
            if isinstance(op, ListWalk):
                continue
            self.checks.append(self._check_call(op, label))

    def _check_call(self, op: CompiledCall, label: str) -> CheckResult:
        tool = op.spec.tool
        if tool not in self.tools:
            listed = ", ".join(sorted(self.tools)[:15])
            return CheckResult(label, False, f"{tool!r} is not listed (the server lists: {listed or 'nothing'})")
        variables = wire.Variables(0, op.used)
        expected = wire.render_text(op.text_template, variables) if op.text_template else op.static_text
        conn = self.conn
        if isinstance(conn, StdioConnection):
            reply = conn.roundtrip(lambda rid: op.template.render(rid, variables), self.timeout_s)
        else:
            assert conn is not None
            rid = conn.next_id
            conn.next_id += 1
            body = op.template.render(rid, variables)
            extra = conn.era_headers("tools/call", tool)
            for arg, header in conn.param_headers.get(tool, {}).items():
                if arg in op.spec.arguments:
                    value = op.spec.arguments[arg]
                    if isinstance(value, str):
                        value = wire.render_text(value, variables)
                    extra.append(f"Mcp-Param-{header}: {wire.header_value(value)}")
            status, _, msg = conn.roundtrip(body, extra, rid, self.timeout_s)
            if msg is None:
                return CheckResult(label, False, f"HTTP {status} with no JSON-RPC message")
            reply = msg
        if isinstance(reply, wire.Garbage):
            return CheckResult(label, False, reply.reason)
        kind, detail = wire.check_call(reply, op.check, expected)
        self._note_server_info(reply)
        return CheckResult(label, kind == wire.OK, None if kind == wire.OK else f"{kind}: {detail}")

    def _note_server_info(self, reply: wire.Envelope) -> None:
        if self.server_info is not None or not len(reply.result):
            return
        try:
            result = wire.decode_value(reply.result)
        except (msgspec.DecodeError, RecursionError):
            return
        meta = result.get("_meta") if isinstance(result, dict) else None
        info = meta.get("io.modelcontextprotocol/serverInfo") if isinstance(meta, dict) else None
        if isinstance(info, dict):
            self.server_info = info

    def stop(self) -> None:
        """Stop what we started."""
        if self.conn is not None:
            self.conn.close()
        elif self.server is not None:
            self.server.stop()

    @property
    def pid(self) -> int | None:
        """The server process's pid, when it is ours."""
        return self.server.pid if self.server is not None else None


def _param_headers(schema: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    """A tool's ``Mcp-Param-*`` headers (argument name -> header name), checked by the rules the
    daemon holds its own plugins to (``schemas.check_param_headers``); else the first problem."""
    if not isinstance(schema, dict):
        return {}, None
    problems: list[str] = []
    try:
        headers = check_param_headers(schema, "inputSchema", problems)
    except RecursionError:
        return {}, "inputSchema: nested too deeply to check its x-mcp-header annotations"
    if problems:
        return {}, problems[0]
    if not headers:
        return {}, None
    props = schema["properties"]
    return {prop: str(props[prop]["x-mcp-header"]) for prop, _kind in headers.values()}, None


def workdir() -> str:
    """A temporary directory for generated configs and state."""
    return tempfile.mkdtemp(prefix="toolcell-bench-")
