"""``toolcell add``, ``toolcell import`` and ``toolcell approve``: bringing tools in, with a person's approval.

* ``add npm:@scope/pkg[@version]`` / ``add pypi:pkg[==version]`` writes a hosted-server plugin folder
  (the newest version pinned when none is given), installs the package into the state dir (so its
  lock is known and shipped in the folder: ``package-lock.json`` or ``requirements.lock``), shows what
  it asks for and records the approval. ``add FOLDER`` copies an existing plugin folder in.
* ``import FILE`` reads a client's configuration -- Claude Desktop's ``claude_desktop_config.json``
  and ``.mcp.json`` (``mcpServers``), VS Code's ``mcp.json`` (``servers``, ``inputs``) -- and turns each
  stdio entry into such a plugin: ``npx -y PKG ARGS`` becomes ``npm:PKG`` (pinned, installed without
  scripts, run with no network unless granted), ``uvx [--from PKG] NAME ARGS`` becomes ``pypi:PKG``,
  any other command is kept as it is (found on PATH's absolute entries only, never in the current
  directory, and shown resolved with the approval prompt). ``env`` maps to the environment
  allowlist: a literal value is set for the server, ``${VAR}`` / ``${env:VAR}`` is taken from the
  daemon's environment, ``${input:ID}`` is asked for (or given with ``--env NAME.VAR=VALUE``). The paths
  and hosts each server needs are asked for interactively (paths its arguments name are offered), or
  given with ``--read/--write/--net NAME=VALUE``.
* ``approve NAME`` shows a plugin's grants (and what it asks beyond its last approval) and records them.

A folder is put together in the state dir (outside every plugins folder, so no daemon serves it while a
person is asked), and moved into its plugins folder with one rename only once the approval is recorded.

Nothing here runs untrusted code: installs go through ``runtime.installer`` (wheels only, no npm
scripts), and every name from a config file is checked before it becomes a folder, a package or an
argument (``runtime.server_spec``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import trio

from runtime import approvals, installer, plugin_files
from runtime.approvals_shared import book_for
from runtime.manifest import MANIFEST_NAME, ManifestError, load_manifest
from runtime.progress import progress
from runtime.registry_entry import RegistryProblem, read_server_json
from runtime.server_spec import parse_package
from runtime.config import BUNDLED_PLUGINS
from runtime.plugins import discover

_NAME_BAD = re.compile(r"[^a-z0-9_.-]+")
_VAR = re.compile(r"^\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)\}$")
_INPUT = re.compile(r"\$\{input:([A-Za-z0-9_.-]+)\}")
_NPX_VALUE_FLAGS = {"-p", "--package", "--cache", "--registry", "--userconfig"}
_UVX_VALUE_FLAGS = {"--from", "--with", "--python", "-p", "--index", "--index-url", "--extra-index-url",
                    "--with-requirements", "--constraint", "-c"}


class ImportProblem(Exception):
    """An entry that cannot become a plugin; the message says why."""


def plugin_name(raw: str) -> str:
    name = _NAME_BAD.sub("-", raw.lower().rsplit("/", 1)[-1]).strip("-._")[:64]
    if not name or not name[0].isalnum():
        raise ImportProblem(f"{raw!r} gives no usable plugin name")
    return name


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def manifest_text(name: str, description: str, server: dict[str, Any], env_allow: list[str],
                  env_set: dict[str, str], read: list[str], write: list[str], network: list[str]) -> str:
    # Each server's tools carry its name: servers aggregated side by side never fight over a tool name.
    prefix = (name[:31] + "_").replace("-", "_")
    lines = [f"name = {_toml(name)}", 'version = "1.0.0"', f"description = {_toml(description[:500])}",
             'kind = "server"', f"prefix = {_toml(prefix)}", "", "[server]"]
    lines += [f"{k} = {_toml(v)}" for k, v in server.items() if v not in ("", [], None)]
    lines += ["", "[env]", f"allow = {_toml(env_allow)}", f"set = {_toml(env_set)}",
              "", "[permissions]", f"read = {_toml(read)}", f"write = {_toml(write)}", f"network = {_toml(network)}", ""]
    return "\n".join(lines)


# -- client configs ---------------------------------------------------------------------------------


#: A client's config file is refused larger than this.
MAX_CLIENT_CONFIG_BYTES = 4 * 1024 * 1024


def read_client_config(path: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """(server entries by name, VS Code input descriptions by id) from a client's config file.

    The file may come with a cloned repository (``.mcp.json``): the name the person gave is followed to
    where it leads and read as a plugin's files are (``plugin_files.read_named_text``): a regular file
    only, never a FIFO or a device, without blocking, capped."""
    try:
        text = plugin_files.read_named_text(path, MAX_CLIENT_CONFIG_BYTES)
        if text is None:
            raise ImportProblem(f"{path}: no such file")
        data = json.loads(text)
    except plugin_files.PluginFileError as exc:
        raise ImportProblem(exc.reason) from None
    except (OSError, ValueError) as exc:
        raise ImportProblem(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ImportProblem(f"{path}: not a client configuration (a JSON object)")
    servers = data.get("mcpServers", data.get("servers"))
    if servers is None and isinstance(data.get("mcp"), dict):  # VS Code settings.json: {"mcp": {"servers": ...}}
        servers = data["mcp"].get("servers")
        data = data["mcp"]
    if not isinstance(servers, dict):
        raise ImportProblem(f"{path}: no mcpServers or servers object")
    inputs: dict[str, str] = {}
    for item in data.get("inputs", []) if isinstance(data.get("inputs"), list) else []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            inputs[item["id"]] = str(item.get("description", item["id"]))
    return {str(k): v for k, v in servers.items()}, inputs


def translate(entry: Any) -> tuple[dict[str, Any], list[str]]:
    """A config entry as a ``[server]`` table, and paths its arguments name. Raises ``ImportProblem``."""
    if not isinstance(entry, dict):
        raise ImportProblem("the entry is not an object")
    kind = entry.get("type", entry.get("transportType", "stdio"))
    if kind not in ("stdio", None) and "command" not in entry:
        raise ImportProblem(f"a {kind!r} server is remote: toolcell hosts stdio servers (connect to it directly)")
    command = entry.get("command")
    args = entry.get("args", [])
    if not isinstance(command, str) or not command:
        raise ImportProblem("no command")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ImportProblem("args must be a list of strings")
    base = os.path.basename(command).removesuffix(".cmd").removesuffix(".exe")
    if base in ("docker", "podman"):
        raise ImportProblem(f"{base} runs a container: toolcell does not host container images")
    server: dict[str, Any]
    if base == "npx":
        rest, pkg = _split_runner(args, _NPX_VALUE_FLAGS, "--package", "-p")
        server = {"package": _npm_spec(pkg), "args": rest}
    elif base == "uvx":
        rest, first = _split_runner(args, _UVX_VALUE_FLAGS, "--from", None)
        source = _flag_value(args, "--from")
        if source:
            server = {"package": _pypi_spec(source), "bin": first.partition("@")[0], "args": rest}
        elif first:
            server = {"package": _pypi_spec(first), "args": rest}
        else:
            raise ImportProblem("uvx names no package")
    else:
        server = {"command": [command_path(command)], "args": list(args)}
    server["args"] = [_expand(a) for a in server.get("args", [])]
    paths = [a for a in server["args"] if a.startswith("/") and os.path.isdir(a)]
    return server, paths


def command_path(command: str) -> str:
    """The absolute path of a config's ``command``: as given when absolute, else found on PATH's
    absolute entries only (``installer.which``) -- never in the directory the import runs from, where a
    cloned repository may have put its own ``./node``. A relative path names no place toolcell can know."""
    if os.path.isabs(command):
        return os.path.normpath(command)
    if "/" in command:
        raise ImportProblem(f"{command!r} is a path relative to wherever the client ran it: give an absolute path")
    found = installer.which(command)
    if found is None:
        raise ImportProblem(f"{command!r} is not on PATH here (only PATH's absolute entries are searched)")
    return found


def resolved_note(command: str, resolved: str) -> str:
    """The line shown with the approval prompt saying which program a config's command turned into."""
    real = os.path.realpath(resolved)
    return f"  command:  {command!r} in the config is {resolved}" + (f" (-> {real})" if real != resolved else "")


