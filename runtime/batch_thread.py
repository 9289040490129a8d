"""One dedicated thread that runs blocking jobs for trio tasks, in batches.

The task stores talk to SQLite and Redis through blocking clients. Handing each call to
``trio.to_thread.run_sync`` costs a thread hand-off per call and lets calls run in any order on any
thread; instead, every job goes to one thread that owns the connection. Jobs that pile up while it
is busy are handed to the backend's ``run_batch`` together (Redis sends them as one pipeline), and
their trio tasks are woken with one ``run_sync_soon`` per batch.

Like ``trio.to_thread.run_sync``, a job cannot be cancelled once submitted: the waiting task
ignores cancellation until the job is done, so a write is never half-known.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import outcome
import trio

J = TypeVar("J")

_Item = tuple[J, trio.lowlevel.Task, trio.lowlevel.TrioToken]


class BatchThread(Generic[J]):
    """Runs ``run_batch(jobs) -> outcomes`` (one outcome per job, in order) on a dedicated thread.

    ``run_batch`` runs only on that thread and must not raise (it captures each job's error in the
    job's outcome); ``on_close`` runs there last, when ``aclose`` is called. ``translate`` turns a
    job's exception into the one its caller sees (a client library's into the store's own).
    """

    def __init__(self, name: str, run_batch: Callable[[Sequence[J]], Sequence[outcome.Outcome[Any]]],
                 on_close: Callable[[], None] = lambda: None, max_batch: int = 256,
                 translate: Callable[[Exception], Exception] = lambda exc: exc) -> None:
        self._run_batch = run_batch
        self._on_close = on_close
        self._translate = translate
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Item[J] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    async def run(self, job: J) -> Any:
        """Submit ``job`` and wait for its result (or its exception)."""
        if self._closed:
            raise trio.ClosedResourceError("the task store is closed")
        self._queue.put((job, trio.lowlevel.current_task(), trio.lowlevel.current_trio_token()))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    async def aclose(self) -> None:
        """Finish the jobs already submitted, run ``on_close``, and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        await trio.to_thread.run_sync(self._thread.join)

    def _main(self) -> None:
        stopping = False
        while not stopping:
            batch: list[_Item[J]] = []
            item = self._queue.get()
            while True:
                if item is None:
                    stopping = True
                else:
                    batch.append(item)
                if len(batch) >= self._max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._finish(batch)
        with contextlib.suppress(Exception):  # closing a connection that is already broken is no news
            self._on_close()

    def _finish(self, batch: list[_Item[J]]) -> None:
        try:
            results = list(self._run_batch([job for job, _, _ in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} outcomes for {len(batch)} jobs")
        except BaseException as exc:  # our bug: still wake every waiter, with the error
            results = [outcome.Error(exc) for _ in batch]
        results = [outcome.Error(self._translate(r.error)) if isinstance(r, outcome.Error)
                   and isinstance(r.error, Exception) else r for r in results]
        by_token: dict[trio.lowlevel.TrioToken, list[tuple[trio.lowlevel.Task, outcome.Outcome[Any]]]] = {}
        for (_, task, token), result in zip(batch, results, strict=True):
            by_token.setdefault(token, []).append((task, result))
        for token, wakes in by_token.items():
            try:
                token.run_sync_soon(_wake, wakes)
            except trio.RunFinishedError:
                pass


def _wake(wakes: list[tuple[trio.lowlevel.Task, outcome.Outcome[Any]]]) -> None:
    for task, result in wakes:
        trio.lowlevel.reschedule(task, result)
