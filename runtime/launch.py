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
import stat

from runtime import installer, plugin_files
from runtime.manifest import Manifest
from runtime.plugin_files import excerpt
from runtime.server_spec import parse_package

#: Read at start-up by the Node runtime.
NODE_READ = ("/etc/ssl/openssl.cnf",)
#: Read by Python's ssl module and by most HTTP clients (certificates).
PYTHON_READ = ("/etc/ssl/certs", "/usr/share/ca-certificates")
MAX_SHEBANG_HOPS = 4


class LaunchError(Exception):
    """The server's command cannot be resolved; the message says why."""


def _which(name: str) -> str:
    found = installer.which(name)  # PATH's absolute entries only: never the daemon's working directory
    if found is None:
        raise LaunchError(f"{name!r} is not on the daemon's PATH")
    return found


def _in_folder(relative: str, plugin_dir: str, what: str) -> str:
    """``relative`` as a regular file beneath the plugin folder (``runtime.plugin_files``), absolute."""
    try:
        fd = plugin_files.open_beneath(plugin_dir, relative)
    except plugin_files.PluginFileError as exc:
        raise LaunchError(f"{what}: {exc.reason}") from None
    if fd is None:
        raise LaunchError(f"{what}: no such file in the plugin folder")
    os.close(fd)
    return os.path.join(plugin_dir, os.path.normpath(relative))


def _interpreter(name: str, path: str, plugin_dir: str) -> str:
    """The program a ``#!`` line names. A relative one is a file of the plugin folder: the kernel would
    look it up in the working directory of whoever execs the script, which is nobody's choice here
    (it used to be the daemon's own)."""
    if os.path.isabs(name):
        return name
    return _in_folder(name, plugin_dir, f"{path}: the '#!' interpreter {excerpt(name)} (a relative "
                                        f"interpreter is a file of the plugin folder; use #!/usr/bin/env NAME "
                                        f"for a program on PATH)")


def _executable(first: str, plugin_dir: str) -> str:
    if os.path.isabs(first):
        path = first
    elif "/" in first:  # a file of the plugin folder: no link, no FIFO, beneath it (runtime.plugin_files)
        return _in_folder(first, plugin_dir, excerpt(first))
    else:
        path = _which(first)
    if not os.path.isfile(path):
        raise LaunchError(f"{first!r}: no such file")
    return path


def _open_head(path: str, plugin_dir: str) -> int:
    """An fd on ``path`` for reading its ``#!`` line: a file of the plugin folder as every plugin file
    is opened (``runtime.plugin_files``); any other only if it is a regular file, and without blocking."""
    rel = os.path.relpath(path, plugin_dir)
    if not os.path.isabs(rel) and not rel.startswith(".."):
        try:
            fd = plugin_files.open_beneath(plugin_dir, rel)
        except plugin_files.PluginFileError as exc:
            raise LaunchError(f"{rel!r}: {exc.reason}") from None
        if fd is None:
            raise LaunchError(f"{rel!r}: no such file")
        return fd
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise LaunchError(f"{path}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise LaunchError(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LaunchError(f"{path}: not a regular file")
    return fd


def _shebang(path: str, plugin_dir: str) -> list[str] | None:
    fd = _open_head(path, plugin_dir)
    try:
        head = os.read(fd, 256)
    except OSError as exc:
        raise LaunchError(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
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
            raise LaunchError(f"{path}: '#!{excerpt(line)}' names no program")
        program = _which(rest[0]) if "/" not in rest[0] else _interpreter(rest[0], path, plugin_dir)
        return [program, *rest[1:]]
    return [_interpreter(parts[0], path, plugin_dir), *parts[1:2]]


def resolve(argv: list[str], plugin_dir: str) -> tuple[list[str], list[str]]:
    """The argv to ``execve`` and the files it needs to read; raises ``LaunchError``."""
    if not argv:
        raise LaunchError("no command")
    argv = [_executable(argv[0], plugin_dir), *argv[1:]]
    reads: list[str] = []
    for _ in range(MAX_SHEBANG_HOPS):
        reads.append(os.path.realpath(argv[0]))
        interpreter = _shebang(argv[0], plugin_dir)
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
        argv, reads = await _resolve_off_loop([*installed.argv, *server.args], plugin_dir)
        return argv, [installed.path, *installed.read, *reads]
    return await _resolve_off_loop([*server.command, *server.args], plugin_dir)


async def _resolve_off_loop(argv: list[str], plugin_dir: str) -> tuple[list[str], list[str]]:
    """``resolve`` reads files of a hostile folder: in a thread, under ``plugin_files``' deadline."""
    try:
        return await plugin_files.off_loop(resolve, argv, plugin_dir, what="resolving the server's command")
    except plugin_files.PluginFileError as exc:
        raise LaunchError(exc.reason) from None