def _expand(arg: str) -> str:
    """VS Code's predefined variables that name places (the import runs from the workspace)."""
    return (arg.replace("${workspaceFolder}", os.getcwd()).replace("${userHome}", os.path.expanduser("~"))
            .replace("${pathSeparator}", "/"))


def _flag_value(args: list[str], flag: str) -> str:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return ""


def _split_runner(args: list[str], value_flags: set[str], pkg_flag: str, short: str | None) -> tuple[list[str], str]:
    """(the server's own arguments, the first positional) of an ``npx``/``uvx`` argument list."""
    i = 0
    explicit = ""
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-"):
            break
        flag = a.split("=", 1)[0]
        if flag in (pkg_flag, short) and "=" not in a and i + 1 < len(args):
            explicit = args[i + 1]
        elif flag == pkg_flag and "=" in a:
            explicit = a.split("=", 1)[1]
        i += 2 if (flag in value_flags and "=" not in a) else 1
    positional = args[i:]
    if pkg_flag == "--package":
        if explicit:
            return positional[1:], explicit
        if not positional:
            raise ImportProblem("npx names no package")
        return positional[1:], positional[0]
    name = positional[0] if positional else ""
    return positional[1:], name


def _npm_spec(raw: str) -> str:
    at = raw.rfind("@")
    name, version = (raw[:at], raw[at + 1:]) if at > 0 else (raw, "")
    if version in ("latest", "") or not re.match(r"^\d", version):
        version = ""
    spec = f"npm:{name}@{version}" if version else f"npm:{name}"
    try:
        parse_package(spec, pinned=False)
    except ValueError as exc:
        raise ImportProblem(str(exc)) from None
    return spec


