"""The per-call zygote: a fresh forked process for every call; nothing of one call reaches the next.

``serve(chan, tools, init)`` runs in the worker after the plugin is imported and ``Ready`` was sent
(``init.mode == "per_call"``). Every process below runs under every isolation layer of the worker:

* **Z, the zygote** (pid 1 of the worker's pid namespace) is the template every call starts from.
  It forks and reaps, and never reads a call or a result: each call process is a copy of Z's
  memory, so nothing Z ever held could turn up in a later call's process.
* **R, the relay**, is forked from Z once, before the first call. It owns the daemon channel, runs
  the calls in order, one at a time, checks and forwards what each call's process sends, and cleans
  up after each call. It never forks, so the call data it holds is copied nowhere.
* **C, call processes**, are forked by Z ahead of the calls: a C applies the per-call layers and
  waits ("warm") for exactly one call. There are at most ``CALL_PROCESSES`` at a time, the running
  one and a warm one, so a fork and a C's set-up happen while the previous call runs, on the other
  core, and not on the call's path.

How a call runs:

1. R writes the ``Call`` frame to the socket of the oldest warm C.
2. C runs the call, writes its ``Progress``/``Log``/``Result`` frames to its socket and exits. R
   relays only complete, well-formed frames carrying the call's id and stops at the first
   ``Result``; a half-written frame of a dying C never reaches the daemon channel.
3. R makes sure that nothing of the call can act any more: it SIGKILLs C and every process the
   call left (C's descendants through ``/proc/<pid>/task/<tid>/children``, and Z's children that
   are not call processes: orphans re-parent to pid 1), and it looks again until every one of
   them is a zombie or in the kernel's exit path (``PF_EXITING``: it will never run user code
   again). It does not wait for them to be torn down; Z reaps them afterwards (``REAP``).
4. R resets what a call can write that outlives it: /tmp, /dev/shm and scratch go back to what
   they held when the zygote started (names, contents, modes, times, xattrs), and the shared stdio
   descriptions get their flags back and lose any ``flock``. Then the next call starts. Its warm C
   was forked from Z, not from a used process, and has read nothing before its own call.

A C that dies or closes its socket without a ``Result`` takes the slow path instead: R asks Z
(``DONE``), Z kills and reaps it (its wait status goes into the error ``Result`` R sends), kills and
reaps what it left until nothing is left, and answers ``DEAD``; then R resets the files.

Per-call layers: a nested Landlock domain that only scopes signals and abstract sockets (a call
cannot signal Z, R or another C; ABI >= 6; one syscall with arguments Z prepared), and a session of
its own once its call has arrived. On top of the worker's layers, Z loads a second seccomp filter
(``CALL_DENY``) before anything forks, so every process here has it: it stops what a call could
otherwise leave for the next one, the priority, scheduling, I/O priority or rlimits of another
process of the same uid (Z, R, the warm C), and SysV IPC objects and POSIX message queues, which
outlive their creator.

The daemon's side is the pooled worker's: calls in order, results in order, each call's
``CallReturned`` sent by R once nothing of the call can act any more (step 3, or the slow path), never
relayed from C, and a deadline or cancellation of the running call kills the whole worker (the pid
namespace takes every process with it). Paths the
manifest grants write access to are the plugin's own persistent storage and are not reset.

Concurrency comes from the pool, which runs up to ``max_concurrency`` zygotes, each with its own
namespaces, /tmp and scratch: two calls never run side by side in one zygote, where they would
share a file system. Signals from a child to pid 1 are dropped by the kernel unless pid 1 handles
them, so Z handles none; Z and R are not dumpable (nor, inheriting it, is any C), so no C can open
their memory.

Cost model (why the code is shaped like this): on these VMs a copy-on-write fault costs ~2.5 us.
After every fork, each page Z or C writes costs one, and CPython writes to every object it touches
(reference counts) and to the bytecode it runs (3.11's inline caches). So Z runs as little Python per
call as it can, C's set-up is a handful of direct syscalls, and everything else happens in R, whose
pages are its own (it never forks).

``TOOLCELL_ZYGOTE_PROFILE=1`` in the worker's environment makes Z, R and every C print timings on
stderr (``benchmarks/sandbox_startup.py --profile`` sums them up).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C module: no enum conversions
import _socket
import collections
import ctypes
import errno
import gc
import os
import select
import resource
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, NoReturn

from sandbox import api, isolation
from sandbox.isolation import syscalls
from sandbox.wire import (
    HEADER,
    MAX_FRAME_BYTES,
    Answer,
    Ask,
    Call,
    CallReturned,
    CancelCall,
    Init,
    Log,
    Progress,
    Result,
    Shutdown,
    encode_frame,
    from_worker_decoder,
    split_frames,
    to_worker_decoder,
)
from sandbox.call_filters import load_call_filter, scope_ruleset
from sandbox.call_reset import Reset, reset_roots
from sandbox.calls import encode_result, run_call

# -- Z <-> R control messages (SOCK_SEQPACKET) -------------------------------------------------------
_MSG = struct.Struct("<Bqq")  # kind, call process id, value
#: Z -> R. WARM: a new call process (value: its pid; fds: R's end of its socket, a pidfd).
#: DEAD: answer to DONE (value: the call process's wait status). NOFORK: answer to WANT (errno).
WARM, DEAD, NOFORK = 1, 2, 3
#: R -> Z. REAP: R has made sure the call's processes are all dying; reap them when they are dead.
#: DONE: kill and reap the call's processes yourself and answer DEAD. WANT: no warm C, fork one now.
REAP, DONE, WANT = 11, 12, 13

#: Call processes alive at once: the running one and one warm. The warm one a call gets was forked
#: when the call before the previous one ended, so it has had a whole call's time to get ready.
CALL_PROCESSES = 2
#: Signals Z (and so R) ignores when it is not pid 1 of a namespace (pid 1 gets no unhandled signal
#: from inside it anyway); call processes set them back.
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_RESTORED = tuple(int(s) for s in _IGNORED if s != signal.SIGINT)
_SIGINT = int(signal.SIGINT)

PR_SET_CHILD_SUBREAPER = 36
#: ``task_struct.flags``: the task is in do_exit() and will not return to user space.
PF_EXITING = 0x4

_PROFILE = os.environ.get("TOOLCELL_ZYGOTE_PROFILE") == "1"

#: libc's fork(), called with the GIL held (PyDLL), so the child simply resumes this thread. Unlike
#: os.fork() it runs none of CPython's after-fork work: re-creating the GIL, import and runtime locks
#: and running the ``os.register_at_fork`` hooks (threading's alone writes to ~150 pages: ~0.4 ms of
#: copy-on-write faults in every call process). All of that exists for locks other threads might
#: hold, and Z has one thread (checked; otherwise os.fork() is used). The one hook whose effect a
#: call could see is random's reseed, which the call process does itself.
_raw_fork = ctypes.PyDLL(None).fork  # (errno: a failed fork is retried with os.fork for the error)
_raw_fork.restype = ctypes.c_int
_raw_fork.argtypes = []
#: syscall(2) and prctl(2) for the call process's own set-up, also called with the GIL held (no
#: release and re-take around a call that cannot block).
_gil_syscall = ctypes.PyDLL(None, use_errno=True).syscall
_gil_syscall.restype = ctypes.c_long
_gil_prctl = ctypes.PyDLL(None, use_errno=True).prctl
_gil_prctl.restype = ctypes.c_int


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _now_us() -> float:
    return time.perf_counter_ns() / 1000


# -- per-call layers, prepared once by Z -------------------------------------------------------------


@dataclass
class _Kit:
    """What Z prepares once for every call process: the tools and each per-call syscall's arguments."""

    tools: dict[str, api.ToolDef]
    ruleset_fd: int = -1
    landlock_args: tuple[Any, ...] = ()
    #: Z ignores a few signals only without a pid namespace (as pid 1 it needs not): then they are
    #: set back in the call process
    restore_signals: bool = False
    #: PR_SET_PDEATHSIG args, only without a pid namespace (Z's exit there ends every process)
    deathsig_args: tuple[Any, ...] = ()
    #: ``random.seed`` when the plugin imported ``random``
    reseed: Any = None
    #: ``limits.cpu_s``: each call process's own CPU budget (a fresh process starts at zero)
    cpu_s: int = 0


