"""The audit log: one JSON line per tool call (who, which tool, how big, how it ended, how long).

Arguments and results are never written, only their size; tokens never reach this module. The
log is fed by ``Daemon.call_hooks`` (every call that reached a worker pool, on any transport) and
by the HTTP transport for calls refused before that (rate limits), and for calls the protocol core
refused (``unknown``/out-of-scope tools and bad params: ``invalid_params``; arguments that fail the
tool's schema: ``invalid_arguments``). Every ``tools/call`` that reaches the daemon gets exactly one
line. ``outcome`` is ``ok``, ``busy``
or the worker failure kind (``timeout``, ``output_cap``, ``crashed`` — which covers memory and
CPU kills —, ``cancelled``, ``unavailable``, ...); ``limit`` names the limit hit, if any.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from typing import Any, TextIO

import msgspec

from runtime.logs import log

_encoder = msgspec.json.Encoder()
_LIMITS = {"timeout": "timeout_s", "output_cap": "max_output_bytes", "busy": "max_queue",
           "rate_limited": "rate"}


class AuditLogError(Exception):
    """The audit log cannot be opened as a log file (the sentence says why and what to give)."""


def open_log_file(target: str) -> TextIO:
    """``target`` opened for appending lines: a regular file (made, readable by its owner only, if
    it is not there) or a character device (``/dev/null``, a terminal). Never waits: a FIFO is
    refused, with or without a reader (a log pipe whose reader is slow or gone would stop the daemon
    at a write), as are a directory and a socket. Raises ``AuditLogError``."""
    where = f"http.audit_log {target}"
    folder = os.path.dirname(os.path.abspath(target))
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    # In a folder anyone may write (sticky and world-writable, like /tmp), another user can plant the
    # name before the daemon opens it: a link to a file the daemon may write (as root: any), or a file
    # of theirs that would receive the log. What the kernel's protected_symlinks / protected_regular
    # refuse, which a machine may have off: there, no link is followed, and the file must be ours or
    # the folder owner's.
    try:
        folder_st = os.stat(folder)
    except OSError:
        folder_st = None
    shared = folder_st is not None and bool(folder_st.st_mode & stat.S_ISVTX) and bool(folder_st.st_mode & stat.S_IWOTH)
    if shared:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(target, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise AuditLogError(f"{where}: a FIFO; give a regular file, or '-' for stderr") from None
        if exc.errno == errno.ENOENT:
            raise AuditLogError(f"{where}: its folder {os.path.dirname(target) or '.'} does not exist") from None
        if exc.errno == errno.ELOOP and shared:
            raise AuditLogError(f"{where}: a link in {folder}, a folder anyone may write; links are not "
                                "followed there (name the file itself, or log elsewhere)") from None
        raise AuditLogError(f"{where}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not _loggable(st.st_mode):
        os.close(fd)
        raise AuditLogError(problem_of_kind(where, st.st_mode))
    if shared and folder_st is not None and stat.S_ISREG(st.st_mode) and st.st_uid not in (os.geteuid(), folder_st.st_uid):
        os.close(fd)
        raise AuditLogError(f"{where}: belongs to uid {st.st_uid}, in {folder}, a folder anyone may write: "
                            "someone else may have made it to read the log; remove it, or log elsewhere")
    os.set_blocking(fd, True)
    return open(fd, "a", encoding="utf-8", buffering=1, closefd=True)  # noqa: SIM115 (kept for the daemon's life)


def _loggable(mode: int) -> bool:
    return stat.S_ISREG(mode) or stat.S_ISCHR(mode)


def existing_file_problem(target: str) -> str | None:
    """What is wrong with ``target`` as the audit log if something is there already (the config's
    check: a missing file is made at start, where a missing folder is said)."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return None
    return None if _loggable(mode) else problem_of_kind(f"http.audit_log {target}", mode)


def problem_of_kind(where: str, mode: int) -> str:
    """Why a file of this kind cannot be the audit log."""
    if stat.S_ISDIR(mode):
        return f"{where}: a directory; name the log file itself"
    if stat.S_ISFIFO(mode):
        return f"{where}: a FIFO (a log pipe whose reader is slow or gone would stop the daemon); give a " \
               "regular file, or '-' for stderr"
    return f"{where}: not a regular file or a character device; give a regular file, or '-' for stderr"


#: How often (at most, and only when a line is written) the log's name is looked at: a log rotated
#: by renaming it (logrotate's default) is followed to the new file at that name within this.
ROTATION_CHECK_S = 1.0


class AuditLog:
    """The log file, kept open; renamed or removed under the daemon (logrotate without
    ``copytruncate``), it is opened again at its name, with the same checks, so the lines go where
    the operator looks. Until then, and if it cannot be opened again, they go to the file still open:
    none is lost."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._own = target != "-"
        self._stream: TextIO = open_log_file(target) if self._own else sys.stderr
        self._identity = self._identity_of(self._stream)
        self._checked = time.monotonic()
        self._reopen_problem: str | None = None

    @staticmethod
    def _identity_of(stream: TextIO) -> tuple[int, int]:
        st = os.fstat(stream.fileno())
        return st.st_dev, st.st_ino

    def _follow_rotation(self) -> None:
        now = time.monotonic()
        if now - self._checked < ROTATION_CHECK_S:
            return
        self._checked = now
        try:
            st = os.stat(self._target)
            if (st.st_dev, st.st_ino) == self._identity:
                return
        except FileNotFoundError:
            pass  # removed (or renamed, nothing made in its place yet): made again
        except OSError:
            return
        try:
            stream = open_log_file(self._target)
        except AuditLogError as exc:
            if str(exc) != self._reopen_problem:  # said once per problem, not at every line
                self._reopen_problem = str(exc)
                log("audit_log_reopen_failed", level="error", error=str(exc),
                    note="the audit log was moved; its lines go on to the file still open")
            return
        self._reopen_problem = None
        old, self._stream, self._identity = self._stream, stream, self._identity_of(stream)
        try:
            old.close()
        except OSError:
            pass

    def hook(self, event: dict[str, Any]) -> None:
        """A ``Daemon.call_hooks`` entry."""
        self.write(event.get("principal"), event.get("requested") or event["tool"], event.get("plugin"),
                   event.get("argument_bytes"), event["outcome"], event.get("duration_s", 0.0))

    def write(self, principal: str | None, tool: str, plugin: str | None, argument_bytes: int | None,
              outcome: str, duration_s: float) -> None:
        record: dict[str, Any] = {
            "ts": round(time.time(), 3), "event": "tool_call", "principal": principal or "local", "tool": tool,
            "plugin": plugin, "argument_bytes": argument_bytes, "outcome": outcome,
            "duration_ms": round(duration_s * 1000, 3),
        }
        limit = _LIMITS.get(outcome)
        if limit is not None:
            record["limit"] = limit
        if self._own:
            self._follow_rotation()
        try:
            self._stream.write(_encoder.encode(record).decode() + "\n")
            if not self._own:
                self._stream.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self._own:
            self._stream.close()