def _pypi_spec(raw: str) -> str:
    name, _, version = raw.partition("==")
    if "@" in name:
        name, _, version = name.partition("@")
        version = "" if version == "latest" else version
    spec = f"pypi:{name}=={version}" if version else f"pypi:{name}"
    try:
        parse_package(spec, pinned=False)
    except ValueError as exc:
        raise ImportProblem(str(exc)) from None
    return spec


async def pin(server: dict[str, Any]) -> dict[str, Any]:
    """The same ``[server]`` table with its package pinned to the newest version when none was given."""
    spec = server.get("package")
    if not spec:
        return server
    pkg = parse_package(spec, pinned=False)
    if pkg.version:
        return server
    version = await installer.resolve_version(pkg.ecosystem, pkg.name)
    pinned = f"npm:{pkg.name}@{version}" if pkg.ecosystem == "npm" else f"pypi:{pkg.name}=={version}"
    parse_package(pinned)
    return {**server, "package": pinned}


# -- the commands --------------------------------------------------------------------------------------


class Asker:
    """Questions to a person at a terminal; with no terminal, the flags' answers only."""

    def __init__(self, assume_yes: bool) -> None:
        self.assume_yes = assume_yes
        self.interactive = sys.stdin.isatty() and not assume_yes

    def text(self, question: str, default: str = "") -> str:
        if not self.interactive:
            return default
        answer = input(f"{question} [{default}]: ").strip()
        return answer or default

    def confirm(self, question: str) -> bool:
        if self.assume_yes:
            return True
        if not self.interactive:
            print("toolcell: not approved (no terminal to ask; run again with --yes to approve)", file=sys.stderr)
            return False
        return input(f"{question} [y/N]: ").strip().lower() in ("y", "yes")


def _split_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _per_name(values: list[str] | None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in values or []:
        name, sep, value = v.partition("=")
        if not sep:
            raise ImportProblem(f"{v!r}: use NAME=VALUE")
        out.setdefault(name, []).append(value)
    return out


def _destination(args: argparse.Namespace, cfg: Any) -> Path:
    if args.into:
        into = Path(args.into)
    else:
        custom = [p for p in cfg.plugins if Path(p).resolve() != BUNDLED_PLUGINS.resolve()]
        if len(custom) != 1:
            raise ImportProblem("say which plugins folder to add to: --into DIR (or one --plugins folder in the config)")
        into = Path(custom[0])
    into.mkdir(parents=True, exist_ok=True)
    return into.resolve()


#: Where plugin folders are put together before a person approved them: under the state dir, outside
#: every plugins folder, so that no daemon can load a plugin while its approval is being asked.
STAGING = "staging"


def _staging(state_dir: str, name: str) -> Path:
    root = Path(state_dir) / STAGING
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root))


