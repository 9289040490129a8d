"""``toolcell add ./server.json``: an entry of the official MCP Registry as a hosted plugin.

A registry entry (``server.json``) names the packages a server is published as. toolcell hosts npm and
PyPI packages, run over stdio, so the first such package is used; OCI images, NuGet, MCPB bundles and
remote (HTTP) servers are refused with the reason. Its ``packageArguments`` become the server's
arguments: a fixed ``value`` as it is; an argument without one takes, in order, a ``--arg`` given on
the command line, the answer of a person at a terminal, its ``default``; a required argument with none
of these is an error that says how to give it. Its ``environmentVariables`` map to the environment
allowlist: a secret (``isSecret``) is never written into the plugin folder -- it is passed from the
daemon's environment, and so is a variable without a default -- while a plain default is set. Both the
current (camelCase) and the first (snake_case) spellings of the format are read. Everything in the
file is untrusted: each value is checked before it becomes an argument, a package or a name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from runtime import plugin_files

#: server.json files are a few kilobytes; anything far larger is not one.
MAX_BYTES = 1024 * 1024
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SNAKE = re.compile(r"_([a-z])")
#: Printable text with line breaks and tabs (a description may have them); no other control character.
_PLAIN = re.compile(r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]*$")


class RegistryProblem(Exception):
    """A server.json that cannot become a plugin; the message says why and what to do."""


@dataclass
class RegistryServer:
    """What ``toolcell add`` needs from a registry entry."""

    #: The entry's name (``io.github.owner/server``) and description.
    name: str
    description: str
    #: The ``[server]`` table: ``package`` (pinned when the entry gives a version) and ``args``.
    server: dict[str, Any]
    #: Variables passed from the daemon's environment, and fixed values.
    env_allow: list[str] = field(default_factory=list)
    env_set: dict[str, str] = field(default_factory=dict)
    #: Sentences for the person adding it (which secrets the daemon must have, what was skipped).
    notes: list[str] = field(default_factory=list)


def _camel(data: Any) -> Any:
    """The first spelling of the format (``registry_type``) in the current one (``registryType``)."""
    if isinstance(data, dict):
        return {_SNAKE.sub(lambda m: m.group(1).upper(), str(k)): _camel(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_camel(v) for v in data]
    return data


def _text(value: Any, what: str, limit: int = 4096) -> str:
    # No control characters: these strings are shown at the terminal (questions, notes), where an
    # escape sequence could rewrite what the person reads (or set the clipboard, the window title).
    if not isinstance(value, str) or len(value) > limit or not (value.isprintable() or _PLAIN.match(value)):
        raise RegistryProblem(f"{what} is not a string of at most {limit} characters without control characters")
    return value


def _shown(value: Any, limit: int = 2000) -> str:
    """A value of the file as shown to a person at a terminal: control characters escaped."""
    text = str(value)[:limit]
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def read_server_json(path: Path, given_args: list[str], ask: Callable[[str, str], str]) -> RegistryServer:
    """The registry entry at ``path`` as a hosted server. ``given_args`` are ``--arg`` values for the
    arguments the entry leaves open, in order; ``ask(question, default)`` asks a person (or returns
    the default). Raises ``RegistryProblem``."""
    # A server.json may come with a cloned repository: followed to where it leads (realpath opens
    # nothing), then read as a plugin's files are: a regular file only (never a FIFO or a device),
    # without blocking, capped.
    real = os.path.realpath(path)
    try:
        raw = plugin_files.read_bytes(os.path.dirname(real), os.path.basename(real), MAX_BYTES)
        if raw is None:
            raise RegistryProblem(f"{path}: no such file")
        data = _camel(json.loads(raw))
    except plugin_files.PluginFileError as exc:
        raise RegistryProblem(f"{path}: {exc.reason}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RegistryProblem(f"{path}: cannot read it as JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("server"), dict):
        data = data["server"]  # as the registry's API returns an entry: {"server": {...}, "_meta": {...}}
    if not isinstance(data, dict) or "name" not in data:
        raise RegistryProblem(f"{path}: not an MCP Registry server.json (no name)")
    name = _text(data["name"], "name", 200)
    description = _text(data.get("description", ""), "description", 2000)
    packages = data.get("packages") or []
    if not isinstance(packages, list):
        raise RegistryProblem(f"{path}: packages is not a list")
    usable = [p for p in packages if isinstance(p, dict) and p.get("registryType") in ("npm", "pypi")
              and _transport(p.get("transport")) == "stdio"]
    if not usable:
        kinds = sorted({_shown(p.get("registryType"), 40) for p in packages if isinstance(p, dict)})
        remote = " and remote (HTTP) endpoints, which a client reaches directly" if data.get("remotes") else ""
        raise RegistryProblem(f"{name}: no npm or PyPI package run over stdio (it has: {', '.join(kinds) or 'none'}"
                              f"{remote}); toolcell hosts npm and PyPI servers")
    package = usable[0]
    notes = []
    spec = _package_spec(package)
    if len(packages) > 1:
        notes.append(f"the entry has {len(packages)} packages; using {spec}")
    server = {"package": spec, "args": _arguments(package, list(given_args), ask)}
    allow, fixed, env_notes = _environment(package)
    return RegistryServer(name, description, server, allow, fixed, notes + env_notes)


def _transport(transport: Any) -> Any:
    """The transport type a package entry names ("stdio" when it names none)."""
    if transport is None:
        return "stdio"
    return transport.get("type", "stdio") if isinstance(transport, dict) else transport


def _package_spec(package: dict[str, Any]) -> str:
    identifier = _text(package.get("identifier"), "package identifier", 214)
    version = package.get("version") or ""
    version = _text(version, "package version", 100) if version else ""
    if version in ("latest", "*"):
        version = ""
    if package["registryType"] == "npm":
        return f"npm:{identifier}@{version}" if version else f"npm:{identifier}"
    return f"pypi:{identifier}=={version}" if version else f"pypi:{identifier}"


def _arguments(package: dict[str, Any], given: list[str], ask: Callable[[str, str], str]) -> list[str]:
    runtime = package.get("runtimeArguments") or []
    if runtime:
        raise RegistryProblem("the entry needs runtime arguments for its runner (npx/uvx flags): toolcell installs "
                              "and runs the package itself; add it with toolcell add npm:/pypi: and --arg instead")
    argv: list[str] = []
    items = package.get("packageArguments") or []
    if not isinstance(items, list):
        raise RegistryProblem("packageArguments is not a list")
    for item in items:
        if not isinstance(item, dict):
            raise RegistryProblem("an entry of packageArguments is not an object")
        kind = item.get("type")
        flag = _text(item.get("name"), "argument name", 200) if kind == "named" else ""
        label = _shown(item.get("valueHint") or flag.lstrip("-") or "value", 200)
        value = item.get("value")
        if value is None:
            default = item.get("default")
            about = f" ({_shown(item['description'])})" if isinstance(item.get("description"), str) else ""
            if given:
                value = given.pop(0)
            else:
                value = ask(f"{label}{about}", _text(str(default), f"the default of {label!r}")
                            if default is not None else "")
            if not value:
                if item.get("isRequired"):
                    raise RegistryProblem(f"the argument {label!r}{about} is required: give it with --arg VALUE "
                                          "(one --arg per open argument, in order)")
                continue
        value = _text(value, f"argument {label!r}")
        argv += [flag, value] if flag else [value]
    if given:
        argv += given  # more --arg values than the entry leaves open: appended, as for npm:/pypi:
    return argv


def _environment(package: dict[str, Any]) -> tuple[list[str], dict[str, str], list[str]]:
    allow: list[str] = []
    fixed: dict[str, str] = {}
    secrets: list[str] = []
    needed: list[str] = []
    variables = package.get("environmentVariables") or []
    if not isinstance(variables, list):
        raise RegistryProblem("environmentVariables is not a list")
    for var in variables:
        if not isinstance(var, dict):
            raise RegistryProblem("an entry of environmentVariables is not an object")
        name = _text(var.get("name"), "variable name", 200)
        if not _ENV_NAME.match(name):
            raise RegistryProblem(f"environment variable {name!r} is not a variable name")
        default = var.get("default", var.get("value"))
        if var.get("isSecret"):
            allow.append(name)  # never written into the plugin folder
            secrets.append(name)
        elif default is not None:
            fixed[name] = _text(str(default), f"the default of {name}")
        else:
            allow.append(name)
            if var.get("isRequired"):
                needed.append(name)
    notes = []
    if secrets:
        notes.append(f"secrets ({', '.join(secrets)}) are passed from the daemon's environment, never written into "
                     "the plugin folder: set them where the daemon runs")
    if needed:
        notes.append(f"required variables without a default ({', '.join(needed)}) are passed from the daemon's "
                     "environment too (or set one with --env VAR=VALUE)")
    return allow, fixed, notes
