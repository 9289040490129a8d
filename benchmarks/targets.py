"""The servers ``run.py`` knows by name, and parsing of ``--target`` commands for any other server.

Every target is a command line that serves MCP on stdio, plus the directory to run it in.
Commands use the benchmark's own interpreter (``sys.executable``) so the versions recorded
beside the results are the versions that ran, except fastmcp, which lives in its own venv
because it must not change the project's ``mcp`` pin.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import msgspec

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
FASTMCP_PYTHON_DEFAULT = "/tmp/fastmcp-venv/bin/python"


class Target(msgspec.Struct, frozen=True):
    """A server under test: a short label, its argv and its working directory."""

    name: str
    argv: list[str]
    cwd: str = str(REPO_ROOT)
    description: str = ""


def fastmcp_python() -> str | None:
    """The interpreter that has ``fastmcp`` installed, or None when there is none."""
    candidate = os.environ.get("FASTMCP_PYTHON", FASTMCP_PYTHON_DEFAULT)
    return candidate if os.access(candidate, os.X_OK) else None


def builtin_targets(plugins_dir: str) -> dict[str, Target]:
    """The named servers: toolcell, the official SDK, fastmcp (if installed) and the inline fake."""
    py = sys.executable
    targets = {
        "toolcell": Target(
            "toolcell",
            [py, "-m", "runtime.cli", "serve", "--stdio", "--plugins", plugins_dir],
            description="toolcell daemon, tool calls run in sandboxed worker processes",
        ),
        "sdk": Target(
            "sdk",
            [py, str(BENCH_DIR / "peers" / "sdk_server.py")],
            description="official MCP Python SDK (MCPServer), tool runs in-process",
        ),
        "fake": Target(
            "fake",
            [py, str(BENCH_DIR / "fake_server.py")],
            description="inline msgspec responder (harness self-test and client ceiling)",
        ),
    }
    fastmcp_py = fastmcp_python()
    if fastmcp_py is not None:
        targets["fastmcp"] = Target(
            "fastmcp",
            [fastmcp_py, str(BENCH_DIR / "peers" / "fastmcp_server.py")],
            description="fastmcp over stdio, tool runs in-process",
        )
    return targets


_NAMED = re.compile(r"^([A-Za-z][\w.-]*)=(.+)$", re.DOTALL)


def parse_target(spec: str, index: int) -> Target:
    """Turn ``--target "CMD ..."`` or ``--target "NAME=CMD ..."`` into a Target run from the current directory."""
    name = f"target{index}" if index > 1 else "target"
    match = _NAMED.match(spec)
    if match and " " not in match.group(1):
        name, spec = match.group(1), match.group(2)
    argv = shlex.split(spec)
    if not argv:
        raise ValueError(f"empty --target command: {spec!r}")
    return Target(name, argv, cwd=os.getcwd(), description=spec)


def resolve(names: list[str], target_specs: list[str], plugins_dir: str) -> list[Target]:
    """The servers to run, in order: named ones first, then every ``--target``."""
    known = builtin_targets(plugins_dir)
    chosen: list[Target] = []
    for name in names:
        if name not in known:
            hint = " (install it: see benchmarks/peers/fastmcp_server.py)" if name == "fastmcp" else ""
            raise ValueError(f"unknown server {name!r}{hint}; known: {', '.join(sorted(known))}")
        chosen.append(known[name])
    chosen += [parse_target(spec, i) for i, spec in enumerate(target_specs, start=1)]
    labels = [t.name for t in chosen]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate server names: {labels}")
    return chosen