def _prctl_args(option: int, arg2: int = 0) -> tuple[Any, ...]:
    return (ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _make_kit(tools: dict[str, api.ToolDef], init: Init) -> _Kit:
    kit = _Kit(tools)
    layered = init.policy != "none"
    if layered and "landlock" not in isolation.last_reasons:
        try:
            kit.ruleset_fd = scope_ruleset()
        except OSError:
            kit.ruleset_fd = -1
        if kit.ruleset_fd >= 0:
            kit.landlock_args = (ctypes.c_long(syscalls.NR_LANDLOCK_RESTRICT_SELF), ctypes.c_int(kit.ruleset_fd),
                                 ctypes.c_uint32(0))
    if layered and "seccomp" not in isolation.last_reasons:
        try:
            load_call_filter()
        except OSError as exc:
            if init.policy == "strict":
                raise
            print(f"toolcell per_call ({init.policy}): no call filter: {exc}", file=sys.stderr, flush=True)
    if os.getpid() != 1:
        kit.deathsig_args = _prctl_args(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        kit.restore_signals = True
    if "random" in sys.modules:
        kit.reseed = sys.modules["random"].seed
    return kit


# -- a call process ---------------------------------------------------------------------------------


def _read_frame(fd: int) -> bytes | None:
    """One length-prefixed frame from ``fd`` (blocking), or None at EOF."""
    buf = b""
    while len(buf) < HEADER.size:
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        buf += chunk
    (length,) = HEADER.unpack_from(buf)
    if length > MAX_FRAME_BYTES:
        return None
    parts = [buf]
    have = len(buf)
    while have < HEADER.size + length:
        chunk = os.read(fd, min(HEADER.size + length - have, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        have += len(chunk)
    return b"".join(parts)[HEADER.size:]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _call_process(kit: _Kit, fd: int, t_fork: float) -> NoReturn:
    """A warm C: apply the per-call layers, wait for one call, run it. Never returns.

    Every Python object touched here costs a copy-on-write fault: raw fds instead of socket objects,
    the C signal module, pre-built ctypes arguments."""
    code = 0
    marks: list[float] = [t_fork, _now_us(), _faults()] if _PROFILE else []
    try:
        if kit.ruleset_fd > fd:
            os.closerange(3, fd)
            os.closerange(fd + 1, kit.ruleset_fd)
            os.closerange(kit.ruleset_fd + 1, 1 << 20)
        elif kit.ruleset_fd >= 0:
            os.closerange(3, kit.ruleset_fd)
            os.closerange(kit.ruleset_fd + 1, fd)
            os.closerange(fd + 1, 1 << 20)
        else:
            os.closerange(3, fd)
            os.closerange(fd + 1, 1 << 20)
        if kit.restore_signals:
            for sig in _RESTORED:  # back from Z's SIG_IGN (the C module: no enum conversions)
                _signal.signal(sig, _signal.SIG_DFL)
            _signal.signal(_SIGINT, _signal.default_int_handler)
        if kit.deathsig_args and _gil_prctl(*kit.deathsig_args):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if kit.landlock_args:
            if _gil_syscall(*kit.landlock_args):
                raise OSError(ctypes.get_errno(), "landlock_restrict_self")
            os.close(kit.ruleset_fd)
        if kit.reseed is not None:
            kit.reseed()  # what random's at-fork hook does: no two calls share a random sequence
        if _PROFILE:
            marks += [_now_us(), _faults()]
        _run_the_call(kit, fd, marks)
    except BaseException:  # noqa: BLE001 (R answers for a call process that fails)
        code = 1
    finally:
        os._exit(code)


def _run_the_call(kit: _Kit, fd: int, marks: list[float]) -> None:
    raw = _read_frame(fd)
    if raw is None:
        return
    if _PROFILE:
        marks += [_now_us(), _faults()]
    call = to_worker_decoder.decode(raw)
    if not isinstance(call, Call):
        return
    # Only now its own session: until then it shares Z's, which no call's process can ever join,
    # and that is how R tells a warm process from something a call left (see _Relay.quiesce).
    os.setsid()
    if kit.cpu_s:
        # SIGXCPU (default: end the process) at the budget, SIGKILL a second later if it is ignored.
        resource.setrlimit(resource.RLIMIT_CPU, (kit.cpu_s, kit.cpu_s + 1))

    def send(msg: Any) -> None:
        _write_all(fd, encode_frame(msg))

    def exchange(call_id: int, requests: list[Any]) -> list[Any]:
        # R forwards the Ask to the daemon and, when it comes, the Answer to this socket.
        _write_all(fd, encode_frame(Ask(call_id, requests)))
        while True:
            raw = _read_frame(fd)
            if raw is None:
                os._exit(0)  # R is gone: nobody waits for this call any more
            msg = to_worker_decoder.decode(raw)
            if isinstance(msg, Answer) and msg.id == call_id:
                return list(msg.responses)

    _write_all(fd, encode_result(run_call(kit.tools, call, send, exchange)))
    if _PROFILE:
        marks += [_now_us(), _faults()]
        os.write(2, ("toolcell call profile: " + " ".join(f"{m:.0f}" for m in marks) + "\n").encode())
    os.close(fd)  # tells R this process is about to exit (see _Relay.quiesce)


def _warm_up() -> None:
    """Run the call path (not the plugin's code) in Z a few times, before the first fork.

    CPython 3.11 rewrites a function's bytecode while it warms up (quickening, inline cache
    counters): done in Z once, instead of in every call process, where each page written is a
    copy-on-write fault."""

    def echo(text: str) -> str:
        return text

    before = list(api.TOOLS)
    api.tool(echo)
    tdef = api.TOOLS[-1]
    api.TOOLS[:] = before
    tools = {"echo": tdef}
    for i in range(64):
        raw = encode_frame(Call(i, "echo", {"text": "x"}))[HEADER.size:]
        call = to_worker_decoder.decode(raw)
        encode_result(run_call(tools, call, lambda msg: None))


def _faults() -> float:
    return float(_resource.getrusage(_resource.RUSAGE_SELF).ru_minflt)


if _PROFILE:
    import resource as _resource


def describe_status(status: int) -> str:
    if status < 0:
        return "exit status unknown"
    code = os.waitstatus_to_exitcode(status)
    if code == -signal.SIGXCPU:
        return "exceeded its CPU limit (limits.cpu_s of CPU for one call)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


# -- Z -----------------------------------------------------------------------------------------------


def _kill_session(pid: int) -> None:
    """SIGKILL the session (= process group) a call process made: what it forked, even where no
    /proc view lets us find it. Only while ``pid`` is unreaped, so the number cannot be reused."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _children_file(pid: int) -> str:
    return f"/proc/{pid}/task/{pid}/children"


class _Zygote:
    """Z's loop: fork call processes, reap what R says is dying, the slow path on ``DONE``."""

    def __init__(self, kit: _Kit, ctl: socket.socket, relay_pid: int) -> None:
        self.kit = kit
        self.ctl = ctl
        self.relay_pid = relay_pid
        #: call process id -> (pid, pidfd): warm or running, Z need not know which
        self.children: dict[int, tuple[int, int]] = {}
        #: pids of call processes R has reported dying (REAP), to be reaped
        self.reaping: list[int] = []
        #: pidfd -> pid of a process a call left, killed by R, that was not dead yet when we looked
        self.watch: dict[int, int] = {}
        self.serial = 0
        self.fork_blocked = False
        self.fork_errno = errno.EAGAIN
        self.raw_fork = _single_threaded()
        try:
            self.children_fd = os.open(_children_file(os.getpid()), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.children_fd = -1  # no /proc view: a call's session is killed, its double forks are not
        self.prof: dict[str, list[float]] = collections.defaultdict(list)

    def fork_warm(self) -> bool:
        mine, theirs = _socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        t = _now_us() if _PROFILE else 0.0
        pid = _raw_fork() if self.raw_fork else -1
        err = 0
        if pid < 0:
            try:
                pid = os.fork()
            except OSError as exc:
                pid, err = -1, exc.errno or errno.EAGAIN
        if pid < 0:
            mine.close()
            theirs.close()
            self.fork_blocked = True
            self.fork_errno = err or errno.EAGAIN
            return False
        if pid == 0:
            _call_process(self.kit, theirs.fileno(), t)
        if _PROFILE:
            self.prof["fork_us"].append(_now_us() - t)
        theirs.close()
        self.serial += 1
        pidfd = os.pidfd_open(pid)
        self.children[self.serial] = (pid, pidfd)
        try:
            self.ctl.sendmsg([_MSG.pack(WARM, self.serial, pid)],
                             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("ii", mine.fileno(), pidfd))])
        except OSError:
            pass  # R is gone; the loop notices
        finally:
            mine.close()
        return True

    def serve(self) -> None:
        relay_fd = os.pidfd_open(self.relay_pid)
        try:
            while True:
                while len(self.children) < CALL_PROCESSES and not self.fork_blocked:
                    self.fork_warm()
                if self.reaping:
                    self.reap()
                readable, _, _ = select.select([self.ctl.fileno(), relay_fd, *self.watch], [], [])
                if relay_fd in readable:
                    return
                for fd in readable:
                    if fd in self.watch:
                        try:
                            os.waitpid(self.watch.pop(fd), os.WNOHANG)
                        except ChildProcessError:
                            pass
                        os.close(fd)
                if self.ctl.fileno() in readable and not self.messages():
                    return
        finally:
            self.stop()
            os.close(relay_fd)

    def messages(self) -> bool:
        """Handle one message (the socket is readable); another one makes select return at once.
        (One at a time: no BlockingIOError to raise and catch on every wake-up.)"""
        try:
            data = self.ctl.recv(_MSG.size)
        except InterruptedError:
            return True
        except OSError:
            return False
        if len(data) != _MSG.size:
            return False  # EOF: R is gone
        kind, cid, _ = _MSG.unpack(data)
        if kind == REAP:
            entry = self.children.pop(cid, None)
            if entry is not None:
                os.close(entry[1])
                self.reaping.append(entry[0])
        elif kind == DONE:
            status = self.clean_up(cid)
            self.fork_blocked = False
            if not self.tell(DEAD, cid, status):
                return False
        elif kind == WANT:
            self.fork_blocked = False
            if not self.fork_warm() and not self.tell(NOFORK, 0, self.fork_errno):
                return False
        return True

    def tell(self, kind: int, cid: int, value: int) -> bool:
        try:
            self.ctl.send(_MSG.pack(kind, cid, value))
            return True
        except OSError:
            return False  # R is gone

    def reap(self) -> None:
        """Reap the call processes R reported dying, then whatever else of theirs is dead by now (the
        rest is still a child of ours and is reaped next time)."""
        t = _now_us() if _PROFILE else 0.0
        for pid in self.reaping:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.reaping.clear()
        strays = self.strays()
        watched = set(self.watch.values()) if strays else ()
        for pid in strays:
            if pid in watched:
                continue
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    self.watch[os.pidfd_open(pid)] = pid  # still dying: reaped when it is dead
            except (ChildProcessError, ProcessLookupError):
                pass
        if _PROFILE:
            self.prof["reap_us"].append(_now_us() - t)

    def strays(self) -> list[int]:
        """Our children that are neither R nor a call process (orphans re-parent to pid 1)."""
        if self.children_fd < 0:
            return []
        pids = os.pread(self.children_fd, 1 << 16, 0).split()
        if len(pids) <= len(self.children) + 1:
            return []  # R and the call processes: the common case, no sets built
        keep = {self.relay_pid} | {pid for pid, _ in self.children.values()}
        return [pid for pid in map(int, pids) if pid not in keep]

    def clean_up(self, cid: int) -> int:
        """The slow path: kill and reap call process ``cid`` and everything it left; returns its wait
        status."""
        entry = self.children.pop(cid, None)
        status = -1
        if entry is not None:
            pid, pidfd = entry
            _kill_session(pid)
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            os.close(pidfd)
        self.kill_strays()
        return status

    def kill_strays(self) -> None:
        """Kill and reap every stray until none is left (reaping one re-parents its children to us)."""
        while strays := self.strays():
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for pid in strays:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass

    def stop(self) -> None:
        for _pid, pidfd in self.children.values():
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid, pidfd in self.children.values():
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            os.close(pidfd)
        self.children.clear()
        self.reap()
        for fd in self.watch:
            os.close(fd)
        self.watch.clear()
        self.relay_pid = -1
        self.kill_strays()
        if _PROFILE:
            _report("zygote", self.prof)


# -- R -----------------------------------------------------------------------------------------------

#: What R passes on from a call's process; anything else it drops.
_RELAYED = (Progress, Log, Ask, Result)


def _task_dying_and_children(pid: int) -> tuple[bool, int, list[int]] | None:
    """Whether every thread of ``pid`` is a zombie or exiting, its session, and its children; None
    if it is gone.

    Each thread's state is read before its children: a thread seen exiting makes no more, so the
    list read after it is complete (it can only shrink, into pid 1's list)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    dying = True
    session = -1
    kids: list[int] = []
    for tid in tids:
        try:
            fields = _read(f"/proc/{pid}/task/{tid}/stat").rpartition(b")")[2].split()
            session = int(fields[3])
            if fields[0] not in (b"Z", b"X") and not int(fields[6]) & PF_EXITING:
                dying = False
            kids += map(int, _read(f"/proc/{pid}/task/{tid}/children").split())
        except (OSError, IndexError, ValueError):
            continue  # the thread is gone
    return dying, session, kids


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


@dataclass
class _Proc:
    """A call process as R sees it: its pid, socket and pidfd (from Z), its call once it runs."""

    cid: int
    pid: int
    sock: socket.socket | None
    pidfd: int
    call: Call | None = None
    buf: bytearray = field(default_factory=bytearray)
    answered: bool = False
    done_sent: bool = False
    t_sent: float = 0.0


class _Relay:
    def __init__(self, chan: Any, ctl: socket.socket, reset: Reset) -> None:
        self.chan = chan
        self.ctl = ctl
        self.reset = reset
        self.zygote_pid = os.getppid()
        #: Z's session: R and warm call processes are in it; a call's processes never can be.
        self.zygote_session = os.getsid(0)
        try:
            self.zygote_children = os.open(_children_file(self.zygote_pid), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.zygote_children = -1
        self.queue: collections.deque[tuple[Call, bytes, float]] = collections.deque()
        self.cancelled: set[int] = set()
        self.warm: list[_Proc] = []
        #: The running call's process, until the call is answered and nothing of it can act any more.
        self.cur: _Proc | None = None
        #: Warm processes that died unused, waiting for Z to reap them (DONE -> DEAD).
        self.lost: dict[int, _Proc] = {}
        self.wanted = False
        self.t_answered = 0.0
        self.prof: dict[str, list[float]] = collections.defaultdict(list)

    def serve(self) -> None:
        try:
            while True:
                self.start_next()
                rlist: list[Any] = [self.chan.sock, *(w.pidfd for w in self.warm)]
                cur = self.cur
                # Z's WARM messages are read when a call needs a process (start_next), not each in a
                # wake-up of its own; the channel is watched only while R waits for an answer.
                if self.wanted or self.lost or (cur is not None and cur.done_sent):
                    rlist.append(self.ctl)
                if cur is not None and not cur.done_sent:
                    rlist.append(cur.pidfd)
                    if cur.sock is not None:
                        rlist.append(cur.sock)
                readable, _, _ = select.select(rlist, [], [])
                if self.ctl in readable and not self.from_zygote():
                    return
                cur = self.cur
                if cur is not None and not cur.done_sent:
                    if cur.sock is not None and cur.sock in readable:
                        self.from_child(cur)
                    if self.cur is cur and not cur.done_sent and cur.pidfd in readable:
                        self.from_child(cur, exited=True)
                for w in list(self.warm):
                    if w.pidfd in readable:
                        self.warm.remove(w)
                        self.lost_warm(w)
                if self.chan.sock in readable and not self.from_daemon():
                    return
        finally:
            if _PROFILE:
                _report("relay", self.prof)

    def lost_warm(self, proc: _Proc) -> None:
        """A warm process died unused (a memory limit, an outside kill): Z reaps it, forks another."""
        self.lost[proc.cid] = proc
        self.ctl.send(_MSG.pack(DONE, proc.cid, 0))

    def answer(self, result: Result, returned: bool = False) -> None:
        """Send R's own result for a call; ``returned``: nothing of it ran, so ``CallReturned`` too."""
        frame = encode_frame(result)
        if returned:
            frame += encode_frame(CallReturned(result.id))
        self.chan.sock.sendall(frame)

    def start_next(self) -> None:
        while self.cur is None and self.queue:
            call, raw, t_arrived = self.queue[0]
            if call.id in self.cancelled:
                self.queue.popleft()
                self.cancelled.discard(call.id)
                self.answer(Result(call.id, [{"type": "text", "text": "cancelled"}], is_error=True), returned=True)
                continue
            while not self.warm and select.select([self.ctl], [], [], 0)[0]:
                if not self.from_zygote():
                    raise EOFError("the zygote is gone")
            if not self.warm:
                if not self.wanted:
                    self.wanted = True
                    self.ctl.send(_MSG.pack(WANT, 0, 0))
                return
            proc = self.warm.pop(0)
            if select.select([proc.pidfd], [], [], 0)[0]:
                self.lost_warm(proc)  # died waiting (a memory limit, an outside kill): try the next one
                continue
            self.queue.popleft()
            self.cur = proc
            proc.call = call
            if _PROFILE:
                proc.t_sent = _now_us()
                self.prof["queued_us"].append(proc.t_sent - t_arrived)
            assert proc.sock is not None
            try:
                proc.sock.sendall(HEADER.pack(len(raw)) + raw)
            except OSError:
                pass  # it died: its pidfd says so
            proc.sock.setblocking(False)

    def from_daemon(self) -> bool:
        try:
            chunk = self.chan.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        if not chunk:
            return False
        self.chan.buf += chunk
        t = _now_us() if _PROFILE else 0.0
        for raw in split_frames(self.chan.buf):
            msg = to_worker_decoder.decode(raw)
            if isinstance(msg, Call):
                self.queue.append((msg, raw, t))
            elif isinstance(msg, Answer):
                # The running call asked (its Ask went out as one of its frames): pass the answer on.
                cur = self.cur
                if cur is not None and cur.call is not None and cur.call.id == msg.id and cur.sock is not None:
                    try:
                        cur.sock.setblocking(True)
                        cur.sock.sendall(HEADER.pack(len(raw)) + raw)
                    except OSError:
                        pass  # it died: its pidfd says so
                    finally:
                        cur.sock.setblocking(False)
            elif isinstance(msg, CancelCall):
                # Answered in its place in the order, unrun; the daemon never cancels the running call
                # this way (it kills the worker).
                if any(queued.id == msg.id for queued, _, _ in self.queue):
                    self.cancelled.add(msg.id)
            elif isinstance(msg, Shutdown):
                return False
        return True

    def from_zygote(self) -> bool:
        """Handle one message from Z (the channel is readable). False: Z is gone."""
        try:
            data, ancdata, _, _ = self.ctl.recvmsg(_MSG.size, socket.CMSG_LEN(8))
        except InterruptedError:
            return True
        except OSError:
            return False
        fds = [int.from_bytes(d[i:i + 4], sys.byteorder, signed=True) for lvl, typ, d in ancdata
               if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS for i in range(0, len(d) - 3, 4)]
        if len(data) != _MSG.size:
            for fd in fds:
                os.close(fd)
            return False
        kind, cid, value = _MSG.unpack(data)
        if kind == WARM and len(fds) == 2:
            self.warm.append(_Proc(cid, value, socket.socket(fileno=fds[0]), fds[1]))
            self.wanted = False
            return True
        for fd in fds:
            os.close(fd)
        if kind == DEAD:
            self.dead(cid, value)
        elif kind == NOFORK:
            self.wanted = False
            if self.cur is None and self.queue:
                call, _, _ = self.queue.popleft()
                text = f"could not start a process for the call: {os.strerror(value)}"
                self.answer(Result(call.id, [{"type": "text", "text": text}], is_error=True), returned=True)
        return True

    def dead(self, cid: int, status: int) -> None:
        """The slow path ends: Z has reaped call process ``cid`` and everything it left."""
        lost = self.lost.pop(cid, None)
        if lost is not None:
            os.close(lost.pidfd)
            if lost.sock is not None:
                lost.sock.close()
            return
        cur = self.cur
        if cur is None or cur.cid != cid:
            return
        if not cur.answered:
            killed = status >= 0 and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            self.give_up(cur, f"tool process ended without a result ({describe_status(status)})", killed)
        os.close(cur.pidfd)
        self.finish()

    def finish(self) -> None:
        """Nothing of the call can act any more: say so to the daemon (which frees the worker only
        now), put its files back, start the next call."""
        cur = self.cur
        if cur is not None and cur.call is not None:
            self.chan.sock.sendall(encode_frame(CallReturned(cur.call.id)))
        t = _now_us() if _PROFILE else 0.0
        self.reset.run()
        self.cur = None
        if _PROFILE:
            now = _now_us()
            self.prof["reset_us"].append(now - t)
            self.prof["answered_to_next_us"].append(now - self.t_answered)

    def give_up(self, cur: _Proc, text: str, killed: bool = False) -> None:
        cur.answered = True
        self.t_answered = _now_us()
        assert cur.call is not None
        self.answer(Result(cur.call.id, [{"type": "text", "text": text}], is_error=True, killed=killed))

    def from_child(self, cur: _Proc, exited: bool = False) -> None:
        """Relay what the running call's process sent; ``exited``: it has died (read the rest first)."""
        assert cur.call is not None
        eof = False
        if cur.sock is not None and not cur.answered:
            drained = 0
            while drained <= MAX_FRAME_BYTES:
                try:
                    chunk = cur.sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    eof = True
                    break
                cur.buf += chunk
                drained += len(chunk)
            try:
                frames = split_frames(cur.buf, MAX_FRAME_BYTES)
            except ValueError:
                frames = []
                cur.buf.clear()
                self.give_up(cur, "tool process sent a frame over the size limit")
            for raw in frames:
                try:
                    msg = from_worker_decoder.decode(raw)
                except Exception:  # noqa: BLE001, S112 (malformed, never forwarded; msgspec raises several types)
                    continue
                if type(msg) not in _RELAYED or msg.id != cur.call.id:
                    continue  # only R says that a call returned (CallReturned), never its process
                self.chan.sock.sendall(HEADER.pack(len(raw)) + raw)  # forwarded as checked, not re-encoded
                if isinstance(msg, Result):
                    cur.answered = True
                    self.t_answered = _now_us()
                    if _PROFILE:
                        self.prof["run_us"].append(self.t_answered - cur.t_sent)
                    break
        if not (cur.answered or eof or exited):
            return
        cur.done_sent = True
        if cur.answered:
            # The fast path: make sure nothing of the call can act any more, let Z reap it later.
            self.quiesce(cur)
            self.ctl.send(_MSG.pack(REAP, cur.cid, 0))
            os.close(cur.pidfd)
            self.finish()
        else:
            if cur.sock is not None:
                cur.sock.close()
                cur.sock = None
            self.ctl.send(_MSG.pack(DONE, cur.cid, 0))  # it died without a result: Z gives its status

    def quiesce(self, cur: _Proc) -> None:
        """SIGKILL the call's process and everything it left; return once each is dying (module doc)."""
        t = _now_us() if _PROFILE else 0.0
        # Its last acts are closing its socket and exiting: wait (blocked, briefly) for the first.
        if cur.sock is not None:
            select.select([cur.sock.fileno(), cur.pidfd], [], [], 0.002)
            cur.sock.close()
            cur.sock = None
        try:
            signal.pidfd_send_signal(cur.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_session(cur.pid)  # unreaped until our REAP, so the number is still its session's
        # A warm process Z has forked and R not heard of yet is told apart by its session, below.
        keep = {os.getpid(), cur.pid, *(w.pid for w in self.warm)}
        pause = 0.0001
        rounds = 0
        while True:
            rounds += 1
            all_dying = True
            seen: set[int] = set()
            todo = [cur.pid]
            strays: set[int] = set()
            strays_read = False
            while todo or not strays_read:
                if not todo:
                    # Z's children, read after the walk: whatever was re-parented during it is there.
                    strays_read = True
                    try:
                        todo = [p for p in map(int, os.pread(self.zygote_children, 1 << 16, 0).split())
                                if p not in keep and p not in seen]
                        strays.update(todo)
                    except OSError:
                        todo = []
                    continue
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                state = _task_dying_and_children(pid)
                if state is None:
                    continue
                dying, session, kids = state
                if pid in strays and session == self.zygote_session:
                    continue  # a warm call process Z has just forked, not announced yet
                if not dying:
                    all_dying = False
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                todo += kids
            if all_dying:
                break
            select.select([cur.pidfd], [], [], pause)  # (a dying process needs a CPU to get there)
            pause = min(pause * 2, 0.005)
        if _PROFILE:
            self.prof["quiesce_us"].append(_now_us() - t)
            self.prof["quiesce_rounds"].append(rounds)


# -- start-up -----------------------------------------------------------------------------------------


def _report(who: str, prof: dict[str, list[float]]) -> None:
    t = os.times()
    n = max((len(v) for v in prof.values()), default=0)
    parts = [f"toolcell {who} profile: {n} calls"]
    for key, values in prof.items():
        if values:
            values = sorted(values)
            parts.append(f"{key} p50 {values[len(values) // 2]:.0f} p90 {values[int(len(values) * 0.9)]:.0f}")
    if n:
        parts.append(f"own CPU {(t.user + t.system) / n * 1e6:.0f} us/call")
        if who == "zygote":
            parts.append(f"reaped processes' CPU {(t.children_user + t.children_system) / n * 1e6:.0f} us/call")
    print("; ".join(parts), file=sys.stderr, flush=True)


def _close_fds_except(*keep: int) -> None:
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def serve(chan: Any, tools: dict[str, api.ToolDef], init: Init) -> None:
    """Serve ``Call`` frames, each in a fresh process, until Shutdown or EOF (see the module doc)."""
    if os.getpid() == 1:
        # pid 1 of its namespace: a signal from inside it that Z does not handle is dropped by the
        # kernel, so Z handles none (not even SIGINT: Python's KeyboardInterrupt handler would count)
        # and its call processes start with every signal at its default.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    else:
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)
    try:
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
    except OSError:
        pass
    if os.getpid() != 1:
        try:  # without a pid namespace, orphans of a call still come to us, not to the daemon
            syscalls.prctl(PR_SET_CHILD_SUBREAPER, 1)
        except OSError:
            pass
    kit = _make_kit(tools, init)
    kit.cpu_s = init.limits.cpu_s
    # Z and R serve every call of this worker's life: no CPU budget of their own (each call process
    # gets one; see _run_the_call).
    _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    reset = Reset(reset_roots(init))
    try:  # fewer resident pages: every fork copies their page table entries, every exit drops them
        syscalls.libc.malloc_trim(0)
    except AttributeError:
        pass
    _warm_up()
    z_end, r_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Objects the zygote already has are never collected in the children: without this, a child's
    # first GC pass would touch (and so copy) every page of the zygote's heap.
    gc.collect()
    gc.freeze()
    relay_pid = os.fork()
    if relay_pid == 0:
        code = 0
        try:
            z_end.close()
            _close_fds_except(chan.sock.fileno(), r_end.fileno())
            syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
            _Relay(chan, r_end, reset).serve()
        except BaseException:  # noqa: BLE001 (Z sees R exit and stops the worker)
            traceback.print_exc()  # our bug: to the daemon's log
            code = 1
        finally:
            os._exit(code)
    r_end.close()
    chan.sock.close()  # Z never reads the daemon channel
    try:
        _Zygote(kit, z_end, relay_pid).serve()
    finally:
        try:
            os.kill(relay_pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.waitpid(relay_pid, 0)
        except ChildProcessError:
            pass
