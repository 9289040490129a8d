"""Installing what plugins need: Python requirements, and hosted servers' npm and PyPI packages.

How this works:

* Every environment lives in ``<state_dir>/envs/<kind>-<key>``, where the key is a digest of what
  defines it (the requirement set or the pinned package, the lock file if the plugin ships one, the
  interpreter version): plugins with identical requirements share one environment, and a hot reload
  whose requirements did not change finds its environment ready and installs nothing.
* The installers are well-kept tools run as subprocesses from trio (the event loop never blocks):
  ``uv`` (a PyPI wheel, a dependency of toolcell) for Python, ``npm`` for Node packages.
* No package code runs outside the sandbox while installing: Python requirements are resolved and
  installed from wheels only (``--only-binary :all:``; a requirement that exists only as a source
  distribution is refused with uv's reason, never built), and npm runs with ``--ignore-scripts``.
* Every environment records a lock: ``requirements.lock`` (uv's resolution with every version and
  ``--hash``, installed with ``--require-hashes``) or npm's ``package-lock.json`` (versions and
  ``integrity``). A plugin folder that holds such a lock (``toolcell add`` writes one) is installed
  from it, so the same versions and hashes come back on any machine.
* A shipped lock is not covered by the user's approval, so it is checked before use
  (``check_requirements_lock``, ``check_npm_lock``): a requirements lock may hold only comments and
  ``name==version [; marker]`` lines with ``--hash=sha256:`` (no options: a ``--no-binary`` or
  ``--find-links`` line would override the command line and build an sdist here, outside any
  sandbox), and uv is given our own re-serialisation of it, never the shipped text; an npm lock may
  hold only https tarballs of the registry with their ``integrity``. A hosted package's lock must pin
  the approved package itself.
* Names and versions reach the installers only after ``runtime.server_spec`` checked them, and in
  files (a requirements file, a package.json) rather than on the command line.
* An environment is complete only once its ``toolcell-env.json`` marker exists; a half-made one (a
  failed or interrupted install) is removed and made again. One install per key at a time
  (a lock in this process, ``flock`` across daemons).
* The worker sees its environment read-only (Landlock read grant, a read-only mount view) and no
  other plugin's: each worker's allowlist names only its own.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

from runtime import plugin_files
from runtime.logs import log
from runtime.plugin_files import excerpt
from runtime.server_spec import Package
from runtime import builds

INSTALL_TIMEOUT_S = 600.0
MARKER = "toolcell-env.json"
#: A shipped lock larger than this is refused unread.
MAX_LOCK_BYTES = 8 * 1024 * 1024
PY_LOCK = "requirements.lock"
NPM_LOCK = "package-lock.json"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_locks: dict[str, trio.Lock] = {}


class InstallError(Exception):
    """An install that failed; ``reason`` is the installer's own explanation."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoExecutableChosen(InstallError):
    """A package with several executables (or none by its name), and no choice made: the manifest's
    ``server.bin``, ``toolcell add``'s ``--bin``. ``executables`` are the ones it has."""

    def __init__(self, reason: str, executables: list[str]) -> None:
        super().__init__(reason)
        self.executables = executables


@dataclass(frozen=True)
class Installed:
    """A ready environment: where it is, and how to run what it holds."""

    path: str
    #: For plugins with requirements: the folder to put on ``sys.path``.
    site: str = ""
    #: For hosted packages: the argv that starts the server.
    argv: tuple[str, ...] = ()
    #: What the worker must be able to read for ``argv`` to run (beyond ``path`` itself).
    read: tuple[str, ...] = ()


def python_exe() -> str:
    return os.path.realpath(sys.executable)