def _put_in_place(built: Path, folder: Path) -> None:
    """Move a finished, approved folder to ``folder`` in one rename (what a daemon discovers is either the
    old folder or the new one, never a part). Across file systems the copy is made under a dot-name in
    the plugins folder first (discovery skips dot-folders), then renamed."""
    into = folder.parent
    ready = built
    if os.stat(built).st_dev != os.stat(into).st_dev:
        ready = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".toolcell-new", dir=into))
        ready.rmdir()
        plugin_files.copy_folder(str(built), str(ready))
    old = None
    try:
        if folder.exists() or folder.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".toolcell-old", dir=into))
            folder.rename(old / "plugin")
        ready.rename(folder)
    except BaseException:
        if ready is not built:
            shutil.rmtree(ready, ignore_errors=True)
        if old is not None and not folder.exists():
            (old / "plugin").rename(folder)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


async def _create(into: Path, name: str, text: str, state_dir: str, book: approvals.Book, asker: Asker, how: str,
                  replace: bool, notes: tuple[str, ...] = ()) -> bool:
    """Build the folder in the state dir, install what it runs, ship its lock, show its grants; once a
    person approved them, record the approval and move the folder into the plugins folder."""
    folder = into / name
    if folder.resolve().parent != into:
        raise ImportProblem(f"{name!r} would land outside {into}")
    if folder.exists() and not replace:
        raise ImportProblem(f"{folder} already exists (use --replace to overwrite it)")
    staging = _staging(state_dir, name)
    staging.chmod(0o755)
    try:
        (staging / MANIFEST_NAME).write_text(text, encoding="utf-8")
        os.chmod(staging / MANIFEST_NAME, 0o600)
        try:
            manifest = load_manifest(staging)
        except ManifestError as exc:
            raise ImportProblem("; ".join(exc.problems)) from None
        if manifest.server is not None and manifest.server.package:
            async with progress(f"installing {manifest.server.package}", sys.stderr):
                env = await installer.install_package(parse_package(manifest.server.package), state_dir, None,
                                                      manifest.server.bin)
            lock = installer.lock_file(env)
            if lock is not None:
                (staging / lock[0]).write_text(lock[1], encoding="utf-8")
        print("\n".join([*approvals.describe(manifest), *notes]))
        if not asker.confirm(f"Approve {name} with these permissions?"):
            return False
        # Recorded first: the moment the folder appears, a daemon holds it to exactly this approval.
        book.write(manifest, str(folder), how)
        _put_in_place(staging, folder)
        print(f"added {folder} (approved)")
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _grants_for(name: str, suggested: list[str], args: argparse.Namespace, asker: Asker) -> tuple[list[str], list[str], list[str]]:
    reads, writes, nets = _per_name(args.read), _per_name(args.write), _per_name(args.net)
    read = reads.get(name, []) + reads.get("*", [])
    write = writes.get(name, []) + writes.get("*", [])
    net = nets.get(name, []) + nets.get("*", [])
    if asker.interactive:
        write = _split_list(asker.text(f"{name}: folders it may read and write", ",".join(write or suggested)))
        read = _split_list(asker.text(f"{name}: folders it may only read", ",".join(read)))
        net = _split_list(asker.text(f"{name}: hosts it may reach (host:port)", ",".join(net)))
    return read, write, net


