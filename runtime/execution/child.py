"""One supervised child process: a plugin's worker or a hosted server's sandbox, from spawn to reaping.

How this works:

* ``spawn_child`` starts ``sandbox.worker`` (the daemon's spare interpreter when it fits a plugin
  worker, ``runtime.spares``) with its IPC socket; ``piped`` gives it stdin/stdout/stderr pipes (a
  hosted server talks MCP on them). It gets a scratch folder and a token that marks its escaped
  descendants.
* ``handshake`` sends ``Init`` and waits for ``Ready``: first, if the plugin has a network grant,
  ``EgressListener`` with the proxy's listening socket, which the daemon serves (``runtime.egress``);
  the isolation layers the child reports are checked against the policy (``runtime.policy``).
* ``WriteQueue`` writes to a non-blocking fd at once when it takes the bytes (no task switch on the
  hot path), else queues them for its writer task.
* ``watch`` relays what the child prints (capped) to the log, keeps a tail for start-up errors, waits
  for the exit (the exit, not the end of the output, drives the clean-up: a grandchild that inherited
  the pipe must not keep us from killing it), then calls back and cleans up: tokens, pids, orphans,
  its cgroup, its scratch folder.
* ``kill`` kills the whole process tree (process group, psutil descendants, then orphans re-parented to
  us as subreaper), stops its egress proxy and closes the IPC socket.
* ``explain_exit`` says why a child ended, by name: a limit that fired (memory, CPU, processes) or a crash.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import tempfile
from typing import Any, Callable

import msgspec
import trio

from runtime import egress, spares, worker_frames
from runtime.egress_rules import Grant
from runtime.execution.runner import PluginLoadError
from runtime.logs import log
from runtime.policy import EGRESS_LAYER, check_layers
from runtime.processes import (
    LIVE_WORKER_PIDS,
    LIVE_WORKER_TOKENS,
    SPAWNED,
    PoolSpec,
    kill_tree,
    spawn_process,
    sweep_orphans,
)
from runtime.protocol.errors import WorkerFailure
from runtime.worker_frames import FrameRejected
from sandbox import wire
from sandbox.call_guard import CPU_LIMIT_EXIT
from sandbox.isolation import cgroups

#: Bytes of a child's output logged (the rest is dropped, once said so).
MAX_LOGGED_OUTPUT = 256 * 1024
#: How long the last output may take to drain after the exit.
OUTPUT_DRAIN_S = 0.5


class WriteQueue:
    """Writes to one non-blocking fd (a socket or a pipe): at once when it takes the bytes, else
    queued for ``serve``. ``max_unread``: more queued than this and ``write`` fails (``full``)."""

    __slots__ = ("_fd", "_send", "_out", "_wake", "_sending", "unread", "max_unread", "full", "closed", "wrote_nothing")

    def __init__(self, fd: int, send: Callable[[bytes], int], max_unread: int = 0) -> None:
        self._fd = fd
        self._send = send
        self._out: list[bytes] = []
        self._wake = trio.Event()
        self._sending = False
        self.unread = 0
        self.max_unread = max_unread
        self.full = False
        self.closed = False
        #: After ``write`` returned False: no byte of what it was given reached the fd (it was closed
        #: or broken at the first send, or the queue was full before any of it went).
        self.wrote_nothing = False

    def write(self, data: bytes) -> bool:
        """Send ``data`` now if the fd takes it, else leave it to ``serve``. False if the fd is broken
        or closed, or (``full``) more than ``max_unread`` bytes wait; then ``wrote_nothing`` says
        whether any of ``data`` left."""
        if self.closed:
            self.wrote_nothing = True
            return False
        sent = 0
        if not self._out and not self._sending:
            try:
                sent = self._send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.wrote_nothing = True
                return False
            if sent == len(data):
                return True
            data = data[sent:]
        self._out.append(data)
        if self.max_unread:
            self.unread += len(data)
            if self.unread > self.max_unread:
                self.full = True
                self.wrote_nothing = sent == 0
                return False
        self._wake.set()
        return True

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def serve(self, on_broken: Callable[[], None]) -> None:
        """Write what ``write`` queued until ``close``; ``on_broken()`` if the fd breaks first."""
        while not self.closed:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._out and not self.closed:
                data = b"".join(self._out)
                self._out.clear()
                self._sending = True
                try:
                    while data:
                        try:
                            sent = self._send(data)
                        except (BlockingIOError, InterruptedError):
                            await trio.lowlevel.wait_writable(self._fd)
                            continue
                        data = data[sent:]
                        self.unread = max(0, self.unread - sent)
                except (OSError, trio.ClosedResourceError, ValueError):
                    if not self.closed:
                        on_broken()
                    return
                finally:
                    self._sending = False


class ChildProcess:
    """One child process and its IPC socket (used raw: trio only waits for readiness)."""

    __slots__ = ("proc", "raw", "buf", "pid", "dead", "scratch", "token", "egress", "fds", "output_tail", "exited",
                 "output_done", "channel", "write", "log_name", "log_pid", "hold_socket")

    def __init__(self, proc: trio.Process, raw: socket.socket, scratch: str, token: str = "") -> None:
        self.proc = proc
        self.raw = raw
        self.buf = bytearray()
        self.pid = proc.pid
        self.dead = False
        #: Set before ``kill``: the IPC socket stays open (its reader is woken and stops) so that what
        #: the child wrote last can still be read (``last_words``), which then closes it.
        self.hold_socket = False
        self.scratch = scratch
        self.token = token
        #: Cancels this child's egress proxy (``runtime.egress``), if its plugin has a network grant.
        self.egress: trio.CancelScope | None = None
        #: File descriptors that came over the IPC socket during start-up (only the egress listener is kept).
        self.fds: list[int] = []
        #: The last few KiB the child printed (shown when it fails to start).
        self.output_tail = b""
        self.exited = trio.Event()
        #: Set once everything the child printed has been relayed (its output pipe is at EOF).
        self.output_done = trio.Event()
        #: Writes to the IPC socket (``write`` is its bound ``write``: one attribute on the hot path).
        self.channel = WriteQueue(raw.fileno(), raw.send)
        self.write = self.channel.write
        #: The plugin and the pid its output is logged under.
        self.log_name = ""
        self.log_pid = proc.pid

    def close_fds(self) -> None:
        while self.fds:
            try:
                os.close(self.fds.pop())
            except OSError:
                pass

    async def read_message(self, with_fds: bool = False) -> Any:
        """The next frame (used only during start-up, before a reader task runs).

        ``Ready`` carries every tool definition, so it is capped by the protocol-wide frame limit,
        not the plugin's output cap; the definitions are checked (and refused) afterwards."""
        while True:
            try:
                frames = wire.split_frames(self.buf, wire.MAX_FRAME_BYTES, max_count=1)
            except ValueError:
                raise WorkerFailure("output_cap", "the worker sent a frame over the size limit") from None
            if frames:
                try:
                    msg = wire.from_worker_decoder.decode(frames[0])
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
                    raise WorkerFailure("garbage", "the worker sent a malformed frame") from None
                if type(msg) is wire.Ready:
                    try:
                        worker_frames.check_ready(msg)
                    except FrameRejected as exc:
                        raise WorkerFailure("garbage", f"the worker sent a malformed frame: {exc}") from None
                return msg
            data = await self.recv(with_fds)
            self.buf += data
            # A child that keeps its socket full never makes ``recv`` wait: start-up reading must not
            # hold the event loop either (start-up only: a yield per read costs nothing that counts).
            await trio.lowlevel.checkpoint()

    async def recv(self, with_fds: bool = False) -> bytes:
        """Some bytes; ``with_fds`` also keeps passed file descriptors in ``fds`` (a plain ``recv`` makes
        the kernel discard them)."""
        while True:
            try:
                if with_fds:
                    data, fds, _, _ = socket.recv_fds(self.raw, 1 << 18, 4)
                    for fd in fds:
                        # One descriptor is ever expected (the egress listener): any other is closed
                        # at once, so a child cannot fill the daemon's descriptor table while it starts.
                        if self.fds:
                            os.close(fd)
                        else:
                            self.fds.append(fd)
                else:
                    data = self.raw.recv(1 << 18)
            except (BlockingIOError, InterruptedError):
                try:
                    await trio.lowlevel.wait_readable(self.raw)
                except (trio.ClosedResourceError, OSError, ValueError):
                    raise WorkerFailure("crashed", "the worker process exited unexpectedly") from None
                continue
            except OSError:
                data = b""
            if not data:
                raise WorkerFailure("crashed", "the worker process exited unexpectedly")
            return data

    async def handshake(self, init: wire.Init, nursery: trio.Nursery, spec: PoolSpec, grant: Grant) -> wire.Ready:
        """Send ``init`` and wait for ``Ready`` (serving the egress socket, if one comes first).

        Raises ``PluginLoadError`` (the child said it cannot load, or is not isolated as the policy
        wants) or ``WorkerFailure`` (it crashed or misbehaved)."""
        name, policy = spec.manifest.name, spec.policy
        if not self.write(wire.encode_frame(init)):
            raise WorkerFailure("crashed", "the worker process exited unexpectedly")
        try:
            msg = await self.read_message(with_fds=True)
            if isinstance(msg, wire.EgressListener):
                self.egress = egress.start_proxy(nursery, grant, name, self.pid, self.fds, msg.port,
                                                 self.egress is not None, spec.secrets)
                msg = await self.read_message(with_fds=True)
        finally:
            self.close_fds()
        if isinstance(msg, wire.LoadFailed):
            raise PluginLoadError(msg.stage, msg.error)
        if not isinstance(msg, wire.Ready):
            raise PluginLoadError("start", "the worker sent something other than Ready")
        if EGRESS_LAYER in msg.layers and self.egress is None:
            raise PluginLoadError("isolation", "the worker reported an egress proxy but handed over no socket")
        problem = check_layers(policy, msg.layers, msg.missing, name, network=bool(grant))
        if problem:
            raise PluginLoadError("isolation", problem)
        return msg

    def wrote_nothing(self) -> bool:
        """After ``write`` returned False: whether no byte of what it was given reached the child."""
        return self.channel.wrote_nothing

    def kill(self) -> None:
        """Kill the whole process tree (once), stop its egress proxy, close the IPC socket."""
        first = not self.dead
        self.dead = True
        if self.proc.returncode is None:
            # Not reaped yet, so the pid is still this child's. Once reaped it may be reused by
            # another process: then only the token sweep below (by marker) finds what is left.
            kill_tree(self.pid)
        if not first:
            return
        # Escaped grandchildren carry this child's token: retire it and sweep them now.
        LIVE_WORKER_TOKENS.discard(self.token)
        sweep_orphans()
        if self.egress is not None:
            self.egress.cancel()
        self.channel.close()
        try:
            trio.lowlevel.notify_closing(self.raw)  # its reader wakes (ClosedResourceError) and stops
        except (RuntimeError, ValueError, OSError):
            pass
        if not self.hold_socket:
            self.close_socket()

    def close_socket(self) -> None:
        try:
            self.raw.close()
        except OSError:
            pass

    async def last_words(self, limit_s: float, max_bytes: int) -> bytes:
        """After ``kill`` with ``hold_socket``: what the child wrote that its reader did not take (the
        reader's unread ``buf`` first), read until the socket's end (every holder of the child's end is
        dead), ``limit_s`` or ``max_bytes``, whichever comes first; then the socket is closed."""
        data = bytearray(self.buf)
        self.buf.clear()
        try:
            with trio.move_on_after(limit_s):
                while len(data) <= max_bytes:
                    try:
                        chunk = self.raw.recv(1 << 18)
                    except (BlockingIOError, InterruptedError):
                        await trio.lowlevel.wait_readable(self.raw)
                        continue
                    except OSError:
                        break
                    if not chunk:
                        break
                    data += chunk
        except (trio.ClosedResourceError, OSError, ValueError):
            pass
        finally:
            self.close_socket()
        return bytes(data)

    async def _pump_output(self, stream: trio.abc.ReceiveStream | None) -> None:
        """Relay what the child prints to the log (capped); keeps a tail for start-up errors."""
        logged = 0
        if stream is None:
            self.output_done.set()
            return
        try:
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    break
                if not chunk:
                    break
                self.output_tail = (self.output_tail + chunk)[-4096:]
                if logged < MAX_LOGGED_OUTPUT:
                    text = chunk[: MAX_LOGGED_OUTPUT - logged].decode("utf-8", "replace")
                    logged += len(chunk)
                    log("plugin_output", plugin=self.log_name, pid=self.log_pid, output=text.rstrip("\n"))
                    if logged >= MAX_LOGGED_OUTPUT:
                        log("plugin_output_capped", plugin=self.log_name, pid=self.log_pid,
                            cap_bytes=MAX_LOGGED_OUTPUT)
        finally:
            self.output_done.set()

    async def watch(self, output: trio.abc.ReceiveStream | None, on_exit: Callable[[], None],
                    settle_s: float = 0.0) -> None:
        """Relay ``output`` while the child runs; when it exits, ``on_exit()`` (after ``settle_s``, for
        readers of its other pipes to see the last of them), then clean up after it."""
        proc = self.proc
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_output, output)
                with trio.CancelScope(shield=True):
                    await proc.wait()
                self.exited.set()
                with trio.move_on_after(OUTPUT_DRAIN_S):  # let the last output drain, then stop listening
                    await self.output_done.wait()
                nursery.cancel_scope.cancel()
            if settle_s and not self.dead:
                await trio.sleep(settle_s)
        finally:
            self.exited.set()
            on_exit()
            LIVE_WORKER_TOKENS.discard(self.token)
            if proc.returncode is not None:
                LIVE_WORKER_PIDS.discard(self.pid)
                SPAWNED.pop(self.pid, None)
            sweep_orphans()
            with trio.CancelScope(shield=True):
                # Whatever is left in the child's cgroup dies with it; the cgroup goes away.
                await trio.to_thread.run_sync(cgroups.cleanup, self.pid)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        await stream.aclose()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def tail(self) -> str:
        """What the child printed last, for a start-up error ("" if nothing)."""
        return self.output_tail.decode("utf-8", "replace").strip()


