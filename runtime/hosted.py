"""Hosted MCP servers: an existing server (npm, PyPI, any executable) run in a worker sandbox, its
tools served in the catalog like a plugin's. The daemon is the server's MCP client.

How this works:

* A plugin of kind "server" gets a ``HostedRunner`` where other plugins get a ``WorkerPool``; the
  call dispatcher (``runtime.calls``) cannot tell them apart (``new_slot``, ``submit``, ``withdraw``).
* Each instance is one worker process started like any worker (``Init`` over its IPC fd, every
  isolation layer, the same limits, the egress proxy for a network grant), which then executes the
  server (``sandbox.hosted``) with its stdin and stdout piped to this module. Why the client lives
  here and not in the worker: an MCP server takes many requests at once, and the daemon already
  multiplexes, times out and relays; a client in the worker would add a second hop, a second decode of
  every message and a process of its own, and would be no more trusted than the server beside it.
* Everything the server writes is untrusted: the session with each process
  (``runtime.hosted_session.Instance``) checks every line before anything uses it.
* Calls: ``tools/call`` with a fresh id (and a progress token when the client asked for progress),
  at most ``limits.max_concurrency`` in flight per instance, the rest queued (``max_queue``, then
  "busy"). Progress is relayed within the call's budget; a log message is relayed to the call it
  belongs to when exactly one call is running on that instance (stdio carries no other link), else logged.
* Deadlines hold: a call running past ``timeout_s`` is answered "timed out" and cancelled at the
  server (``notifications/cancelled``); a client's cancellation is forwarded the same way. The server
  must then answer a ``ping`` within ``cancel_grace_s``, or it is restarted.
* ``notifications/tools/list_changed`` makes the runner list the tools again (rate-limited, see
  ``runtime.hosted_session``) and tell the daemon. The catalog is the shared group's listing: a
  principal's instance listing other tools is logged and changes nothing anyone sees.
* An instance that exits or breaks fails its running calls ("the server ... exited"), is logged and
  started again with backoff; queued calls wait for it. ``instances`` > 1 spreads calls over several
  servers (least busy first); ``per_principal`` gives each principal instances of its own.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable

import trio

from runtime import worker_frames
from runtime.egress_rules import Grant
from runtime.hosted_session import Instance
from runtime.logs import log
from runtime.processes import PoolSpec
from runtime.protocol.errors import InternalError, MethodNotFound, PoolBusy, WorkerFailure, error_object
from runtime.worker_frames import FrameRejected
from runtime.workers import PluginLoadError
from sandbox import wire

BACKOFF_MAX_S = 30.0
#: An instance up this long has recovered: its restart backoff starts again from the shortest.
STABLE_AFTER_S = 30.0


class HostedSlot:
    """One call on its way to a hosted server (the dispatcher's handle)."""

    __slots__ = ("tool", "arguments", "progress", "log_level", "on_event", "on_done", "result", "error", "finished",
                 "principal", "request_id", "instance", "deadline", "notes", "note_bytes", "notes_dropped", "asking",
                 "asks", "run_left_s", "trace")

    def __init__(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: Callable[[Any], None] | None, on_done: Callable[[Any], None] | None,
                 principal: str | None, trace: str = "") -> None:
        self.tool = tool
        #: The call's trace context (``runtime.tracing``), for the server's ``_meta.traceparent``.
        self.trace = trace
        self.arguments = arguments
        self.progress = progress
        self.log_level = log_level
        self.on_event = on_event
        self.on_done = on_done
        self.result: wire.Result | None = None
        self.error: WorkerFailure | None = None
        self.finished = False
        self.principal = principal
        self.request_id = 0
        self.instance: Instance | None = None
        self.deadline = math.inf
        self.notes = 0
        self.note_bytes = 0
        self.notes_dropped = 0
        #: The server's question the call waits on: (our Ask, the server's request id, its instance).
        self.asking: tuple[wire.Ask, Any, Any] | None = None
        self.asks = 0
        self.run_left_s = 0.0

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        on_done, self.on_done = self.on_done, None
        self.on_event = None
        if on_done is not None:
            try:
                on_done(self)
            except Exception as exc:  # our bug; the runner keeps going
                log("internal_error", level="error", where="hosted call completion", error=f"{type(exc).__name__}: {exc}")


class Group:
    """The instances serving one principal (or everyone), and the calls waiting for them."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.instances: list[Instance] = []
        self.starting = 0
        self.queue: collections.deque[HostedSlot] = collections.deque()
        self.failures = 0
        self.last_used = time.monotonic()
        self.last_error = ""


class HostedRunner:
    """Runs the calls of one hosted server plugin (one version of it): see the module docstring."""

    def __init__(self, spec: PoolSpec, nursery: trio.Nursery, argv: list[str], command_read: list[str]) -> None:
        manifest = spec.manifest
        assert manifest.server is not None
        self.spec = spec
        self.server = manifest.server
        self.name = manifest.name
        self.limits = manifest.limits
        self.nursery = nursery
        self.argv = argv
        self.command_read = command_read
        self.grant = Grant.parse(manifest.permissions.network)
        #: Read by ``runtime.calls``: calls carry their principal here.
        self.per_principal = manifest.server.per_principal
        self.max_line_bytes = max(self.limits.max_output_bytes, self.limits.max_notification_bytes) + 65536
        self.groups: dict[str, Group] = {}
        self.closed = False
        self.retiring = False
        self.restarts = 0
        self.limit_kills = 0
        self.in_flight = 0
        self.layers: list[str] = []
        #: The catalog's tools: what the shared group's instances list (a principal's never change it).
        self.tools: list[wire.ToolSpec] = []
        #: Set by the daemon: the server listed different tools (``list_changed``).
        self.on_tools_changed: Callable[[list[wire.ToolSpec]], None] | None = None
        self._drain: trio.Event | None = None
        self._watch_wake = trio.Event()
        self._watch_at = math.inf
        self._watchdog_started = False

    # -- the pool interface (``runtime.calls``) --------------------------------------------------

    @property
    def queue(self) -> list[HostedSlot]:
        return [s for g in self.groups.values() for s in g.queue]

    @property
    def workers(self) -> list[Instance]:
        return [i for g in self.groups.values() for i in g.instances if not i.dead]

    async def start(self) -> wire.Ready:
        """Start the shared group's first instance (it lists the tools), then the rest in the background."""
        group = self._group(None)
        assert group is not None
        first = Instance(self, group)
        self.tools = await first.start()
        group.instances.append(first)
        if not self._watchdog_started:
            self._watchdog_started = True
            self.nursery.start_soon(self._watchdog)
        if not self.spec.describe_only:
            for _ in range(self.server.instances - 1):
                self._spawn(group)
        return wire.Ready(first.server_pid, self.tools, layers=self.layers)

    def new_slot(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: Callable[[Any], None] | None, on_done: Callable[[Any], None] | None = None,
                 principal: str | None = None, trace: str = "") -> HostedSlot:
        # ``arguments`` came from JSON and go back to JSON: nothing to check here.
        return HostedSlot(tool, arguments, progress, log_level, on_event, on_done, principal, trace)

    def submit(self, slot: HostedSlot) -> None:
        if self.closed or self.retiring:
            raise WorkerFailure("unavailable", f"plugin {self.name} is shutting down")
        group = self._group(slot.principal)
        if group is None:
            raise PoolBusy(f"plugin {self.name} already serves {self.server.max_principals} principals; retry later")
        waiting = len(group.queue)
        if waiting >= self.limits.max_queue and not self._free(group):
            raise PoolBusy(f"plugin {self.name} is busy ({self.limits.max_queue} calls waiting); retry later")
        group.last_used = time.monotonic()
        self.in_flight += 1
        group.queue.append(slot)
        self._dispatch(group)

    def withdraw(self, slot: HostedSlot) -> None:
        """The client cancelled: nothing more is reported; a running call is cancelled at the server."""
        if slot.finished:
            return
        slot.on_done = None
        slot.on_event = None
        instance = slot.instance
        if slot.asking is not None:
            # The server's question to this call's client stays unanswered no more: the server hears so.
            _, server_id, asked = slot.asking
            slot.asking = None
            asked.send({"jsonrpc": "2.0", "id": server_id,
                        "error": error_object(InternalError("the call was cancelled by the client"))})
        if instance is not None and not instance.dead and slot.request_id in instance.pending:
            instance.cancel(slot, "cancelled by the client")
        else:
            for group in self.groups.values():
                if slot in group.queue:
                    group.queue.remove(slot)
        self._release()
        slot.finish()
        if instance is not None:
            self._dispatch(instance.group)

    def abort_all(self, reason: str) -> None:
        error = WorkerFailure("unavailable", reason)
        for group in self.groups.values():
            while group.queue:
                slot = group.queue.popleft()
                slot.error = error
                self.complete(slot)
            for instance in list(group.instances):
                instance.fail(error)

    async def retire(self) -> None:
        self.retiring = True
        try:
            while self.in_flight:
                self._drain = trio.Event()
                await self._drain.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose(grace_s=0)

    async def aclose(self, grace_s: float = 2.0) -> None:
        self.closed = True
        error = WorkerFailure("unavailable", f"plugin {self.name} was unloaded")
        for group in self.groups.values():
            while group.queue:
                slot = group.queue.popleft()
                slot.error = error
                self.complete(slot)
        with trio.move_on_after(grace_s):
            while self.in_flight:
                self._drain = trio.Event()
                await self._drain.wait()
        instances = [i for g in self.groups.values() for i in g.instances]
        for instance in instances:
            if not instance.dead:
                instance.fail(error)
        self._watch_wake.set()

    # -- scheduling ----------------------------------------------------------------------------

    def _group(self, principal: str | None) -> Group | None:
        key = (principal or "") if self.server.per_principal else ""
        group = self.groups.get(key)
        if group is None:
            if self.server.per_principal and len(self.groups) > self.server.max_principals:
                self._drop_idle_groups()
                if len(self.groups) > self.server.max_principals:
                    return None
            group = self.groups[key] = Group(key)
        return group

    def _drop_idle_groups(self) -> None:
        idle = sorted((g for k, g in self.groups.items() if k and not g.queue and not g.starting
                       and not any(i.pending for i in g.instances)), key=lambda g: g.last_used)
        for group in idle[: max(1, len(idle) // 2)]:
            del self.groups[group.key]
            for instance in group.instances:
                instance.fail(WorkerFailure("unavailable", "idle instance stopped"))

    def _current(self, group: Group) -> bool:
        """Whether ``group`` is still the runner's (a dropped one may have a successor under its key)."""
        return self.groups.get(group.key) is group

    def _free(self, group: Group) -> Instance | None:
        best: Instance | None = None
        for instance in group.instances:
            if instance.ready and not instance.dead and instance.load < self.limits.max_concurrency:
                if best is None or instance.load < best.load:
                    best = instance
        return best

    def _dispatch(self, group: Group) -> None:
        while group.queue:
            instance = self._free(group)
            if instance is None:
                break
            instance.call(group.queue.popleft())
        alive = sum(1 for i in group.instances if not i.dead)
        if group.queue and alive + group.starting < self.server.instances and not group.failures:
            self._spawn(group)
        elif group.queue and alive + group.starting == 0:
            self._spawn(group)

    def _spawn(self, group: Group) -> None:
        if self.closed:
            return
        group.starting += 1
        self.nursery.start_soon(self._start_instance, group)

    async def _start_instance(self, group: Group) -> None:
        delay = 0.0 if not group.failures else min(BACKOFF_MAX_S, 0.25 * 2 ** min(group.failures - 1, 8))
        try:
            if delay:
                await trio.sleep(delay)
            if self.closed:
                return
            instance = Instance(self, group)
            try:
                tools = await instance.start()
            except PluginLoadError as exc:
                group.failures += 1
                group.last_error = exc.message
                log("hosted_server_start_failed", level="error", plugin=self.name, stage=exc.stage,
                    error=exc.message, attempt=group.failures)
                if not any(not i.dead for i in group.instances):
                    error = WorkerFailure("unavailable", f"the server could not be started: {exc.message}")
                    while group.queue:
                        slot = group.queue.popleft()
                        slot.error = error
                        self.complete(slot)
                return
            if self.closed or not self._current(group):  # unloaded, or the group was dropped
                instance.fail(WorkerFailure("unavailable", f"plugin {self.name} was unloaded"))
                return
            group.instances = [i for i in group.instances if not i.dead]
            group.instances.append(instance)
            log("hosted_server_started", plugin=self.name, pid=instance.server_pid, principal=group.key or None,
                instances=len(group.instances))
            if tools != self.tools:
                self.tools_listed(instance, tools)
        finally:
            group.starting -= 1
            self._dispatch(group)

    def instance_ended(self, instance: Instance, error: WorkerFailure) -> None:
        group = instance.group
        if instance in group.instances:
            group.instances.remove(instance)
        if self.closed or not instance.ready:
            return
        self.restarts += 1
        if error.kind in ("memory", "processes", "timeout", "output_cap"):
            self.limit_kills += 1
        up = time.monotonic() - instance.started_at
        group.failures = 0 if up >= STABLE_AFTER_S else group.failures + 1
        log("hosted_server_exited", level="warning", plugin=self.name, pid=instance.server_pid, kind=error.kind,
            reason=error.message, up_s=round(up, 1), restart_in_s=min(BACKOFF_MAX_S, 0.25 * 2 ** max(0, group.failures - 1))
            if group.failures else 0)
        if not self._current(group):
            return  # a dropped group (a principal's, idle): nothing to keep up
        # Keep the group at its size: a shared group always, a principal's while it has work.
        if not group.key or group.queue:
            self._spawn(group)

    def complete(self, slot: HostedSlot) -> None:
        if slot.finished:
            return
        if slot.instance is not None:
            slot.instance.forget(slot)
        self._release()
        slot.finish()
        instance = slot.instance
        if instance is not None and not self.closed:
            self._dispatch(instance.group)

    def _release(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._drain is not None:
            self._drain.set()

    def relay(self, slot: HostedSlot, frame: Any, size: int) -> None:
        """One progress or log notification of ``slot``, within the call's budget (as ``WorkerPool._relay``)."""
        try:
            if type(frame) is wire.Log:
                worker_frames.check_log(frame)
            else:
                worker_frames.check_progress(frame)
        except FrameRejected:
            return
        if slot.on_event is None:
            return
        frame = worker_frames.within_budget(slot, frame, size, self.limits, self.name, slot.tool)
        if frame is not None:
            slot.on_event(frame)

    def tools_listed(self, instance: Instance, tools: list[wire.ToolSpec]) -> None:
        """``instance`` listed ``tools`` (at start-up or after ``list_changed``). Only the shared group's
        listing is the catalog: a principal's instance listing other tools changes nothing anyone else
        sees (two principals never share a server's state, ``ServerSpec.per_principal``)."""
        if tools == self.tools:
            return
        if instance.group.key:
            instance.log_capped("hosted_principal_tools_ignored", tools=len(tools),
                                note="a principal's instance listed other tools; the catalog is the shared one's")
            return
        self.tools = tools
        log("hosted_tools_changed", plugin=self.name, tools=len(tools))
        if self.on_tools_changed is not None:
            try:
                self.on_tools_changed(tools)
            except Exception as exc:  # our bug; the server keeps serving
                log("internal_error", level="error", where="hosted tools changed", error=f"{type(exc).__name__}: {exc}")

    # -- deadlines -----------------------------------------------------------------------------

    # -- the server's questions (elicitation, sampling, roots) during a call ------------------------

    def ask(self, slot: HostedSlot, instance: Instance, server_id: Any, method: str, params: dict[str, Any]) -> None:
        """The server asks, during ``slot``'s call, what a tool would ask: the call's client is asked
        (``CallDispatcher.answer`` brings the answer back to ``answer``); the deadline stops meanwhile."""
        def refuse(message: str) -> None:
            instance.send({"jsonrpc": "2.0", "id": server_id, "error": error_object(InternalError(message))})

        limits = self.limits
        if slot.on_event is None or slot.asking is not None:
            return refuse("the call cannot ask anything now")
        slot.asks += 1
        if slot.asks > limits.max_asks:
            return refuse(f"the call asked more than {limits.max_asks} questions (limits.max_asks)")
        # Numbered per call, so that a call run again from the start asks under the same keys.
        ask = wire.Ask(slot.request_id, [wire.InputRequest(f"ask-{slot.asks}", method, params)])
        now = trio.current_time()
        slot.run_left_s = max(0.0, slot.deadline - now)
        slot.asking = (ask, server_id, instance)
        slot.deadline = now + limits.ask_timeout_s
        self.wake_watchdog(slot.deadline)
        slot.on_event(ask)

    def answer(self, slot: HostedSlot, responses: list[wire.InputResponse], missing: str = "error",
               why: str = "the client gave no answer", to: wire.Ask | None = None) -> bool:
        """The client's answer to the server's question (see ``WorkerPool.answer``), sent to the server."""
        if slot.asking is None or slot.finished:
            return False
        ask, server_id, instance = slot.asking
        if to is not None and to is not ask:
            return False
        slot.asking = None
        slot.deadline = trio.current_time() + slot.run_left_s
        self.wake_watchdog(slot.deadline)
        key = ask.requests[0].key
        response = next((r for r in responses if r.key == key), None) or wire.InputResponse(key, missing, message=why)
        if response.outcome == "result" and isinstance(response.result, dict):
            instance.send({"jsonrpc": "2.0", "id": server_id, "result": response.result})
        else:
            message = response.message or f"no answer ({response.outcome})"
            error = MethodNotFound(message) if response.outcome == "declined_capability" else InternalError(message)
            instance.send({"jsonrpc": "2.0", "id": server_id, "error": error_object(error)})
        return True

    def wake_watchdog(self, deadline: float) -> None:
        """A deadline was set: wake the watchdog if it would sleep past it (or is mid-pass)."""
        if deadline < self._watch_at:
            self._watch_wake.set()

    async def _watchdog(self) -> None:
        while not self.closed:
            # A pass can start calls (an expired call's slot goes to the next queued one) and so set
            # deadlines the pass may not see: while it runs, any new deadline sets this pass's event,
            # and the loop goes round again at once (it used to compare with the expired ``_watch_at``
            # and then replace the event, so that call had no deadline at all).
            self._watch_wake = trio.Event()
            self._watch_at = math.inf
            now = trio.current_time()
            nearest = math.inf
            for group in list(self.groups.values()):
                for instance in list(group.instances):
                    for slot in list(instance.pending.values()):
                        if slot.deadline <= now and slot.asking is not None:
                            # The question found no answer in time: the server hears so and goes on.
                            self.answer(slot, [], "timeout",
                                        f"the client did not answer within {self.limits.ask_timeout_s:g} s")
                            nearest = min(nearest, slot.deadline)
                        elif slot.deadline <= now:
                            instance.cancel(slot, "timed out")
                            slot.error = WorkerFailure("timeout", f"timed out after {self.limits.timeout_s:g} s")
                            self.complete(slot)
                        else:
                            nearest = min(nearest, slot.deadline)
            self._watch_at = nearest
            with trio.move_on_at(nearest):
                await self._watch_wake.wait()