def _paths_granted(name: str, named: list[str], read: list[str], write: list[str], asker: Asker, again: str) -> bool:
    """Whether to go on when the server's arguments name folders it is granted neither to read nor to
    write (it would fail at once, e.g. "Cannot access directory"): a person at a terminal is asked;
    otherwise it is not created, and the command that grants them is printed."""
    granted = [os.path.abspath(p) for p in read + write]
    missing = [p for p in named
               if not any(os.path.abspath(p) == g or os.path.abspath(p).startswith(g.rstrip("/") + "/") for g in granted)]
    if not missing:
        return True
    grants = " ".join(f"--write {name}={p}" for p in missing)
    print(f"toolcell: {name}: its arguments name {', '.join(missing)}, which it is granted neither to read nor "
          f"to write: the sandbox would refuse it, and the server fail at once.\n"
          f"  to grant them: {again} {grants} --replace   (--read {name}=PATH for read-only)", file=sys.stderr)
    if asker.interactive:
        return asker.confirm(f"Create {name} without access to {', '.join(missing)}?")
    print(f"toolcell: {name}: not created", file=sys.stderr)
    return False


def _env_for(name: str, env: Any, inputs: dict[str, str], args: argparse.Namespace,
             asker: Asker) -> tuple[list[str], dict[str, str]]:
    if env is None:
        return [], {}
    if not isinstance(env, dict):
        raise ImportProblem("env must be an object")
    given = {k: v[-1] for k, v in _per_name(args.env).items()}
    allow: list[str] = []
    fixed: dict[str, str] = {}
    for var, value in env.items():
        if not isinstance(value, str):
            raise ImportProblem(f"env {var!r}: the value is not a string")
        override = given.get(f"{name}.{var}")
        if override is not None:
            fixed[var] = override
            continue
        m = _VAR.match(value)
        if m and m.group(1) == var:
            allow.append(var)
        elif m:
            raise ImportProblem(f"env {var!r} = {value!r}: toolcell passes a variable under its own name only")
        elif _INPUT.search(value):
            answer = asker.text(f"{name}: {var} ({', '.join(inputs.get(i, i) for i in _INPUT.findall(value))})")
            if not answer:
                allow.append(var)  # left to the daemon's environment
            else:
                fixed[var] = _INPUT.sub(answer.replace("\\", "\\\\"), value)
        else:
            fixed[var] = value
    return allow, fixed


def cmd_import(args: argparse.Namespace, cfg: Any) -> int:
    try:
        entries, inputs = read_client_config(args.file)
        into = _destination(args, cfg)
    except ImportProblem as exc:
        print(f"toolcell import: {exc}", file=sys.stderr)
        return 2
    asker = Asker(args.yes)
    made = failed = 0
    for raw_name, entry in sorted(entries.items()):
        if args.only and raw_name not in args.only:
            continue
        if isinstance(entry, dict) and (entry.get("disabled") is True):
            print(f"{raw_name}: disabled in the config, skipped")
            continue
        try:
            name = plugin_name(raw_name)
            server, suggested = translate(entry)
            server = trio.run(pin, server)
            read, write, net = _grants_for(raw_name, suggested, args, asker)
            if not _paths_granted(raw_name, suggested, read, write, asker,
                                  f"toolcell import {args.file} --only {raw_name}"):
                failed += 1
                continue
            allow, fixed = _env_for(raw_name, entry.get("env"), inputs, args, asker)
            text = manifest_text(name, f"{raw_name}, imported from {os.path.basename(args.file)}", server, allow, fixed,
                                 read, write, net)
            notes = (resolved_note(entry["command"], server["command"][0]),) if server.get("command") else ()
            if trio.run(_create, into, name, text, cfg.state_dir, book_for(cfg), asker,
                        f"toolcell import {args.file}", args.replace, notes):
                made += 1
            else:
                failed += 1
        except (ImportProblem, installer.InstallError, approvals.ApprovalsError, ValueError, OSError) as exc:
            failed += 1
            reason = exc.reason if isinstance(exc, installer.InstallError) else str(exc)
            print(f"toolcell import: {raw_name}: {reason}", file=sys.stderr)
    print(f"{made} plugin(s) created in {into}" + (f", {failed} not" if failed else ""))
    return 1 if failed else 0