async def spawn_child(spec: PoolSpec, *, piped: bool = False, use_spare: bool = False,
                      home: bool = False) -> tuple[ChildProcess, dict[str, str], spares.Spares | None]:
    """Start one child for ``spec``'s plugin (the daemon's spare interpreter when ``use_spare`` and it
    fits); returns it, the environment its ``Init`` must carry, and the keeper of the spare it took
    (to ``restock`` once the child is Ready or failed). Raises ``PluginLoadError``.

    ``home``: HOME is the scratch folder and TMPDIR /tmp unless the manifest sets them (a hosted server)."""
    name = spec.manifest.name
    os.makedirs(spec.state_dir, mode=0o711, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"{os.getpid()}~{name}-", dir=spec.state_dir)
    keeper = spares.current.get() if use_spare else None
    spare = keeper.take(spec) if keeper is not None else None
    if keeper is not None and spare is not None:
        proc, raw, token = spare.proc, spare.raw, spare.token
    else:
        keeper = None
        token = secrets.token_hex(8)
        LIVE_WORKER_TOKENS.add(token)
        env = spec.env(token)
        if home:
            env.setdefault("HOME", scratch)
            env.setdefault("TMPDIR", "/tmp")
        try:
            proc, raw = await spawn_process(env, scratch, piped=piped)
        except OSError as exc:
            LIVE_WORKER_TOKENS.discard(token)
            shutil.rmtree(scratch, ignore_errors=True)
            raise PluginLoadError("spawn", f"could not start a worker: {exc}") from None
    env = spec.env(token)
    if home:
        env.setdefault("HOME", scratch)
        env.setdefault("TMPDIR", "/tmp")
    child = ChildProcess(proc, raw, scratch, token)
    child.log_name = name
    LIVE_WORKER_PIDS.add(proc.pid)
    return child, env, keeper


