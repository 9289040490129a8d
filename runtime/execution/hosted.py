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
  (``runtime.execution.hosted_session.Instance``) checks every line before anything uses it.
* Calls: ``tools/call`` with a fresh id (and a progress token when the client asked for progress),
  at most ``limits.max_concurrency`` in flight per instance, the rest queued (``max_queue``, then
  "busy"). Progress is relayed within the call's budget; a log message is relayed to the call it
  belongs to when exactly one call is running on that instance (stdio carries no other link), else logged.
* Deadlines hold: a call running past ``timeout_s`` is answered "timed out" and cancelled at the
  server (``notifications/cancelled``); a client's cancellation is forwarded the same way. The server
  must then answer a ``ping`` within ``cancel_grace_s``, or it is restarted.
* ``notifications/tools/list_changed`` makes the runner list the tools again (rate-limited, see
  ``runtime.execution.hosted_session``) and tell the daemon. The catalog is the shared group's listing: a
  principal's instance listing other tools is logged and changes nothing anyone sees.
* An instance that exits or breaks fails its running calls ("the server ... exited"), is logged and
  started again with backoff; queued calls wait for it. ``instances`` > 1 spreads calls over several
  servers (least busy first); ``per_principal`` gives each principal instances of its own.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Iterator

import trio

from runtime import worker_frames
from runtime.egress_rules import Grant
from runtime.execution.hosted_session import Instance
from runtime.execution.runner import CallsInFlight, CallSlot, EventSink, PluginLoadError
from runtime.execution.watchdog import DeadlineWatchdog
from runtime.logs import log
from runtime.processes import PoolSpec
from runtime.protocol.errors import InternalError, MethodNotFound, PoolBusy, WorkerFailure, error_object
from runtime.worker_frames import FrameRejected
from sandbox import wire

BACKOFF_MAX_S = 30.0
#: An instance up this long has recovered: its restart backoff starts again from the shortest.
STABLE_AFTER_S = 30.0


class Group:
    """The instances serving one principal (or everyone), and the calls waiting for them."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.instances: list[Instance] = []
        self.starting = 0
        self.queue: collections.deque[CallSlot] = collections.deque()
        self.failures = 0
        self.last_used = time.monotonic()
        self.last_error = ""


class HostedRunner(CallsInFlight):
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
        self.watchdog = DeadlineWatchdog(self._running, self._ask_timed_out, self._timed_out)

    # -- the pool interface (``runtime.calls``) --------------------------------------------------

    @property
    def workers(self) -> list[Instance]:
        """The live instances, of every group."""
        return [i for g in self.groups.values() for i in g.instances if not i.dead]

    def queued(self) -> int:
        return sum(len(g.queue) for g in self.groups.values())

    def alive(self) -> int:
        return sum(1 for g in self.groups.values() for i in g.instances if not i.dead)

    async def start(self) -> wire.Ready:
        """Start the shared group's first instance (it lists the tools), then the rest in the background."""
        group = self._group(None)
        assert group is not None
        first = Instance(self, group)
        self.tools = await first.start()
        group.instances.append(first)
        self.watchdog.start(self.nursery)
        if not self.spec.describe_only:
            for _ in range(self.server.instances - 1):
                self._spawn(group)
        return wire.Ready(first.server_pid, self.tools, layers=self.layers)

    def new_slot(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: EventSink | None, on_done: Callable[[CallSlot], None] | None = None,
                 principal: str | None = None, trace: str = "") -> CallSlot:
        # ``arguments`` came from JSON and go back to JSON: nothing to encode here. The principal
        # matters only to a server with instances per principal.
        return CallSlot(wire.Call(0, tool, arguments, progress, log_level, trace), on_event=on_event,
                        on_done=on_done, principal=principal if self.server.per_principal else None)

    def submit(self, slot: CallSlot) -> None:
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

    def withdraw(self, slot: CallSlot) -> None:
        """The client cancelled: nothing more is reported; a running call is cancelled at the server."""
        if not slot.abandon():
            return
        instance = slot.instance
        if slot.asking is not None:
            # The server's question to this call's client stays unanswered no more: the server hears so.
            server_id, asked = slot.server_request
            slot.asking = slot.server_request = None
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
            self._fail_queue(group, error)
            for instance in list(group.instances):
                instance.fail(error)

    async def aclose(self, grace_s: float = 2.0) -> None:
        self.closed = True
        error = WorkerFailure("unavailable", f"plugin {self.name} was unloaded")
        for group in self.groups.values():
            self._fail_queue(group, error)
        with trio.move_on_after(grace_s):
            await self._drained()
        instances = [i for g in self.groups.values() for i in g.instances]
        for instance in instances:
            if not instance.dead:
                instance.fail(error)
        self.watchdog.stop()

    def _fail_queue(self, group: Group, error: WorkerFailure) -> None:
        while group.queue:
            slot = group.queue.popleft()
            slot.error = error
            self.complete(slot)

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
                    self._fail_queue(group, WorkerFailure("unavailable",
                                                          f"the server could not be started: {exc.message}"))
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

    def complete(self, slot: CallSlot) -> None:
        if slot.finished:
            return
        if slot.instance is not None:
            slot.instance.forget(slot)
        self._release()
        slot.finish()
        instance = slot.instance
        if instance is not None and not self.closed:
            self._dispatch(instance.group)

    def relay(self, slot: CallSlot, frame: Any, size: int) -> None:
        """One progress or log notification of ``slot``, within the call's budget (as ``WorkerPool._relay``)."""
        try:
            worker_frames.check_notification(frame)
        except FrameRejected:
            return
        slot.relay(frame, size, self.limits, self.name)

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

    # -- the server's questions (elicitation, sampling, roots) during a call ------------------------

    def ask(self, slot: CallSlot, instance: Instance, server_id: Any, method: str, params: dict[str, Any]) -> None:
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
        slot.server_request = (server_id, instance)
        self.watchdog.pause_for_question(slot, ask, limits.ask_timeout_s)
        slot.on_event(ask)

    def answer(self, slot: CallSlot, responses: list[wire.InputResponse], missing: str = "error",
               why: str = "the client gave no answer", to: wire.Ask | None = None) -> bool:
        """The client's answer to the server's question (see ``WorkerPool.answer``), sent to the server."""
        ask = slot.asking
        if ask is None or slot.finished or (to is not None and to is not ask):
            return False
        server_id, instance = slot.server_request
        slot.server_request = None
        self.watchdog.resume_after_answer(slot)
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
        """A deadline was set (``Instance.call``)."""
        self.watchdog.wake(deadline)

    def _running(self) -> Iterator[tuple[CallSlot, Instance]]:
        for group in list(self.groups.values()):
            for instance in list(group.instances):
                for slot in list(instance.pending.values()):
                    yield slot, instance

    def _ask_timed_out(self, slot: CallSlot, instance: Instance) -> None:
        # The question found no answer in time: the server hears so and goes on.
        self.answer(slot, [], "timeout", f"the client did not answer within {self.limits.ask_timeout_s:g} s")

    def _timed_out(self, slot: CallSlot, instance: Instance) -> None:
        if slot.finished:
            return  # ended earlier in this pass
        instance.cancel(slot, "timed out")
        slot.error = WorkerFailure("timeout", f"timed out after {self.limits.timeout_s:g} s")
        self.complete(slot)