def cmd_add(args: argparse.Namespace, cfg: Any) -> int:
    asker = Asker(args.yes)
    try:
        into = _destination(args, cfg)
        registry = args.spec.endswith(".json") and not os.path.isdir(args.spec)
        if args.spec.startswith(("npm:", "pypi:")) or registry:
            allow = sorted({v for v in (args.env or []) if "=" not in v})
            fixed = dict(v.split("=", 1) for v in (args.env or []) if "=" in v)
            if registry:  # an MCP Registry entry (server.json): its package, arguments and variables
                entry = read_server_json(Path(args.spec), list(args.args), asker.text)
                for note in entry.notes:
                    print(f"toolcell add: {note}", file=sys.stderr)
                spec, argv, about = entry.server["package"], entry.server["args"], entry.description or entry.name
                allow = sorted(set(allow) | {v for v in entry.env_allow if v not in fixed})
                fixed = {**{k: v for k, v in entry.env_set.items() if k not in allow}, **fixed}
                default_name = entry.name.rsplit("/", 1)[-1]
            else:
                spec, argv, about = args.spec, list(args.args), ""
                default_name = ""
            pkg = parse_package(spec, pinned=False)
            server = trio.run(pin, {"package": spec, "bin": args.bin or "", "args": argv})
            name = plugin_name(args.name or default_name or pkg.name)
            named = [a for a in argv if a.startswith("/") and os.path.isdir(a)]
            read, write, net = _grants_for(name, named, args, asker)
            again = " ".join(["toolcell add", args.spec, *(f"--arg={a}" for a in args.args)])
            if not _paths_granted(name, named, read, write, asker, again):
                return 1
            text = manifest_text(name, about or f"{pkg.name}, added with toolcell add", server, allow, fixed, read,
                                 write, net)
            ok = trio.run(_create, into, name, text, cfg.state_dir, book_for(cfg), asker,
                          f"toolcell add {args.spec}", args.replace)
            return 0 if ok else 1
        return _add_folder(Path(args.spec).resolve(), into, cfg.state_dir, book_for(cfg), asker, args.replace)
    except ManifestError as exc:
        print(f"toolcell add: {exc}", file=sys.stderr)
    except plugin_files.PluginFileError as exc:
        print(f"toolcell add: {args.spec}: {exc.reason}", file=sys.stderr)
    except (ImportProblem, RegistryProblem, approvals.ApprovalsError, ValueError, OSError) as exc:
        print(f"toolcell add: {exc}", file=sys.stderr)
    except installer.NoExecutableChosen as exc:
        if exc.executables:
            print(f"toolcell add: {args.spec} has several executables ({', '.join(exc.executables)}): say which runs "
                  f"the server with --bin NAME, e.g. toolcell add {args.spec} --bin {exc.executables[0]}", file=sys.stderr)
        else:
            print(f"toolcell add: {args.spec} installs no executable, so there is no server to run: is it a library "
                  "rather than an MCP server?", file=sys.stderr)
    except installer.InstallError as exc:
        print(f"toolcell add: {exc.reason}", file=sys.stderr)
    return 1


def _add_folder(source: Path, into: Path, state_dir: str, book: approvals.Book, asker: Asker, replace: bool) -> int:
    """``toolcell add FOLDER``: copy the folder into the state dir (``plugin_files.copy_folder``: regular
    files and folders only, capped), show and approve what the *copy* asks for, then move the copy into
    place. A folder already in the plugins folder is approved where it is."""
    manifest = load_manifest(source)
    if into / manifest.name == source:
        if not _approve_added(manifest, source, book, asker, source):
            return 1
        print(f"approved {source} where it is")
        return 0
    staging = _staging(state_dir, manifest.name)
    try:
        copy = staging / "plugin"
        plugin_files.copy_folder(str(source), str(copy))
        manifest = load_manifest(copy)  # what is approved is what was copied, whatever the source does meanwhile
        folder = into / manifest.name
        if folder.exists() and not replace:
            raise ImportProblem(f"{folder} already exists (use --replace to overwrite it)")
        if not _approve_added(manifest, folder, book, asker, source):
            return 1
        _put_in_place(copy, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"added {folder} (approved)")
    return 0


def _approve_added(manifest: Any, folder: Path, book: approvals.Book, asker: Asker, source: Path) -> bool:
    print("\n".join(approvals.describe(manifest)))
    if not asker.confirm(f"Approve {manifest.name} with these permissions?"):
        return False
    book.write(manifest, str(folder), f"toolcell add {source}")
    return True