def describe_exit(returncode: int | None, subject: str = "the worker process") -> str:
    """A child's end in words, from its exit status alone (``explain_exit`` knows the limits too)."""
    if returncode is None:
        return f"{subject} stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{subject} crashed: killed by {name}"
    return f"{subject} crashed: it exited with status {returncode}"


def explain_exit(returncode: int | None, pid: int, limits: wire.Limits,
                 subject: str = "the worker process", shell_status: bool = False) -> WorkerFailure:
    """Why a child ended, by name: a limit that fired (memory, CPU, processes) or a crash.

    ``shell_status``: an exit status 128 + N says the child's program was killed by signal N (a hosted
    server's supervisor passes its server's end on this way)."""
    if shell_status and returncode is not None and 128 < returncode < 128 + 65:
        returncode = 128 - returncode
    if returncode in (CPU_LIMIT_EXIT, -signal.SIGXCPU):
        return WorkerFailure("cpu", f"exceeded its CPU limit ({limits.cpu_s} s of CPU for one call)")
    try:
        events = cgroups.limit_events(pid)
    except Exception:  # noqa: BLE001 (reading the cgroup is best effort)
        events = {}
    if events.get("oom_kill"):
        return WorkerFailure("memory", f"ran out of memory (its limit is {limits.memory_mb} MB) and was killed")
    if returncode is not None and returncode < 0 and events.get("pids_max"):
        return WorkerFailure("processes", f"hit its limit of {limits.max_processes} processes and threads and was killed")
    return WorkerFailure("crashed", describe_exit(returncode, subject))
