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

from runtime.logs import log
from runtime.server_spec import Package

INSTALL_TIMEOUT_S = 600.0
MARKER = "toolcell-env.json"
PY_LOCK = "requirements.lock"
NPM_LOCK = "package-lock.json"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_locks: dict[str, trio.Lock] = {}


class InstallError(Exception):
    """An install that failed; ``reason`` is the installer's own explanation."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


def uv_bin() -> str:
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise InstallError("uv is not installed (pip install uv)") from None
        return found


def _clean(text: str, limit: int = 2000) -> str:
    text = _ANSI.sub("", text).strip()
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    text = "\n".join(lines)
    return text if len(text) <= limit else "…" + text[-limit:]


def _installer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "UV_PYTHON"))}
    # The machine's own trust store (an organisation's CA, a registry mirror's), not only uv's bundled roots.
    env.setdefault("UV_SYSTEM_CERTS", "1")
    env["npm_config_ignore_scripts"] = "true"
    env["npm_config_fund"] = "false"
    env["npm_config_audit"] = "false"
    env["npm_config_update_notifier"] = "false"
    return env


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


def _read_lock(plugin_dir: str | None, name: str) -> str:
    if not plugin_dir:
        return ""
    path = os.path.join(plugin_dir, name)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(8 << 20)
    except (FileNotFoundError, IsADirectoryError):
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise InstallError(f"cannot read {path}: {exc}") from None


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
    """Write ``dest/requirements.lock`` (the shipped one, or uv's resolution with hashes)."""
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
    shipped = _read_lock(plugin_dir, PY_LOCK)
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
                from runtime import builds

                try:
                    text = await builds.build_requirements(normal, dest, state_dir, policy, uv_bin(), python_exe(),
                                                           shipped)
                except builds.BuildError as exc:
                    raise InstallError(f"building in the sandbox failed: {exc.reason}") from None
                _write(os.path.join(dest, PY_LOCK), text)
            else:
                lock = await _uv_lock(normal, dest, shipped)
                await _run([uv_bin(), "pip", "install", "--quiet", "--no-config", "--only-binary", ":all:",
                            "--require-hashes", "--link-mode", "copy", "--python", python_exe(), "--target", site,
                            "-r", lock], dest, "installing the requirements")
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        _mark(dest, {"kind": "python", "requirements": normal, "python": python_exe(), "source_builds": source_builds})
        log("environment_installed", kind="python", path=dest, requirements=normal)
    return Installed(dest, site=site)


def _pypi_script(venv: str, package: Package, wanted: str) -> str:
    """The console script to run: ``wanted``, else the package's only one, else the one named like it."""
    site = os.path.join(venv, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    prefix = re.sub(r"[-_.]+", "_", package.name).lower() + "-"
    scripts: list[str] = []
    for entry in sorted(os.listdir(site)) if os.path.isdir(site) else []:
        if entry.lower().startswith(prefix) and entry.endswith(".dist-info"):
            ep = os.path.join(site, entry, "entry_points.txt")
            if os.path.isfile(ep):
                section = ""
                for line in Path(ep).read_text(encoding="utf-8", errors="replace").splitlines():
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
    raise InstallError(f"{package} has {'no executable' if not names else 'several executables: ' + ', '.join(names)}"
                       f"; name one with server.bin")


async def pypi_package(package: Package, state_dir: str, plugin_dir: str | None = None, bin_name: str = "") -> Installed:
    """A virtual environment holding ``package`` (wheels only, hashes pinned); argv runs its script."""
    shipped = _read_lock(plugin_dir, PY_LOCK)
    key = _key("pypi", str(package), shipped)
    envs = envs_dir(state_dir)
    dest = os.path.join(envs, f"pypi-{key}")
    venv = os.path.join(dest, "venv")
    if _ready(dest) is None:
        async with _KeyLock(envs, key):
            if _ready(dest) is None:
                _fresh(dest)
                try:
                    lock = await _uv_lock([f"{package.name}=={package.version}"], dest, shipped)
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
    found = shutil.which("node")
    if found is None:
        raise InstallError("node is not installed (an npm package needs Node.js on the daemon's PATH)")
    return os.path.realpath(found)


async def npm_package(package: Package, state_dir: str, plugin_dir: str | None = None, bin_name: str = "") -> Installed:
    """``package`` and its dependencies in ``node_modules`` (no install scripts, integrity pinned by
    ``package-lock.json``); argv runs its bin with the daemon's ``node``."""
    shipped = _read_lock(plugin_dir, NPM_LOCK)
    key = _key("npm", str(package), shipped)
    envs = envs_dir(state_dir)
    dest = os.path.join(envs, f"npm-{key}")
    if _ready(dest) is None:
        async with _KeyLock(envs, key):
            if _ready(dest) is None:
                _fresh(dest)
                try:
                    manifest = {"name": "toolcell-hosted", "private": True, "dependencies": {package.name: package.version}}
                    _write(os.path.join(dest, "package.json"), json.dumps(manifest))
                    npm = shutil.which("npm")
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
    try:
        with open(os.path.join(root, "package.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise InstallError(f"{package}: unreadable package.json: {exc}") from None
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
        npm = shutil.which("npm")
        if npm is None:
            raise InstallError("npm is not installed")
        out = await _run([npm, "view", "--json", "--", f"{name}@latest", "version"], os.getcwd(), f"looking up {name}")
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
