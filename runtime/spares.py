"""A spare worker: one interpreter started ahead of time, waiting for the plugin it will serve.

Starting a worker is mostly starting Python and importing ``sandbox`` (msgspec, the authoring API,
the isolation layers): 40-50 ms of CPU, two to three times that in wall time when the machine is
busy serving calls. The spare has done all of that before anyone needs it, so the next worker to
start (the first worker of a changed plugin's new version, in a hot reload) only has to isolate
itself and import its plugin.

What a spare is, and is not:

* A fresh ``exec`` of the same bootstrap as every worker (``spawn_process``), with the same minimal
  environment minus anything plugin-specific; each worker still has its own address-space layout
  and hash secret. It is not a fork server: nothing is shared between workers.
* It holds nothing: it has read nothing but its own code, and waits on its IPC socket, which only
  the daemon holds. The ``Init`` frame it gets when it is taken carries the plugin's configuration
  (and environment, which the worker adopts: ``sandbox.worker.main(spare=True)``); from there it
  runs exactly like any worker: hygiene and isolation first, *then* the plugin's code.
* Only a plugin whose environment agrees with the spare's on what the interpreter and the C
  library read when a process starts (locale, malloc and glibc tunables) can take it; any other
  plugin gets a fresh process, as before.
* There is one spare per daemon. The next one is started once the worker that took it is Ready
  (``restock``), so that the two do not compete for the CPU.
"""

from __future__ import annotations

import contextvars
import os
import re
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from runtime.logs import log
from runtime.processes import LIVE_WORKER_TOKENS, SPAWNED, WORKER_MARKER, PoolSpec, kill_tree, spawn_process

#: Start the next spare at the latest this long after one was taken (``restock`` usually comes first).
RESTOCK_AFTER_S = 5.0
#: Variables read when a process starts, not later: a spare started without the plugin's values
#: cannot serve it. (``PYTHON*`` and ``LD_*`` never reach a plugin; ``TZ`` is re-read on adoption.)
_READ_AT_START = re.compile(r"^(LANG|LANGUAGE|LC_\w+|MALLOC_\w+|GLIBC_\w+)$")


class Spare:
    """A started worker interpreter that has not been given its plugin yet."""

    __slots__ = ("env", "proc", "raw", "token")

    def __init__(self, proc: trio.Process, raw: socket.socket, token: str, env: dict[str, str]) -> None:
        self.proc = proc
        self.raw = raw
        self.token = token
        self.env = env


class Spares:
    """Keeps one ``Spare`` ready (``serve``); a pool starting a worker ``take``s it."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self._spare: Spare | None = None
        self._taken = trio.Event()
        self._restock = trio.Event()
        self.started = 0
        self.taken = 0

    @property
    def ready_pid(self) -> int | None:
        """The pid of the spare waiting to be taken, if there is one."""
        spare = self._spare
        return spare.proc.pid if spare is not None and spare.proc.poll() is None else None

    def take(self, spec: PoolSpec) -> Spare | None:
        """The ready spare if it can serve ``spec``'s plugin (and is alive), else None."""
        spare = self._spare
        if spare is None or spare.proc.poll() is not None:
            return None
        wanted = spec.env()
        keys = {k for k in (*wanted, *spare.env) if _READ_AT_START.match(k)}
        if any(wanted.get(k) != spare.env.get(k) for k in keys):
            return None
        self._spare = None
        self.taken += 1
        self._taken.set()
        return spare

    def restock(self) -> None:
        """The worker that took the spare is Ready (or failed): time to start the next one."""
        self._restock.set()

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a spare ready until cancelled (then kill the one left)."""
        task_status.started()
        failures = 0
        while True:
            token = secrets.token_hex(8)
            env = PoolSpec.base_env()
            env[WORKER_MARKER] = f"spare:{token}"
            LIVE_WORKER_TOKENS.add(token)
            try:
                os.makedirs(self.state_dir, mode=0o711, exist_ok=True)
                proc, raw = await spawn_process(env, self.state_dir, spare=True)
            except OSError as exc:
                LIVE_WORKER_TOKENS.discard(token)
                failures += 1
                log("spare_start_failed", level="warning", error=str(exc))
                await trio.sleep(min(60.0, 0.5 * 2 ** min(failures, 7)))
                continue
            self.started += 1
            spare = Spare(proc, raw, token, env)
            self._spare = spare
            self._taken = trio.Event()
            self._restock = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_exit, proc, nursery.cancel_scope)
                    await self._taken.wait()
                    nursery.cancel_scope.cancel()
            finally:
                if self._spare is spare:  # it died, or we are shutting down: it is still ours
                    self._spare = None
                    with trio.CancelScope(shield=True):
                        await _discard(spare)
            if self._taken.is_set():
                failures = 0
                with trio.move_on_after(RESTOCK_AFTER_S):
                    await self._restock.wait()
            else:
                failures += 1
                log("spare_exited", level="warning", pid=proc.pid, returncode=proc.returncode)
                await trio.sleep(min(60.0, 0.5 * 2 ** min(failures, 7)))


async def _cancel_on_exit(proc: trio.Process, scope: trio.CancelScope) -> None:
    await proc.wait()
    scope.cancel()


async def _discard(spare: Spare) -> None:
    kill_tree(spare.proc.pid)
    spare.raw.close()
    await spare.proc.wait()
    SPAWNED.pop(spare.proc.pid, None)
    if spare.proc.stdout is not None:
        await spare.proc.stdout.aclose()
    LIVE_WORKER_TOKENS.discard(spare.token)


#: The spares of the daemon whose tasks these are (set by ``open_daemon`` while serving).
current: contextvars.ContextVar[Spares | None] = contextvars.ContextVar("toolcell_spares", default=None)


@contextmanager
def installed(spares: Spares) -> Iterator[None]:
    """Make ``spares`` the ones ``current`` returns in this task and the tasks it starts."""
    reset = current.set(spares)
    try:
        yield
    finally:
        current.reset(reset)
