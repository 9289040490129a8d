"""The ``[server]`` table of a manifest of kind "server", and package specs, checked strictly.

A hosted server is an existing MCP server run inside a worker sandbox (``runtime.execution.hosted``)::

    name = "files"
    version = "1.0.0"
    kind = "server"
    prefix = "fs_"

    [server]
    package = "npm:@modelcontextprotocol/server-filesystem@2026.8.31"   # or "pypi:mcp-server-time==2026.1.26"
    # command = ["/usr/bin/node", "server.js"]   # or any executable instead of a package
    args = ["/srv/shared"]
    instances = 1             # server processes sharing the calls
    per_principal = false     # true: every principal (token) gets instances of its own

Names and versions given to installers are checked here, before any command line is built from them:
an npm name is ``[@scope/]name`` in lowercase, a PyPI name is a PEP 508 name, a version is exact.
Nothing that starts with ``-`` or holds a path separator, a URL or a space reaches npm or uv.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from runtime.plugin_files import excerpt

_NPM_NAME = re.compile(r"^(@[a-z0-9][a-z0-9._~-]{0,100}/)?[a-z0-9][a-z0-9._~-]{0,100}$")
_NPM_VERSION = re.compile(r"^\d{1,9}\.\d{1,9}\.\d{1,9}(-[0-9A-Za-z.-]{1,64})?(\+[0-9A-Za-z.-]{1,64})?$")
_PYPI_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,100}[A-Za-z0-9])?$")
_PYPI_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!_-]{0,63}$")
_BIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


class ServerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: An executable and its arguments (``command[0]``: an absolute path, a name looked up on the
    #: daemon's PATH, or a path relative to the plugin folder).
    command: list[str] = []
    #: ``npm:NAME@VERSION`` or ``pypi:NAME==VERSION``: installed into the state dir, then run.
    package: str = ""
    #: Which executable of the package (default: the only one, or the one named like the package).
    bin: str = ""
    #: Arguments appended to the command (or to the package's executable).
    args: list[str] = []
    #: Server processes sharing the calls (each one up to ``limits.max_concurrency`` calls at once).
    instances: int = 1
    #: One set of instances per principal: two clients never share a server's state.
    per_principal: bool = False
    #: Most principals with instances of their own at once (more are answered "busy").
    max_principals: int = 16
    #: After a call is cancelled (or overran its deadline), how long the server has to show it is
    #: still responsive (answer a ping) before it is restarted.
    cancel_grace_s: float = 2.0
    #: Start-up: process, sandbox and MCP handshake.
    start_timeout_s: float = 30.0


@dataclass(frozen=True)
class Package:
    """A package pinned to one version: ``ecosystem`` is "npm" or "pypi"."""

    ecosystem: str
    name: str
    version: str

    def __str__(self) -> str:
        return f"npm:{self.name}@{self.version}" if self.ecosystem == "npm" else f"pypi:{self.name}=={self.version}"


def parse_package(spec: str, *, pinned: bool = True) -> Package:
    """``npm:@scope/name@1.2.3`` or ``pypi:name==1.2.3`` (``pinned=False``: the version may be left out,
    as ``toolcell add`` accepts). Raises ``ValueError`` saying what is wrong."""
    eco, sep, rest = spec.partition(":")
    if not sep or eco not in ("npm", "pypi"):
        raise ValueError(f"package {excerpt(spec)}: use npm:NAME@VERSION or pypi:NAME==VERSION")
    if eco == "npm":
        at = rest.rfind("@")
        name, version = (rest[:at], rest[at + 1:]) if at > 0 else (rest, "")
        if not _NPM_NAME.match(name):
            raise ValueError(f"package {excerpt(spec)}: {excerpt(name)} is not an npm package name")
        if version and not _NPM_VERSION.match(version):
            raise ValueError(f"package {excerpt(spec)}: version {excerpt(version)} is not an exact version (x.y.z)")
    else:
        name, eq, version = rest.partition("==")
        if not _PYPI_NAME.match(name):
            raise ValueError(f"package {excerpt(spec)}: {excerpt(name)} is not a PyPI project name")
        if eq and not _PYPI_VERSION.match(version):
            raise ValueError(f"package {excerpt(spec)}: version {excerpt(version)} is not an exact version")
        if eq and not version:
            raise ValueError(f"package {excerpt(spec)}: empty version")
    if pinned and not version:
        raise ValueError(f"package {excerpt(spec)}: pin a version ({'@x.y.z' if eco == 'npm' else '==x.y.z'})")
    return Package(eco, name if eco == "npm" else name.lower().replace("_", "-"), version)


def check_server(spec: ServerSpec | None) -> list[str]:
    """Every problem of a ``[server]`` table (empty when fine)."""
    if spec is None:
        return ["kind = \"server\" needs a [server] table with a command or a package"]
    problems: list[str] = []
    if bool(spec.command) == bool(spec.package):
        problems.append("server: give exactly one of command and package")
    if spec.package:
        try:
            parse_package(spec.package)
        except ValueError as exc:
            problems.append(f"server.{exc}")
    if spec.command:
        first = spec.command[0]
        if not first or first.startswith("-"):
            problems.append(f"server.command: {excerpt(first)} is not an executable")
    if spec.bin and not _BIN.match(spec.bin):
        problems.append(f"server.bin {excerpt(spec.bin)}: not an executable name")
    for arg in [*spec.command, *spec.args]:
        if "\0" in arg or len(arg) > 4096:
            problems.append("server: arguments may not hold NUL bytes or exceed 4096 characters")
            break
    if len(spec.command) + len(spec.args) > 256:
        problems.append("server: at most 256 arguments")
    if not 1 <= spec.instances <= 64:
        problems.append(f"server.instances = {spec.instances}: must be between 1 and 64")
    if not 1 <= spec.max_principals <= 1024:
        problems.append(f"server.max_principals = {spec.max_principals}: must be between 1 and 1024")
    if not 0.1 <= spec.cancel_grace_s <= 60:
        problems.append(f"server.cancel_grace_s = {spec.cancel_grace_s}: must be between 0.1 and 60")
    if not 1 <= spec.start_timeout_s <= 600:
        problems.append(f"server.start_timeout_s = {spec.start_timeout_s}: must be between 1 and 600")
    return problems


#: A requirement a plugin may declare: a PEP 508 name, optional extras and version specifiers. No
#: URLs, paths, markers or options (a requirements file may otherwise carry ``--index-url`` or ``-e``).
_REQUIREMENT = re.compile(
    r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,100}[A-Za-z0-9])?"
    r"(\[[A-Za-z0-9._-]{1,64}(,[A-Za-z0-9._-]{1,64}){0,15}\])?"
    r"((===?|~=|!=|<=|>=|<|>)[0-9A-Za-z.*+!_-]{1,64}(,(===?|~=|!=|<=|>=|<|>)[0-9A-Za-z.*+!_-]{1,64}){0,7})?$"
)


def check_requirements(requirements: list[str]) -> list[str]:
    problems = []
    if len(requirements) > 256:
        problems.append("dependencies: at most 256 requirements")
    for req in requirements:
        if not _REQUIREMENT.match(req.replace(" ", "")):
            problems.append(f"dependencies: {excerpt(req)} is not a requirement toolcell installs (use NAME, NAME==1.2, "
                            "NAME[extra]>=1,<2: no URLs, paths, markers or options)")
    return problems
