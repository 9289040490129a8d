"""One deadline watchdog per runner (a plugin's pool, a hosted server): the only place a running call's
deadline is enforced.

It sleeps until the nearest deadline of a running call, then goes over the running calls: a call whose
question found no answer in time is answered "timeout" and goes on (its deadline runs again); a call
past its deadline is stopped, the runner's way (a worker is killed; a hosted call is cancelled at its
server). Anything that sets a deadline calls ``wake``: a pass may start calls (an expired call's place
goes to the next queued one), so any deadline set while a pass runs makes the loop go round again at
once rather than being compared with the deadline that just expired.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import trio

from runtime.execution.runner import CallSlot
from sandbox import wire

#: The calls whose deadline runs now, each with where it runs (a worker, an instance).
Running = Callable[[], Iterable[tuple[CallSlot, Any]]]
Expired = Callable[[CallSlot, Any], None]


class DeadlineWatchdog:
    """Enforces the deadlines of a runner's running calls (see the module docstring)."""

    def __init__(self, running: Running, ask_timed_out: Expired, timed_out: Expired) -> None:
        self._running = running
        self._ask_timed_out = ask_timed_out
        self._timed_out = timed_out
        self._wake = trio.Event()
        self._at = float("inf")
        self._started = False
        self._stopped = False

    def start(self, nursery: trio.Nursery) -> None:
        """Start watching (once; later calls do nothing)."""
        if not self._started:
            self._started = True
            nursery.start_soon(self.serve)

    def wake(self, deadline: float) -> None:
        """A deadline was set: wake the watchdog if it would sleep past it (or is mid-pass)."""
        if deadline < self._at:
            self._wake.set()

    def poke(self) -> None:
        """Look again now (a deadline moved later, or calls ended)."""
        self._wake.set()

    def pause_for_question(self, slot: CallSlot, ask: wire.Ask, ask_timeout_s: float) -> None:
        """``slot`` asks its client ``ask``: its deadline stops (what is left is kept) and the question
        gets ``ask_timeout_s`` to be answered."""
        now = trio.current_time()
        slot.run_left_s = max(0.0, slot.deadline - now)
        slot.asking = ask
        slot.deadline = now + ask_timeout_s
        self.wake(slot.deadline)

    def resume_after_answer(self, slot: CallSlot) -> None:
        """``slot``'s question was answered (or timed out): its deadline runs again with what was left."""
        slot.asking = None
        slot.deadline = trio.current_time() + slot.run_left_s
        self.poke()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def serve(self) -> None:
        while not self._stopped:
            self._wake = trio.Event()
            self._at = float("inf")
            now = trio.current_time()
            nearest = float("inf")
            for slot, place in list(self._running()):
                if slot.deadline <= now and slot.asking is not None:
                    # A question that found no answer in time: the call hears so and goes on.
                    self._ask_timed_out(slot, place)
                    nearest = min(nearest, slot.deadline)
                elif slot.deadline <= now:
                    self._timed_out(slot, place)
                else:
                    nearest = min(nearest, slot.deadline)
            self._at = nearest
            with trio.move_on_at(nearest):
                await self._wake.wait()