def which(name: str) -> str | None:
    """``name`` on the daemon's PATH, absolute entries only: an empty or relative entry would find a
    program in whatever directory the command was run from (a cloned repository's ``./npm``)."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if os.path.isabs(p))
    return shutil.which(name, path=path)


def uv_bin() -> str:
    try:
        # Lazy: CLI commands that install nothing load this module but not uv's package (~1 ms); without
        # the package, uv is looked up on PATH (the except below).
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = which("uv")
        if found is None:
            raise InstallError("uv is not installed (pip install uv)") from None
        return found


def _clean(text: str, limit: int = 2000) -> str:
    text = _ANSI.sub("", text).strip()
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    text = "\n".join(lines)
    return text if len(text) <= limit else "…" + text[-limit:]


#: Variables that would point an installer at configuration or a place other than the ones toolcell
#: gives it (npm reads ``npm_config_*`` in any case).
_CONFIG_PREFIXES = ("PYTHON", "VIRTUAL_ENV", "UV_PYTHON", "UV_CONFIG_FILE", "PIP_CONFIG_FILE")
_NPM_PLACE = frozenset({"npm_config_prefix", "npm_config_location", "npm_config_global"})


def _installer_env() -> dict[str, str]:
    """The environment of every npm and uv run: the daemon's, with what a known configuration needs.

    What configures them is the daemon user's own setup -- uv's ``UV_*`` index variables, npm's
    ``~/.npmrc``, its global config and ``npm_config_*`` variables -- and never a file of the directory
    a command was started from: uv runs with ``--no-config`` and ``UV_NO_CONFIG`` (no ``uv.toml`` or
    ``pyproject.toml`` is looked for), pip's config files are ``/dev/null``, and npm always runs in a
    directory toolcell made (``_npm_dir`` or an environment's own), whose ``package.json`` stops npm's
    search for a project ``.npmrc`` there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CONFIG_PREFIXES) and k.lower() not in _NPM_PLACE}
    # The machine's own trust store (an organisation's CA, a registry mirror's), not only uv's bundled roots.
    env.setdefault("UV_SYSTEM_CERTS", "1")
    env["UV_NO_CONFIG"] = "1"
    env["PIP_CONFIG_FILE"] = os.devnull
    env["npm_config_ignore_scripts"] = "true"
    env["npm_config_fund"] = "false"
    env["npm_config_audit"] = "false"
    env["npm_config_update_notifier"] = "false"
    env["npm_config_workspaces"] = "false"  # no search upwards for a workspace root (and its .npmrc)
    return env


