"""``toolcell call NAME ARGS``: one tool call through a real daemon and worker, printed.

When the tool is unknown, the command says what the name may have meant: the catalog's names
closest to it ("did you mean"), and a plugin held for approval whose tools would carry that name's
prefix, with the command that approves it (a client only ever sees an unknown tool).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any

import trio

from runtime import __version__
from runtime.config import Config
from runtime.connection import run_call
from runtime.daemon import open_daemon
from runtime.plugins import awaiting_approval
from runtime.protocol.core import ConnState, Reply, ToolCall

async def _call(cfg: Config, name: str, arguments: Any, config_path: str | None = None) -> tuple[int, Any, list[str]]:
    """(exit code, the result or error, hints for an unknown tool; ``config_path``: the ``--config`` given)."""
    async with open_daemon(cfg, replica=False) as daemon:
        state = ConnState()
        core = daemon.core
        core.receive(state, json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "toolcell-cli", "version": __version__}}}).encode())
        request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"name": name, "arguments": arguments, "_meta": {"progressToken": "cli"}}}
        action = core.receive(state, json.dumps(request).encode())

        def emit(data: bytes) -> None:
            print(data.decode(), file=sys.stderr)

        if isinstance(action, ToolCall):
            data = await run_call(daemon, action, emit=emit)
        else:
            assert isinstance(action, Reply) and action.data is not None
            data = action.data
        msg = json.loads(data)
        if "error" in msg:
            unknown = str(msg["error"].get("message", "")).startswith("Unknown tool")
            hints = unknown_tool_hints(name, [e.name for e in daemon.catalog.entries], daemon.failed,
                                       cfg.plugins, config_path) if unknown else []
            return 2, msg["error"], hints
        return (1 if msg["result"].get("isError") else 0), msg["result"], []


def unknown_tool_hints(name: str, known: list[str], refused: list[Any], plugin_dirs: list[str],
                       config_path: str | None = None) -> list[str]:
    """What an unknown tool name may have meant: held plugins it may belong to, then close names. The
    approve command it suggests names the config file too: its ``state_dir`` is where approvals live."""
    hints = []
    held = [p for p in refused if p.manifest is not None and awaiting_approval(p)]
    mine = [p for p in held if p.manifest.prefix and name.startswith(p.manifest.prefix)]
    flags = "".join(f" --plugins {d}" for d in plugin_dirs) + (f" --config {config_path}" if config_path else "")
    for p in mine or held:
        reason = (p.problems or p.reload_error or ["held"])[0]
        tools = f" (its tools begin with {p.manifest.prefix!r})" if p.manifest.prefix else ""
        hints.append(f"plugin {p.manifest.name!r}{tools} is held until approved: {reason}\n"
                     f"  approve it with: toolcell approve {p.manifest.name}{flags}")
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.8)
    if close:
        hints.append("did you mean: " + ", ".join(close) + "?")
    elif not held:
        hints.append("`toolcell list` shows every tool")
    return hints


def run_call_command(cfg: Config, args: argparse.Namespace) -> int:
    try:
        arguments = json.loads(args.arguments) if args.arguments else {}
    except json.JSONDecodeError as exc:
        print(f"toolcell call: arguments are not valid JSON: {exc}", file=sys.stderr)
        return 2
    code, result, hints = trio.run(_call, cfg, args.name, arguments, args.config)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    for hint in hints:
        print(f"toolcell call: {hint}", file=sys.stderr)
    return code
