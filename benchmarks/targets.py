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
    #: HTTP targets: the endpoint, with ``{port}`` standing for the port given to ``argv``.
    url: str | None = None


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
            [py, "-m", "runtime.bench.trivial_server"],
            description="the bench's trivial server (harness self-test and client ceiling)",
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


BENCH_TOKEN = "toolcell-bench-token-not-secret"


def toolcell_http_config(directory: str, plugins_dir: str) -> str:
    """A config for toolcell over HTTP as the issue measures it: a bearer token and rate limits
    on (per principal and per tool, set far above the load), no file watching."""
    import hashlib

    path = os.path.join(directory, "toolcell-bench.toml")
    digest = hashlib.sha256(BENCH_TOKEN.encode()).hexdigest()
    with open(path, "w") as f:
        f.write(f"""plugins = [{json_str(plugins_dir)}]
watch = false
log_level = "warning"

[http]
principal_rate = {{ per_s = 10000000, burst = 10000000 }}
tool_rate = {{ per_s = 10000000, burst = 10000000 }}

[[http.tokens]]
principal = "bench"
sha256 = "{digest}"
scopes = ["*"]
""")
    return path


def json_str(text: str) -> str:
    return msgspec.json.encode(text).decode()


def builtin_http_targets(plugins_dir: str, config_dir: str) -> dict[str, Target]:
    """The named servers over Streamable HTTP, each started on ``{port}``."""
    py = sys.executable
    config = toolcell_http_config(config_dir, plugins_dir)
    url = "http://127.0.0.1:{port}/mcp"
    targets = {
        "toolcell": Target(
            "toolcell", [py, "-m", "runtime.cli", "serve", "--config", config, "--http", "127.0.0.1:{port}"],
            description="toolcell daemon over HTTP (bearer token + rate limits on), calls in sandboxed workers",
            url=url),
        "sdk": Target(
            "sdk", [py, str(BENCH_DIR / "peers" / "sdk_server.py"), "--http", "--port", "{port}"],
            description="official MCP Python SDK, Streamable HTTP stateless + JSON responses (its fastest mode)",
            url=url),
    }
    fastmcp_py = fastmcp_python()
    if fastmcp_py is not None:
        targets["fastmcp"] = Target(
            "fastmcp", [fastmcp_py, str(BENCH_DIR / "peers" / "fastmcp_server.py"), "--http", "--port", "{port}"],
            description="fastmcp, Streamable HTTP stateless + JSON", url=url)
    return targets


def parse_http_target(spec: str, index: int, path: str) -> Target:
    """``--target "[NAME=]CMD"`` in HTTP mode: CMD serves on ``{port}``; or ``[NAME=]http://...``:
    an endpoint that is already running (measured without CPU or memory figures)."""
    name = f"target{index}" if index > 1 else "target"
    match = _NAMED.match(spec)
    if match and " " not in match.group(1) and "/" not in match.group(1):
        name, spec = match.group(1), match.group(2)
    if spec.startswith(("http://", "https://")):
        return Target(name, [], cwd=os.getcwd(), description=spec, url=spec)
    argv = shlex.split(spec)
    if not argv:
        raise ValueError(f"empty --target command: {spec!r}")
    if not any("{port}" in a for a in argv):
        raise ValueError(f"--target {spec!r}: an HTTP target command must contain {{port}} (where it listens)")
    return Target(name, argv, cwd=os.getcwd(), description=spec, url="http://127.0.0.1:{port}" + path)


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


def resolve(names: list[str], target_specs: list[str], plugins_dir: str, http_config_dir: str | None = None,
            http_path: str = "/mcp") -> list[Target]:
    """The servers to run, in order: named ones first, then every ``--target``. With
    ``http_config_dir`` the HTTP variants are chosen (configs written there)."""
    http = http_config_dir is not None
    known = builtin_http_targets(plugins_dir, http_config_dir) if http_config_dir is not None else builtin_targets(plugins_dir)
    chosen: list[Target] = []
    for name in names:
        if name not in known:
            hint = " (install it: see benchmarks/peers/fastmcp_server.py)" if name == "fastmcp" else ""
            raise ValueError(f"unknown server {name!r}{hint}; known: {', '.join(sorted(known))}")
        chosen.append(known[name])
    chosen += [parse_http_target(spec, i, http_path) if http else parse_target(spec, i)
               for i, spec in enumerate(target_specs, start=1)]
    labels = [t.name for t in chosen]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate server names: {labels}")
    return chosen
