"""What a plugin folder holds, as digests: the cheap stat signature (no file read) and the content
fingerprint a reload compares. Pure functions of the file system, blocking: the daemon runs them
off its event loop (``plugin_files.off_loop``)."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from runtime import plugin_files

SKIP_DIRS = {"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".hypothesis"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")
MAX_FINGERPRINT_BYTES = 64 * 1024 * 1024


def _files(path: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(relative name, full path, lstat)`` of every file of a plugin folder, in a stable order;
    caches, editor droppings and hidden folders are skipped."""
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(SKIP_SUFFIXES) or name.startswith(".#"):
                continue
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            yield os.path.relpath(full, path), full, st


#: A file changed more recently than this is "racily clean" (git's term): a same-size rewrite within
#: the file system's timestamp granularity would leave its stat unchanged, so it is compared by content.
RACY_NS = 1_000_000_000


def stat_signature(path: Path) -> str | None:
    """A cheap digest of a plugin folder (names, inodes, sizes, mtimes, ctimes; no file is read),
    or None when a file changed too recently for its stat to be trusted (``RACY_NS``).

    Any write, rename or replacement changes a file's ctime, which user space cannot set back, so
    an unchanged signature means an unchanged folder and its content ``fingerprint`` is skipped."""
    h = hashlib.sha256()
    racy_after = time.time_ns() - RACY_NS
    for rel, _, st in _files(path):
        if st.st_ctime_ns >= racy_after or st.st_mtime_ns >= racy_after:
            return None
        h.update(f"{rel}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode())
    return h.hexdigest()


def _content_digest(folder: Path, rel: str, size: int) -> bytes:
    """sha256 of one file, opened the way every plugin file is (``runtime.plugin_files``: beneath the
    folder, no link followed, never a FIFO or device), reading at most ``size`` bytes."""
    try:
        fd = plugin_files.open_beneath(str(folder), rel)
    except plugin_files.PluginFileError:
        return b"refused"
    if fd is None:
        return b"gone"
    digest = hashlib.sha256()
    try:
        left = size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    except OSError:
        return b"unreadable"
    finally:
        os.close(fd)
    return digest.digest()


def fingerprint(path: Path) -> str:
    """A digest of a plugin folder's files (names, sizes and contents); caches are ignored."""
    h = hashlib.sha256()
    budget = MAX_FINGERPRINT_BYTES
    for rel, _full, st in _files(path):
        h.update(f"{rel}\0{st.st_size}\0".encode())
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            h.update(b"special")
            continue
        if st.st_size <= budget:
            budget -= st.st_size
            h.update(_content_digest(path, rel, st.st_size))
        else:
            h.update(str(st.st_mtime_ns).encode())
    return h.hexdigest()
