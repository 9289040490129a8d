"""What a hosted server runs, resolved by the daemon before the sandbox exists.

``server_command`` turns a manifest's ``[server]`` table into an argv and the paths the sandbox must
let it read and execute: the package's environment (installed now if needed, ``runtime.installer``),
the executable found on the daemon's PATH, and the interpreter a script names on its ``#!`` line
(``#!/usr/bin/env node`` becomes ``node`` itself, so nothing is looked up inside the sandbox).

What a Node server needs beyond that: its own binary and libraries (``/usr/lib`` is on every
worker's read list) and ``/etc/ssl/openssl.cnf``, which Node reads at start-up (without it Node
exits: "OpenSSL configuration error"). Nothing else: the worker's seccomp filter already suits Node
(io_uring is refused with EPERM and libuv falls back to epoll and its thread pool; clone3 gets ENOSYS
and glibc falls back to clone; no socket is needed for stdio). RLIMIT_AS is not set for a hosted
server (``sandbox.isolation.rlimits``): V8 reserves far more address space than it uses, and the
cgroup memory limit accounts for what it really uses.
"""

from __future__ import annotations

import os
import shutil

from runtime import installer
from runtime.manifest import Manifest
from runtime.server_spec import parse_package

#: Read at start-up by the Node runtime.
NODE_READ = ("/etc/ssl/openssl.cnf",)
#: Read by Python's ssl module and by most HTTP clients (certificates).
PYTHON_READ = ("/etc/ssl/certs", "/usr/share/ca-certificates")
MAX_SHEBANG_HOPS = 4


class LaunchError(Exception):
    """The server's command cannot be resolved; the message says why."""


def _which(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"))
    if found is None:
        raise LaunchError(f"{name!r} is not on the daemon's PATH")
    return found


def _executable(first: str, plugin_dir: str) -> str:
    if os.path.isabs(first):
        path = first
    elif "/" in first:
        path = os.path.join(plugin_dir, first)
    else:
        path = _which(first)
    if not os.path.isfile(path):
        raise LaunchError(f"{first!r}: no such file")
    return path


def _shebang(path: str) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError as exc:
        raise LaunchError(f"{path}: {exc}") from None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    parts = line.split()
    if not parts:
        return None
    if os.path.basename(parts[0]) == "env":
        rest = parts[1:]
        if rest and rest[0] == "-S":
            rest = rest[1:]
        if not rest:
            raise LaunchError(f"{path}: '#!{line}' names no program")
        return [_which(rest[0]), *rest[1:]]
    return [parts[0], *parts[1:2]] if len(parts) > 1 else [parts[0]]


def resolve(argv: list[str], plugin_dir: str) -> tuple[list[str], list[str]]:
    """The argv to ``execve`` and the files it needs to read; raises ``LaunchError``."""
    if not argv:
        raise LaunchError("no command")
    argv = [_executable(argv[0], plugin_dir), *argv[1:]]
    reads: list[str] = []
    for _ in range(MAX_SHEBANG_HOPS):
        reads.append(os.path.realpath(argv[0]))
        interpreter = _shebang(argv[0])
        if interpreter is None:
            break
        argv = [*interpreter, *argv]
    else:
        raise LaunchError(f"{argv[0]}: too many '#!' interpreters in a row")
    names = {os.path.basename(os.path.realpath(argv[0])), os.path.basename(argv[0])}
    if any(n == "node" or n.startswith("node") for n in names):
        reads += [p for p in NODE_READ if os.path.exists(p)]
    if any(n.startswith("python") for n in names):
        reads += [p for p in PYTHON_READ if os.path.exists(p)]
    return argv, reads


async def server_command(manifest: Manifest, plugin_dir: str, state_dir: str) -> tuple[list[str], list[str]]:
    """(argv, read grants) for a manifest of kind "server". Raises ``LaunchError`` / ``InstallError``."""
    server = manifest.server
    assert server is not None
    if server.package:
        installed = await installer.install_package(parse_package(server.package), state_dir, plugin_dir, server.bin)
        argv, reads = resolve([*installed.argv, *server.args], plugin_dir)
        return argv, [installed.path, *installed.read, *reads]
    return resolve([*server.command, *server.args], plugin_dir)