class _npm_dir:  # noqa: N801 (a context manager named for what it gives)
    """A fresh private directory to run npm in (with a ``package.json``, so it is npm's project root:
    no ``.npmrc`` of the caller's directory or its parents is read), removed afterwards."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="toolcell-npm-")
        _write(os.path.join(self.path, "package.json"), '{"name": "toolcell-query", "private": true}\n')
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


async def _run(argv: list[str], cwd: str, what: str) -> str:
    """Run an installer; returns its output. Raises ``InstallError`` with its reason."""
    try:
        with trio.fail_after(INSTALL_TIMEOUT_S):
            done = await trio.run_process(argv, cwd=cwd, env=_installer_env(), capture_stdout=True,
                                          capture_stderr=True, check=False, stdin=b"")
    except trio.TooSlowError:
        raise InstallError(f"{what}: no result within {INSTALL_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise InstallError(f"{what}: could not run {argv[0]}: {exc}") from None
    out = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        err = _clean(done.stderr.decode("utf-8", "replace") or out)
        raise InstallError(f"{what} failed: {err}")
    return out


def envs_dir(state_dir: str) -> str:
    path = os.path.join(state_dir, "envs")
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    os.makedirs(path, mode=0o711, exist_ok=True)
    return path


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for part in (*parts, f"{sys.version_info[0]}.{sys.version_info[1]}", sys.platform):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


async def _read_lock(plugin_dir: str | None, name: str) -> str:
    """The lock ``name`` shipped in ``plugin_dir`` ('' when there is none), read as a hostile file
    (``runtime.plugin_files``): a link, FIFO, device, folder, an empty or oversized file or one that
    is not UTF-8 refuses the plugin with that reason."""
    if not plugin_dir:
        return ""
    try:
        text = await plugin_files.read_text_async(plugin_dir, name, MAX_LOCK_BYTES, empty_ok=False)
    except plugin_files.PluginFileError as exc:
        raise InstallError(exc.reason) from None
    return text or ""


_LOCK_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,100}[A-Za-z0-9])?")
#: PEP 440 versions as uv writes them (normalised): exact, no wildcard.
_LOCK_VERSION = re.compile(r"(?:[0-9]{1,9}!)?[0-9]{1,12}(?:\.[0-9]{1,12}){0,15}(?:(?:a|b|rc)[0-9]{1,9})?"
                           r"(?:\.post[0-9]{1,9})?(?:\.dev[0-9]{1,9})?(?:\+[a-z0-9]{1,32}(?:\.[a-z0-9]{1,32}){0,7})?")
_LOCK_REQUIREMENT = re.compile(rf"({_LOCK_NAME.pattern})[ \t]*==[ \t]*({_LOCK_VERSION.pattern})"
                               r"(?:[ \t]*;[ \t]*(.+?))?", re.IGNORECASE)
_LOCK_HASH = re.compile(r"--hash=sha256:([0-9a-fA-F]{64})")
_MARKER_TOKEN = re.compile(r"""\s*(\(|\)|'[^'"\\\s]{0,64}'|"[^'"\\\s]{0,64}"|===|==|!=|<=|>=|~=|<|>|not\s+in\b|"""
                           r"""[A-Za-z_]+)""")
_MARKER_VARS = frozenset({"python_version", "python_full_version", "os_name", "sys_platform", "platform_release",
                          "platform_system", "platform_version", "platform_machine", "platform_python_implementation",
                          "implementation_name", "implementation_version", "extra"})
_MARKER_OPS = frozenset({"===", "==", "!=", "<=", ">=", "~=", "<", ">", "in", "not in"})
_MARKER_VALUE = re.compile(r"""(['"])(?:[A-Za-z0-9._*+!][A-Za-z0-9._*+!-]{0,63})?\1""")


@dataclass(frozen=True)
class Pinned:
    """One requirement of a checked requirements lock."""

    name: str
    version: str
    marker: str
    hashes: tuple[str, ...]

    def line(self) -> str:
        marker = f" ; {self.marker}" if self.marker else ""
        return f"{self.name}=={self.version}{marker} " + " ".join(f"--hash=sha256:{h}" for h in self.hashes)


def _marker(text: str) -> str | None:
    """``text`` re-joined from its tokens if it is a plain environment marker, else None."""
    tokens: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _MARKER_TOKEN.match(text, pos)
        if m is None:
            return None
        tokens.append(re.sub(r"\s+", " ", m.group(1)))
        pos = m.end()
    out: list[str] = []
    depth, i, want_atom = 0, 0, True
    while i < len(tokens):
        tok = tokens[i]
        if want_atom and tok == "(":
            depth += 1
            out.append(tok)
            i += 1
        elif want_atom:
            if i + 3 > len(tokens):
                return None
            left, op, right = tokens[i:i + 3]
            sides = {left in _MARKER_VARS, right in _MARKER_VARS}
            values = {bool(_MARKER_VALUE.fullmatch(left)), bool(_MARKER_VALUE.fullmatch(right))}
            if op not in _MARKER_OPS or sides != {True, False} or values != {True, False}:
                return None
            out.append(f"{left} {op} {right}")
            i += 3
            want_atom = False
        elif tok == ")" and depth > 0:
            depth -= 1
            out.append(tok)
            i += 1
        elif tok in ("and", "or"):
            out.append(tok)
            i += 1
            want_atom = True
        else:
            return None
    if want_atom or depth != 0:
        return None
    return " ".join(out).replace("( ", "(").replace(" )", ")")


def check_requirements_lock(text: str) -> list[Pinned]:
    """The requirements of a shipped ``requirements.lock``, or ``InstallError`` naming the first line
    that is not a comment, a blank line or ``name==version [; marker]`` with ``--hash=sha256:...``.

    uv reads options in a requirements file (``--no-binary``, ``--find-links``, ``--index-url``, ``-r``,
    ...) and they win over its command line, so none is allowed; nor URLs, paths, ``@`` references,
    inline comments, or any character outside printable ASCII (so that this reading of the file and
    uv's cannot differ). Continuation lines (``\\`` at the very end) are joined."""
    pins: list[Pinned] = []
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0

    def refuse(number: int, line: str, why: str) -> InstallError:
        return InstallError(f"{PY_LOCK} line {number} is refused ({why}): {excerpt(line.strip())}; a shipped lock may hold only "
                            "comments and pinned, hashed requirements (name==version --hash=sha256:...)")

    lines = text.split("\n")
    for number, raw in enumerate(lines, start=1):
        line = raw[:-1] if raw.endswith("\r") else raw
        if re.search(r"[^\x20-\x7e\t]", line):
            raise refuse(number, line, "a control or non-ASCII character")
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            if stripped.endswith("\\"):
                raise refuse(number, line, "a comment that ends in a line continuation")
            continue
        if not stripped or stripped.startswith("#"):
            raise refuse(start, " ".join(pending), "a line continuation into a blank or comment line")
        if not pending:
            start = number
        if "\\" in line.removesuffix("\\"):
            raise refuse(number, line, "a backslash that is not a line continuation")
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        logical.append((start, " ".join(pending)))
        pending = []
    if pending:
        raise refuse(start, " ".join(pending), "a line continuation at the end of the file")

    for number, line in logical:
        stripped = line.strip()
        for token in stripped.split():
            if token.startswith("-") and not _LOCK_HASH.fullmatch(token):
                raise refuse(number, line, f"the option {token.split('=')[0][:40]} is not allowed")
        if stripped.startswith("-"):
            raise refuse(number, line, "no requirement")
        if "#" in stripped:
            raise refuse(number, line, "an inline comment")
        if "://" in stripped or "@" in stripped or stripped.startswith((".", "/", "~")) or "/" in stripped:
            raise refuse(number, line, "a URL, path or direct reference")
        # Marker values hold no whitespace: the options begin at the first whitespace before "--".
        head, _, tail = re.sub(r"\s+--", "\0--", stripped, count=1).partition("\0")
        m = _LOCK_REQUIREMENT.fullmatch(head.strip())
        if m is None:
            raise refuse(number, line, "not name==version [; marker]")
        marker = ""
        if m.group(3) is not None:
            checked = _marker(m.group(3))
            if checked is None:
                raise refuse(number, line, "an environment marker toolcell does not accept")
            marker = checked
        hashes: list[str] = []
        for option in tail.split():
            h = _LOCK_HASH.fullmatch(option)
            if h is None:
                raise refuse(number, line, f"the option {option.split('=')[0][:40]} is not allowed")
            hashes.append(h.group(1).lower())
        if not hashes:
            raise refuse(number, line, "no --hash=sha256:")
        pins.append(Pinned(m.group(1), m.group(2).lower(), marker, tuple(hashes)))
    if not pins:
        raise InstallError(f"{PY_LOCK} holds no requirement")
    return pins


def _canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _canonical_version(version: str) -> str:
    """A version with the trailing zeros of its release dropped (1.0 == 1.0.0), lower case."""
    m = re.match(r"((?:[0-9]+!)?)([0-9]+(?:\.[0-9]+)*)(.*)", version.lower())
    if m is None:
        return version.lower()
    release = m.group(2).split(".")
    while len(release) > 1 and int(release[-1]) == 0:
        release.pop()
    return m.group(1) + ".".join(str(int(p)) for p in release) + m.group(3)


def _checked_requirements_lock(text: str, package: Package | None = None) -> str:
    """The shipped lock re-serialised from its checked requirements (what uv is given), or ''."""
    if not text:
        return ""
    pins = check_requirements_lock(text)
    if package is not None and not any(
            _canonical_name(p.name) == _canonical_name(package.name)
            and _canonical_version(p.version) == _canonical_version(package.version) and not p.marker for p in pins):
        raise InstallError(f"{PY_LOCK} does not pin {package.name}=={package.version}, the approved package")
    return "".join(p.line() + "\n" for p in pins)


NPM_REGISTRY = "https://registry.npmjs.org/"
_SRI = re.compile(r"(?:sha512|sha384|sha256|sha1)-[A-Za-z0-9+/]{20,}={0,2}")
_registry_cache: list[str] = []
_NPM_LOCK_NAME = re.compile(r"(@[A-Za-z0-9][A-Za-z0-9._~-]{0,213}/)?[A-Za-z0-9_][A-Za-z0-9._~-]{0,213}")
_NPM_LOCK_VERSION = re.compile(r"[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}(-[0-9A-Za-z.-]{1,64})?(\+[0-9A-Za-z.-]{1,64})?")


def check_npm_lock(text: str, package: Package, registries: tuple[str, ...] = (NPM_REGISTRY,)) -> None:
    """Raise ``InstallError`` unless a shipped ``package-lock.json`` (lockfileVersion 2 or 3) fetches
    every package from the registry -- as an https tarball of one of ``registries`` named like that
    package and version, or (no ``resolved``) by its name and exact version -- with an ``integrity``,
    and its top entry is exactly the approved ``package`` (no alias). No links, folders, git or URLs."""
    bases = tuple(b if b.endswith("/") else b + "/" for b in registries if b.startswith("https://"))
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InstallError(f"{NPM_LOCK} is not JSON: {exc}") from None
    packages = data.get("packages") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("lockfileVersion") not in (2, 3) or not isinstance(packages, dict):
        raise InstallError(f"{NPM_LOCK} needs lockfileVersion 2 or 3 with \"packages\" (npm 7 or later)")

    def refuse(where: str, why: str) -> InstallError:
        return InstallError(f"{NPM_LOCK} entry {excerpt(where)} is refused: {why}; a shipped lock may fetch only https "
                            f"tarballs of the registry ({', '.join(bases) or 'none configured over https'}) "
                            "with their integrity")

    def check_resolved(where: str, resolved: object, integrity: object, name: str, version: object) -> None:
        if not isinstance(integrity, str) or not integrity.split() or not all(_SRI.fullmatch(i) for i in integrity.split()):
            raise refuse(where, "no valid integrity")
        if not isinstance(version, str) or not _NPM_LOCK_VERSION.fullmatch(version) or not _NPM_LOCK_NAME.fullmatch(name):
            raise refuse(where, f"{excerpt(name)} version {excerpt(str(version))} is not a registry package's name and version")
        if resolved is None:
            return  # npm fetches name@version from its configured registry (omit-lockfile-registry-resolved)
        if not isinstance(resolved, str) or not resolved.startswith(bases):
            raise refuse(where, f"resolved {excerpt(str(resolved))} is not an https tarball of the registry")
        path = resolved[next(len(b) for b in bases if resolved.startswith(b)):]
        files = {f"{name.rsplit('/', 1)[-1]}-{version}.tgz", f"{name}-{version}.tgz"}
        if not any(path == f"{name}/-/{f}" for f in files):
            raise refuse(where, f"resolved {excerpt(resolved)} is not the tarball of {name}@{version}")

    top = f"node_modules/{package.name}"
    for key, entry in packages.items():
        if key == "":
            continue
        if not isinstance(entry, dict):
            raise refuse(key, "not an object")
        if not key.startswith("node_modules/"):
            raise refuse(key, "a folder, not a registry package")
        if entry.get("link"):
            raise refuse(key, "a link to a folder")
        if entry.get("inBundle") is True and "resolved" not in entry and "integrity" not in entry:
            continue  # inside its parent's tarball, which the parent's integrity covers
        name = key.rsplit("node_modules/", 1)[-1]
        alias = entry.get("name", name)
        if not isinstance(alias, str):
            raise refuse(key, "a name that is not a string")
        if key == top and (alias != package.name or entry.get("version") != package.version):
            raise refuse(key, f"not {package}, the approved package")
        check_resolved(key, entry.get("resolved"), entry.get("integrity"), alias, entry.get("version"))
    if top not in packages:
        raise InstallError(f"{NPM_LOCK} does not hold {package}, the approved package")

    def legacy(deps: object, trail: str) -> None:  # lockfileVersion 2 repeats the tree for npm 6
        if not isinstance(deps, dict):
            raise refuse(trail, "\"dependencies\" is not an object")
        for name, entry in deps.items():
            if not isinstance(entry, dict):
                raise refuse(f"{trail}{name}", "not an object")
            if not (entry.get("bundled") is True and "resolved" not in entry):
                version = entry.get("version")
                alias = name
                if isinstance(version, str) and version.startswith("npm:"):
                    alias, _, version = version[4:].rpartition("@")
                check_resolved(f"{trail}{name}", entry.get("resolved"), entry.get("integrity"), alias, version)
            if "dependencies" in entry:
                legacy(entry["dependencies"], f"{trail}{name}/")

    if "dependencies" in data:
        legacy(data["dependencies"], "")


async def _npm_registries() -> tuple[str, ...]:
    """The registries a shipped npm lock may fetch from: npm's default and the configured one."""
    found = [NPM_REGISTRY]
    for var in ("npm_config_registry", "NPM_CONFIG_REGISTRY"):
        if os.environ.get(var):
            found.append(os.environ[var])
    npm = which("npm")
    if not _registry_cache and npm is not None:
        try:
            with _npm_dir() as cwd:
                out = await _run([npm, "config", "get", "registry"], cwd, "asking npm for its registry")
            _registry_cache.append(out.strip())
        except InstallError:
            _registry_cache.append("")
    found += [r for r in _registry_cache if r]
    return tuple(dict.fromkeys(found))


class _KeyLock:
    """One install per environment key: within this process (trio) and across daemons (flock)."""

    def __init__(self, envs: str, key: str) -> None:
        self.path = os.path.join(envs, f".{key}.lock")
        self.key = key
        self.fd = -1

    async def __aenter__(self) -> None:
        await _locks.setdefault(self.key, trio.Lock()).acquire()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            await trio.to_thread.run_sync(fcntl.flock, self.fd, fcntl.LOCK_EX, abandon_on_cancel=True)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            _locks[self.key].release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        try:
            os.close(self.fd)  # releases the flock
        finally:
            _locks[self.key].release()


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _ready(dest: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(dest, MARKER), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _fresh(dest: str) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest, mode=0o755)
    os.chmod(dest, 0o755)


def _mark(dest: str, info: dict[str, object]) -> None:
    tmp = os.path.join(dest, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(dest, MARKER))


async def _uv_lock(requirements: list[str], dest: str, shipped_lock: str) -> str:
    """Write ``dest/requirements.lock`` (the shipped one as ``_checked_requirements_lock`` re-wrote it, or
    uv's resolution with hashes)."""
    lock = os.path.join(dest, PY_LOCK)
    if shipped_lock:
        _write(lock, shipped_lock)
        return lock
    source = os.path.join(dest, "requirements.in")
    _write(source, "".join(r.replace(" ", "") + "\n" for r in requirements))
    await _run([uv_bin(), "pip", "compile", "--quiet", "--no-header", "--generate-hashes", "--only-binary", ":all:",
                "--python", python_exe(), "--no-config", "-o", lock, source], dest, "resolving the requirements")
    return lock


async def python_requirements(requirements: list[str], state_dir: str, plugin_dir: str | None = None, *,
                              source_builds: bool = False, policy: str = "strict") -> Installed:
    """The environment for a plugin's requirements (installed now if needed); its ``site`` goes on
    the worker's ``sys.path``. ``source_builds``: resolve and install inside a sandbox, where source
    distributions may be built (``runtime.builds``). Raises ``InstallError``."""
    shipped = await _read_lock(plugin_dir, PY_LOCK)
    checked = _checked_requirements_lock(shipped)  # before the ready check: a refused lock is refused every time
    normal = sorted({r.replace(" ", "") for r in requirements})
    key = _key("py", *normal, shipped, "source-builds" if source_builds else "wheels")
    envs = envs_dir(state_dir)
    dest = os.path.join(envs, f"py-{key}")
    site = os.path.join(dest, "build", "site") if source_builds else os.path.join(dest, "site")
    if _ready(dest) is not None:
        return Installed(dest, site=site)
    async with _KeyLock(envs, key):
        if _ready(dest) is not None:
            return Installed(dest, site=site)
        _fresh(dest)
        try:
            if source_builds:
                try:
                    text = await builds.build_requirements(normal, dest, state_dir, policy, uv_bin(), python_exe(),
                                                           checked)
                except builds.BuildError as exc:
                    raise InstallError(f"building in the sandbox failed: {exc.reason}") from None
                _write(os.path.join(dest, PY_LOCK), text)
            else:
                lock = await _uv_lock(normal, dest, checked)
                await _run([uv_bin(), "pip", "install", "--quiet", "--no-config", "--only-binary", ":all:",
                            "--require-hashes", "--link-mode", "copy", "--python", python_exe(), "--target", site,
                            "-r", lock], dest, "installing the requirements")
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        _mark(dest, {"kind": "python", "requirements": normal, "python": python_exe(), "source_builds": source_builds})
        log("environment_installed", kind="python", path=dest, requirements=normal)
    return Installed(dest, site=site)


#: An installed package's metadata file (``entry_points.txt``, ``package.json``) is refused larger than this.
MAX_METADATA_BYTES = 1024 * 1024


def _pypi_script(venv: str, package: Package, wanted: str) -> str:
    """The console script to run: ``wanted``, else the package's only one, else the one named like it."""
    site = os.path.join(venv, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    prefix = re.sub(r"[-_.]+", "_", package.name).lower() + "-"
    scripts: list[str] = []
    for entry in sorted(os.listdir(site)) if os.path.isdir(site) else []:
        if entry.lower().startswith(prefix) and entry.endswith(".dist-info"):
            try:  # the package's own file: read as a plugin's files are (no link, no FIFO, capped)
                text = plugin_files.read_text(site, f"{entry}/entry_points.txt", MAX_METADATA_BYTES)
            except plugin_files.PluginFileError as exc:
                raise InstallError(f"{package}: {exc.reason}") from None
            if text is not None:
                section = ""
                for line in text.splitlines():
                    line = line.strip()
                    if line.startswith("["):
                        section = line
                    elif section == "[console_scripts]" and "=" in line:
                        scripts.append(line.split("=", 1)[0].strip())
    return _pick(scripts, wanted, package)


def _pick(names: list[str], wanted: str, package: Package) -> str:
    if wanted:
        if wanted not in names:
            raise InstallError(f"{package} has no executable {wanted!r} (it has: {', '.join(names) or 'none'})")
        return wanted
    if len(names) == 1:
        return names[0]
    base = package.name.rsplit("/", 1)[-1]
    for name in names:
        if name == base:
            return name
    raise NoExecutableChosen(f"{package} has {'no executable' if not names else 'several executables: ' + ', '.join(names)}"
                             f"; name one with server.bin", names)


async def pypi_package(package: Package, state_dir: str, plugin_dir: str | None = None, bin_name: str = "") -> Installed:
    """A virtual environment holding ``package`` (wheels only, hashes pinned); argv runs its script."""
    shipped = await _read_lock(plugin_dir, PY_LOCK)
    checked = _checked_requirements_lock(shipped, package)
    key = _key("pypi", str(package), shipped)
    envs = envs_dir(state_dir)
    dest = os.path.join(envs, f"pypi-{key}")
    venv = os.path.join(dest, "venv")
    if _ready(dest) is None:
        async with _KeyLock(envs, key):
            if _ready(dest) is None:
                _fresh(dest)
                try:
                    lock = await _uv_lock([f"{package.name}=={package.version}"], dest, checked)
                    await _run([uv_bin(), "venv", "--quiet", "--no-config", "--python", python_exe(), venv], dest,
                               "creating the environment")
                    await _run([uv_bin(), "pip", "install", "--quiet", "--no-config", "--only-binary", ":all:",
                                "--require-hashes", "--link-mode", "copy", "--python", os.path.join(venv, "bin", "python"),
                                "-r", lock], dest, f"installing {package}")
                except BaseException:
                    shutil.rmtree(dest, ignore_errors=True)
                    raise
                _mark(dest, {"kind": "pypi", "package": str(package)})
                log("environment_installed", kind="pypi", path=dest, package=str(package))
    script = os.path.join(venv, "bin", _pypi_script(venv, package, bin_name))
    python = os.path.join(venv, "bin", "python")
    return Installed(dest, argv=(python, script), read=(python_exe(),))


def node_exe() -> str:
    found = which("node")
    if found is None:
        raise InstallError("node is not installed (an npm package needs Node.js on the daemon's PATH)")
    return os.path.realpath(found)


async def npm_package(package: Package, state_dir: str, plugin_dir: str | None = None, bin_name: str = "") -> Installed:
    """``package`` and its dependencies in ``node_modules`` (no install scripts, integrity pinned by
    ``package-lock.json``); argv runs its bin with the daemon's ``node``."""
    shipped = await _read_lock(plugin_dir, NPM_LOCK)
    envs = envs_dir(state_dir)
    if shipped:
        check_npm_lock(shipped, package, await _npm_registries())
    key = _key("npm", str(package), shipped)
    dest = os.path.join(envs, f"npm-{key}")
    if _ready(dest) is None:
        async with _KeyLock(envs, key):
            if _ready(dest) is None:
                _fresh(dest)
                try:
                    manifest = {"name": "toolcell-hosted", "private": True, "dependencies": {package.name: package.version}}
                    _write(os.path.join(dest, "package.json"), json.dumps(manifest))
                    npm = which("npm")
                    if npm is None:
                        raise InstallError("npm is not installed (needed for npm: packages)")
                    if shipped:
                        _write(os.path.join(dest, NPM_LOCK), shipped)
                        argv = [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--omit=dev"]
                    else:
                        argv = [npm, "install", "--ignore-scripts", "--no-audit", "--no-fund", "--omit=dev",
                                "--save-exact"]
                    await _run(argv, dest, f"installing {package}")
                except BaseException:
                    shutil.rmtree(dest, ignore_errors=True)
                    raise
                _mark(dest, {"kind": "npm", "package": str(package)})
                log("environment_installed", kind="npm", path=dest, package=str(package))
    script = _npm_bin(dest, package, bin_name)
    node = node_exe()
    return Installed(dest, argv=(node, script), read=(node,))


def _npm_bin(dest: str, package: Package, wanted: str) -> str:
    root = os.path.realpath(os.path.join(dest, "node_modules", package.name))
    try:  # the package's own file: read as a plugin's files are (no link, no FIFO, capped)
        text = plugin_files.read_text(root, "package.json", MAX_METADATA_BYTES)
        meta = json.loads(text) if text is not None else None
    except plugin_files.PluginFileError as exc:
        raise InstallError(f"{package}: {exc.reason}") from None
    except ValueError as exc:
        raise InstallError(f"{package}: unreadable package.json: {exc}") from None
    if meta is None:
        raise InstallError(f"{package}: unreadable package.json: no such file")
    bins = meta.get("bin") if isinstance(meta, dict) else None
    if isinstance(bins, str):
        bins = {package.name.rsplit("/", 1)[-1]: bins}
    if not isinstance(bins, dict) or not bins:
        raise InstallError(f"{package} declares no executable (package.json has no bin)")
    name = _pick([str(k) for k in bins], wanted, package)
    rel = bins[name]
    script = os.path.realpath(os.path.join(root, str(rel)))
    if not (script.startswith(root + "/") and os.path.isfile(script)):
        raise InstallError(f"{package}: its bin {name!r} points outside the package or to nothing")
    return script


async def install_package(package: Package, state_dir: str, plugin_dir: str | None = None,
                          bin_name: str = "") -> Installed:
    if package.ecosystem == "npm":
        return await npm_package(package, state_dir, plugin_dir, bin_name)
    return await pypi_package(package, state_dir, plugin_dir, bin_name)


def lock_file(installed: Installed) -> tuple[str, str] | None:
    """(file name, text) of the lock an environment recorded, to ship in a plugin folder."""
    for name in (PY_LOCK, NPM_LOCK):
        path = os.path.join(installed.path, name)
        if os.path.isfile(path):
            return name, Path(path).read_text(encoding="utf-8")
    return None


async def resolve_version(ecosystem: str, name: str) -> str:
    """The newest version of a package (for ``toolcell add`` given no version). Raises ``InstallError``."""
    if ecosystem == "npm":
        npm = which("npm")
        if npm is None:
            raise InstallError("npm is not installed")
        with _npm_dir() as cwd:  # never the caller's directory: a cloned repository's .npmrc would choose the registry
            out = await _run([npm, "view", "--json", "--", f"{name}@latest", "version"], cwd, f"looking up {name}")
        try:
            version = json.loads(out)
        except ValueError:
            version = None
        if isinstance(version, list):
            version = version[-1] if version else None
        if not isinstance(version, str):
            raise InstallError(f"npm has no version of {name}")
        return version
    tmp = tempfile.mkdtemp(prefix="toolcell-resolve-")
    try:
        source = os.path.join(tmp, "requirements.in")
        _write(source, name + "\n")
        out = await _run([uv_bin(), "pip", "compile", "--quiet", "--no-header", "--no-annotate", "--only-binary",
                          ":all:", "--python", python_exe(), "--no-config", source], tmp, f"looking up {name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    want = re.sub(r"[-_.]+", "-", name).lower()
    for line in out.splitlines():
        pkg, eq, version = line.strip().partition("==")
        if eq and re.sub(r"[-_.]+", "-", pkg).lower() == want:
            return version.strip()
    raise InstallError(f"PyPI has no installable version of {name}")