def cmd_approve(args: argparse.Namespace, cfg: Any) -> int:
    found = []
    for path in discover(cfg.plugins):
        try:
            manifest = load_manifest(path)
        except ManifestError:
            continue
        if manifest.name == args.name:
            found.append((path, manifest))
    if len(found) != 1:
        print(f"toolcell approve: {'no' if not found else 'more than one'} plugin named {args.name!r} in "
              f"{', '.join(cfg.plugins)}", file=sys.stderr)
        return 2
    path, manifest = found[0]
    book = book_for(cfg)
    snapshot = book.read()
    # A record that cannot be trusted (a shared book checks each alone) is replaced by approving again.
    distrusted = snapshot.untrusted.get(approvals.key(path)) if not snapshot.problem else None
    try:
        more = None if distrusted else approvals.differences_in(snapshot, manifest, path)
    except approvals.ApprovalsError as exc:
        print(f"toolcell approve: {exc}", file=sys.stderr)
        return 2
    print("\n".join(approvals.describe(manifest)))
    if distrusted:
        print(f"  {distrusted}: approving records it anew")
    elif more is not None:
        print("  beyond its last approval: " + ("; ".join(more) if more else "nothing"))
    if not Asker(args.yes).confirm(f"Approve {manifest.name} with these permissions?"):
        return 1
    try:
        book.write(manifest, str(path), "toolcell approve")
    except approvals.ApprovalsError as exc:
        print(f"toolcell approve: {exc}", file=sys.stderr)
        return 2
    if cfg.approvals.store is None:
        flags = "".join(f" --plugins {d}" for d in args.plugins or []) + (f" --config {args.config}" if args.config else "")
        print(f"approved {manifest.name}; a running daemon picks it up at its next reload (toolcell reload{flags})")
    else:
        print(f"approved {manifest.name} in {book.where}; every daemon reading it picks it up within "
              f"{cfg.approvals.poll_s:g} s")
    return 0


def register(sub: Any, common: Callable[..., None], config: Callable[..., Any]) -> None:
    """Add ``add``, ``import`` and ``approve`` to the ``toolcell`` command line."""

    def grants(p: argparse.ArgumentParser) -> None:
        p.add_argument("--into", metavar="DIR", help="the plugins folder to create the plugin(s) in")
        p.add_argument("--read", action="append", metavar="NAME=PATH", help="a path a server may read (repeatable)")
        p.add_argument("--write", action="append", metavar="NAME=PATH", help="a path a server may read and write")
        p.add_argument("--net", action="append", metavar="NAME=HOST:PORT", help="a host a server may reach")
        p.add_argument("--yes", action="store_true", help="approve without asking")
        p.add_argument("--replace", action="store_true", help="overwrite a plugin folder of the same name")

    p = sub.add_parser("add", help="add a plugin: npm:PKG[@VERSION], pypi:PKG[==VERSION], an MCP Registry "
                                   "server.json or a plugin folder")
    common(p)
    grants(p)
    p.add_argument("spec")
    p.add_argument("--arg", action="append", dest="args", default=[], metavar="ARG",
                   help="an argument for the server (repeatable; --arg=--flag for one starting with -)")
    p.add_argument("--name", help="plugin name (default: from the package)")
    p.add_argument("--bin", help="which executable of the package runs the server (default: its only one)")
    p.add_argument("--env", action="append", metavar="VAR[=VALUE]", help="environment: passed from the daemon, or set")
    p.set_defaults(func=lambda a: cmd_add(a, config(a)))

    p = sub.add_parser("import", help="turn a client's MCP config (Claude Desktop, .mcp.json, VS Code) into plugins")
    common(p)
    grants(p)
    p.add_argument("file")
    p.add_argument("--env", action="append", metavar="NAME.VAR=VALUE", help="a value for a server's variable")
    p.add_argument("--only", action="append", metavar="NAME", help="import only this entry (repeatable)")
    p.set_defaults(func=lambda a: cmd_import(a, config(a)))

    p = sub.add_parser("approve", help="approve what a plugin asks for (paths, hosts, env, limits)")
    common(p)
    p.add_argument("name")
    p.add_argument("--yes", action="store_true", help="approve without asking")
    p.set_defaults(func=lambda a: cmd_approve(a, config(a)))
