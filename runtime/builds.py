"""Source builds inside the sandbox: the one install step that must run a package's own code.

By default a plugin's requirements are installed from wheels only, outside any sandbox, because
installing a wheel runs none of its code (``runtime.installer``). A plugin whose manifest says
``allow_source_builds = true`` may also depend on packages that exist only as source distributions:
then resolution and installation -- which run those packages' build code (``setup.py``, a build
backend) -- happen inside a worker sandbox like any plugin's:

* ``uv`` runs there (``sandbox.hosted`` executes it) under the ``strict`` layers: its own namespaces,
  Landlock, seccomp, a cgroup (1 GiB, 256 processes), a wall clock, no environment but an allowlist;
* it writes only to one build folder (a write grant) and its private scratch (uv's cache);
* it reaches only the package index (``pypi.org:443``, ``files.pythonhosted.org:443``) through the
  daemon's egress proxy; local ``UV_FIND_LINKS`` folders of the daemon's environment are readable;
* what it produced is then made root-owned and world-readable by the daemon without following a
  single link (``_settle``), and the lock it wrote is copied out as a regular file. The daemon never
  executes or imports any of it: only that plugin's workers, sandboxed, read it.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import trio

from runtime import egress
from runtime.egress_rules import Grant
from runtime.logs import log
from runtime.protocol.errors import WorkerFailure
from runtime.processes import (
    LIVE_WORKER_PIDS,
    LIVE_WORKER_TOKENS,
    SPAWNED,
    WORKER_MARKER,
    WORKER_SYS_PATH,
    kill_tree,
    spawn_process,
)
from runtime.execution.child import ChildProcess
from sandbox import wire
from sandbox.isolation import cgroups
from runtime.policy import check_layers

BUILD_HOSTS = ("pypi.org:443", "files.pythonhosted.org:443")
BUILD_LIMITS = wire.Limits(timeout_s=600, memory_mb=1024, cpu_s=600, max_processes=256, max_open_files=4096,
                           max_file_size_mb=1024)
#: The daemon's uv settings that a build may follow (an index of its own, local wheel folders).
_UV_VARS = ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "UV_INDEX", "UV_FIND_LINKS", "UV_OFFLINE")
MAX_OUTPUT = 64 * 1024


class BuildError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _prepare(argv: list[str], name: str, workdir: str, state_dir: str, policy: str,
             python: str) -> tuple[str, str, dict[str, str], wire.Init]:
    """Scratch dir, worker token, environment and ``Init`` of one build sandbox."""
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"{os.getpid()}~build-{name}-", dir=state_dir)
    token = os.urandom(8).hex()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": "/tmp",
           "UV_CACHE_DIR": os.path.join(scratch, "uv-cache"), "UV_NO_PROGRESS": "1", "UV_PYTHON_DOWNLOADS": "never",
           "UV_NO_CONFIG": "1",
           "UV_SYSTEM_CERTS": "1",  # the machine's trust store (/etc/ssl/certs is readable in the sandbox)
           WORKER_MARKER: f"build-{name}:{token}"}
    reads = [os.path.realpath(argv[0]), python, "/etc/ssl/certs", "/usr/share/ca-certificates"]
    for var in _UV_VARS:
        value = os.environ.get(var)
        if value:
            env[var] = value
            reads += [p for p in value.split() if p.startswith("/") and os.path.isdir(p)]
    init = wire.Init(plugin_name=f"build-{name}", plugin_dir=workdir, entry="", sys_path=WORKER_SYS_PATH, env=env,
                     limits=BUILD_LIMITS, permissions=wire.Permissions(network=list(BUILD_HOSTS), write=[workdir]),
                     policy=policy, scratch_dir=scratch, command=argv,
                     command_read=[p for p in reads if os.path.exists(p)])
    return scratch, token, env, init


async def run(argv: list[str], *, name: str, workdir: str, state_dir: str, policy: str, python: str) -> str:
    """Run ``argv`` (uv) in a sandbox that may write ``workdir`` and reach the package index only.
    Returns its output; raises ``BuildError`` with it when the command fails."""
    scratch, token, env, init = _prepare(argv, name, workdir, state_dir, policy, python)
    LIVE_WORKER_TOKENS.add(token)
    proc, raw = await spawn_process(env, scratch, piped=True)
    LIVE_WORKER_PIDS.add(proc.pid)
    ipc = ChildProcess(proc, raw, scratch)
    output = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            if not ipc.write(wire.encode_frame(init)):
                raise BuildError("the build sandbox did not start")
            with trio.fail_after(60):
                msg = await ipc.read_message(with_fds=True)
                if isinstance(msg, wire.EgressListener):
                    listener = egress.adopt_listener(ipc.fds, msg.port)
                    scope = trio.CancelScope()
                    nursery.start_soon(egress.serve_proxy, listener, Grant.parse(list(BUILD_HOSTS)), f"build-{name}", proc.pid,
                                       scope)
                    msg = await ipc.read_message(with_fds=True)
            ipc.close_fds()
            if isinstance(msg, wire.LoadFailed):
                raise BuildError(f"the build sandbox could not start: {msg.error}")
            if not isinstance(msg, wire.Ready):
                raise BuildError("the build sandbox sent something other than Ready")
            problem = check_layers(policy, msg.layers, msg.missing, f"build-{name}", network=True)
            if problem:
                raise BuildError(f"the build sandbox is not isolated: {problem}")
            for stream in (proc.stdout, proc.stderr):
                nursery.start_soon(_collect, stream, output)
            if proc.stdin is not None:
                await proc.stdin.aclose()
            with trio.fail_after(BUILD_LIMITS.timeout_s):
                await proc.wait()
            nursery.cancel_scope.cancel()
    except trio.TooSlowError:
        raise BuildError(f"the build did not finish within {BUILD_LIMITS.timeout_s:g} s") from None
    except WorkerFailure as exc:
        raise BuildError(f"the build sandbox failed: {exc.message}") from None
    except (OSError, ValueError) as exc:
        raise BuildError(f"the build sandbox failed: {exc}") from None
    finally:
        kill_tree(proc.pid)
        ipc.close_fds()
        try:
            raw.close()
        except OSError:
            pass
        with trio.CancelScope(shield=True):
            await proc.wait()
            SPAWNED.pop(proc.pid, None)
            LIVE_WORKER_PIDS.discard(proc.pid)
            LIVE_WORKER_TOKENS.discard(token)
            await trio.to_thread.run_sync(cgroups.cleanup, proc.pid)
        shutil.rmtree(scratch, ignore_errors=True)
    text = output.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise BuildError(text.strip()[-2000:] or f"the build exited with status {proc.returncode}")
    return text


async def _collect(stream: trio.abc.ReceiveStream | None, into: bytearray) -> None:
    if stream is None:
        return
    try:
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            if len(into) < MAX_OUTPUT:
                into += chunk[: MAX_OUTPUT - len(into)]
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return


def _settle(root: str) -> None:
    """Make what a build wrote root-owned and world-readable, never following a link."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                os.unlink(path)  # fifos, sockets, devices: nothing a package needs
                continue
            os.lchown(path, os.geteuid(), os.getegid())
            exec_bits = 0o111 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o100 else 0
            os.chmod(path, 0o644 | exec_bits)
    os.lchown(root, os.geteuid(), os.getegid())
    os.chmod(root, 0o755)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _read_regular(path: str, limit: int = 8 << 20) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BuildError(f"{os.path.basename(path)} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


async def build_requirements(requirements: list[str], dest: str, state_dir: str, policy: str, uv: str,
                             python: str, shipped_lock: str) -> str:
    """Resolve and install ``requirements`` into ``dest/build/site`` inside the sandbox; returns the lock text."""
    work = os.path.join(dest, "build")
    os.makedirs(work)
    lock = os.path.join(work, "requirements.lock")
    source = os.path.join(work, "requirements.in")
    _write(source, "".join(r + "\n" for r in requirements))
    if shipped_lock:
        _write(lock, shipped_lock)
    os.chmod(work, 0o777)  # the sandbox's uid writes here, and only here
    name = os.path.basename(dest)
    if not shipped_lock:
        await run([uv, "pip", "compile", "--quiet", "--no-header", "--generate-hashes", "--no-config", "--python",
                   python, "-o", lock, source], name=name, workdir=work, state_dir=state_dir, policy=policy,
                  python=python)
        _settle(work)  # each sandbox has a uid of its own: the next one must be able to read the lock
        os.chmod(work, 0o777)
    await run([uv, "pip", "install", "--quiet", "--no-config", "--require-hashes", "--link-mode", "copy", "--python",
               python, "--target", os.path.join(work, "site"), "-r", lock], name=name, workdir=work,
              state_dir=state_dir, policy=policy, python=python)
    _settle(work)
    site = os.path.join(work, "site")
    if not stat.S_ISDIR(os.lstat(site).st_mode):
        raise BuildError("the build left no site folder")
    text = _read_regular(lock)
    log("environment_built_in_sandbox", path=dest, requirements=requirements)
    return text
