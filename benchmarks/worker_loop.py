"""What a pooled worker's own loop costs per call, apart from the daemon: ``sandbox.worker.serve`` in a
forked child (no isolation layer) over a socket pair, fed ``echo`` calls in batches from the parent,
with and without the after-call guard (``sandbox.call_guard``: the thread count, the ``waitpid`` for
leftover processes, the CPU limit). Prints the child's CPU per call (user + system) and its calls/s.

``--memory``: ``serve`` on calls already in memory instead (a stand-in socket that takes every answer
and has nothing more to read): what the loop itself costs per call, without the socket's syscalls and
wake-ups, which make up most of a batch-1 call and most of this machine's run-to-run noise. The
figure to compare two trees with for a change of the worker's own code.

    python benchmarks/worker_loop.py [--calls 40000] [--batch 1,8] [--repeat 3] [--tree DIR] [--memory]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

#: The source tree measured: this file's, or ``--tree DIR`` (another checkout, to compare two).
TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else str(Path(__file__).resolve().parents[1])
sys.path.insert(0, TREE)

from sandbox import api, worker  # noqa: E402
from sandbox.wire import Call, Result, encode_frame, from_worker_decoder, split_frames  # noqa: E402


@api.tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


def run_once(calls: int, batch: int, guard_cpu_s: int) -> tuple[float, float]:
    """(worker CPU µs per call, calls/s) for one run."""
    tools = {t.name: t for t in api.TOOLS}
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the worker: serve until the socket closes
        ours.close()
        worker.serve(worker.Channel(theirs.detach()), tools, guard_cpu_s)
        os._exit(0)
    theirs.close()
    frames = [encode_frame(Call(i, "echo", {"text": "hi"})) for i in range(calls)]
    buf = bytearray()
    got = sent = 0
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    while got < calls:
        ours.sendall(b"".join(frames[sent:sent + batch]))
        sent += batch
        want = min(calls, got + batch)
        while got < want:
            chunk = ours.recv(1 << 20)
            if not chunk:
                raise SystemExit("the worker closed its socket")
            buf += chunk
            # Answers only (a worker of an older tree follows each Result with a CallReturned frame).
            got += sum(isinstance(from_worker_decoder.decode(f), Result) for f in split_frames(buf))
    wall = time.perf_counter() - start
    ours.close()
    os.waitpid(pid, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu / calls * 1e6, calls / wall


class _MemorySocket:
    """Takes every answer; nothing more to read (the calls are in the channel's buffer already)."""

    def sendall(self, data: bytes) -> None:
        pass

    def recv(self, size: int, flags: int = 0) -> bytes:
        if flags & socket.MSG_DONTWAIT:
            raise BlockingIOError
        return b""  # the end of the calls: serve returns


def run_in_memory(calls: int, guard_cpu_s: int) -> tuple[float, float]:
    """(worker CPU µs per call, calls/s) for ``serve`` on ``calls`` calls in memory, in a forked child
    (the guard moves this process's CPU limit)."""
    tools = {t.name: t for t in api.TOOLS}
    frames = b"".join(encode_frame(Call(i, "echo", {"text": "hi"})) for i in range(calls))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        for batch in (frames, frames):  # the same run twice, the first to warm up (copy-on-write, fresh pages)
            chan = worker.Channel.__new__(worker.Channel)  # no socket: only what serve uses of one
            chan.sock, chan.buf, chan.pending = _MemorySocket(), bytearray(batch), []  # type: ignore[assignment]
            cpu, start = time.process_time(), time.perf_counter()
            worker.serve(chan, tools, guard_cpu_s)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - start
        os.write(write_end, f"{cpu / calls * 1e6} {calls / wall}".encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        cpu_us, rate = (float(v) for v in answer.read().split())
    os.waitpid(pid, 0)
    return cpu_us, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40_000)
    parser.add_argument("--batch", default="1,8", help="calls per write, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", help="measure the sandbox of another checkout (default: this one)")
    parser.add_argument("--memory", action="store_true", help="the calls in memory: no socket (--batch is ignored)")
    args = parser.parse_args()
    print(f"tree {TREE}; python {sys.version.split()[0]}, {len(os.sched_getaffinity(0))} cores, {args.calls} calls "
          f"per run, median of {args.repeat}")
    print("| calls per write | guard | worker CPU µs/call | calls/s |")
    print("|---:|---|---:|---:|")
    if args.memory:
        for guard in (0, 60):
            runs = [run_in_memory(args.calls, guard) for _ in range(args.repeat)]
            cpu = statistics.median(r[0] for r in runs)
            rate = statistics.median(r[1] for r in runs)
            print(f"| all (in memory) | {'on' if guard else 'off'} | {cpu:.2f} | {rate:,.0f} |")
        return 0
    for batch in (int(b) for b in args.batch.split(",")):
        for guard in (0, 60):
            runs = [run_once(args.calls, batch, guard) for _ in range(args.repeat)]
            cpu = statistics.median(r[0] for r in runs)
            rate = statistics.median(r[1] for r in runs)
            print(f"| {batch} | {'on' if guard else 'off'} | {cpu:.1f} | {rate:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
