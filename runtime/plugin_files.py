"""Reading files out of a plugin folder, which is hostile: the one way the daemon and the CLI do it.

A plugin folder is written by whoever wrote the plugin (a cloned repository, an archive, a person
who can write to the plugins folder but not read ``/etc/shadow``). Any name the daemon reads there
(``plugin.toml``, ``requirements.lock``, ``package-lock.json``, a server's script, every file a
fingerprint hashes) may be a FIFO that blocks whoever opens it, a link to a file its author cannot
read but the daemon (root) can, a device, a folder, or gigabytes. So every such read goes through
``read_bytes`` / ``read_text`` here, and they hold these rules:

* the name is resolved *beneath* the folder one component at a time (``openat`` style, each
  component opened with ``O_NOFOLLOW``): no ``..``, no absolute path, no symbolic link anywhere
  below the folder -- not even one pointing inside it (links are refused, not judged);
* each component is ``lstat``-ed before it is opened, so a FIFO or a device is never opened at
  all; the open itself is ``O_NONBLOCK`` (a FIFO swapped in between cannot block it) and ``fstat``
  of the open file must say the same regular file;
* a file is size-capped (``fstat`` first, then at most ``max_bytes + 1`` bytes are read);
* text must be UTF-8;
* the async forms run off the event loop (``trio.to_thread``) under a deadline
  (``READ_DEADLINE_S``), so a folder on a stuck network mount refuses its plugin, not the daemon.

``copy_folder`` (``toolcell add FOLDER``) holds the same rules for a whole folder: it copies regular
files and folders only, and refuses -- before a byte is copied -- a link, FIFO, device or socket
anywhere in it, a file with a hard link outside the folder (another name of a file its author may
not be able to read), and a folder larger than ``MAX_COPY_BYTES`` (apparent size: a sparse file
counts whole) or with more than ``MAX_COPY_ENTRIES`` entries.

A refusal is a ``PluginFileError`` whose ``reason`` names the file and says what it is, never what
it holds. Only a file that passed every check may be quoted, and then through ``excerpt`` (short,
escaped). The plugin folder itself is the operator's choice (the plugins folder, or a link to a
checkout in it) and is opened as named.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

#: A single file is refused larger than this unless the caller says otherwise.
MAX_FILE_BYTES = 8 * 1024 * 1024
#: Longest a read (or a folder walk, ``off_loop``) of a plugin folder may take.
READ_DEADLINE_S = 30.0
#: Longest excerpt of a file's content an error message may quote.
EXCERPT_CHARS = 60

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY

T = TypeVar("T")


class PluginFileError(Exception):
    """A file of a plugin folder that is refused; ``reason`` says which and why (never its content)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` as a short, escaped quotation (``repr`` of at most ``limit`` characters, then ``…``)."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + "…"


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words (``a FIFO``, ``a directory``)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link (links in a plugin folder are not followed)"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "of an unknown kind"


def _parts(relative: str) -> list[str]:
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if not parts or relative.startswith("/") or ".." in parts or "\0" in relative:
        raise PluginFileError(f"{relative!r} is not a name inside the plugin folder")
    return parts


def open_beneath(folder: str, relative: str) -> int | None:
    """An fd open for reading on the regular file ``relative`` beneath ``folder`` (None if it does
    not exist); raises ``PluginFileError`` for anything else (link, FIFO, device, folder, ``..``)."""
    parts = _parts(relative)
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PluginFileError(f"the plugin folder cannot be opened: {exc.strerror or exc}") from None
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            shown = "/".join(parts[: i + 1])
            try:
                before = os.stat(part, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            except NotADirectoryError:
                return None
            want_dir = not last
            if want_dir and not stat.S_ISDIR(before.st_mode):
                raise PluginFileError(f"{shown} is not a folder: it is {file_kind(before.st_mode)}")
            if last and not stat.S_ISREG(before.st_mode):
                raise PluginFileError(f"{shown} is not a regular file: it is {file_kind(before.st_mode)}")
            try:
                fd = os.open(part, _DIR_FLAGS if want_dir else _FILE_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
                    raise PluginFileError(f"{shown} was replaced while being opened") from None
                if exc.errno == errno.ENOENT:
                    return None
                raise PluginFileError(f"{shown} cannot be opened: {exc.strerror or exc}") from None
            after = os.fstat(fd)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or \
                    stat.S_IFMT(after.st_mode) != stat.S_IFMT(before.st_mode):
                os.close(fd)
                raise PluginFileError(f"{shown} was replaced while being opened")
            os.close(dir_fd)
            dir_fd = fd
        fd, dir_fd = dir_fd, -1
        return fd
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)


def read_bytes(folder: str, relative: str, max_bytes: int = MAX_FILE_BYTES) -> bytes | None:
    """The bytes of the regular file ``relative`` beneath ``folder`` (None if it does not exist).
    Raises ``PluginFileError`` for a file that is not a plain regular file or is over ``max_bytes``."""
    fd = open_beneath(folder, relative)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise PluginFileError(f"{relative} is larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        got = 0
        while got <= max_bytes:
            try:
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            except OSError as exc:
                raise PluginFileError(f"{relative} cannot be read: {exc.strerror or exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:  # it grew while being read
            raise PluginFileError(f"{relative} is larger than {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(folder: str, relative: str, max_bytes: int = MAX_FILE_BYTES, *, empty_ok: bool = True) -> str | None:
    """``read_bytes`` decoded as UTF-8 (refused otherwise, and when empty unless ``empty_ok``)."""
    data = read_bytes(folder, relative, max_bytes)
    if data is None:
        return None
    if not data and not empty_ok:
        raise PluginFileError(f"{relative} is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PluginFileError(f"{relative} is not UTF-8 text (byte {exc.start})") from None


def read_named(path: str, max_bytes: int) -> bytes | None:
    """The bytes of a file a person named (``--config``, a file a config names, a client's config):
    followed to where it leads (``realpath``, which opens nothing), then read as a plugin's files are --
    a regular file only (a FIFO would block its reader, a device never end), capped at ``max_bytes``.
    None if it does not exist; ``PluginFileError`` naming ``path`` (and where it leads) otherwise."""
    real = os.path.realpath(path)
    leads = f" ({path} leads to {real})" if real != os.path.abspath(path) else ""
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PluginFileError(f"{path} cannot be read: {exc.strerror or exc}{leads}") from None
    if not stat.S_ISREG(st.st_mode):
        raise PluginFileError(f"{path} is not a regular file: it is {file_kind(st.st_mode)}{leads}")
    if st.st_size > max_bytes:
        raise PluginFileError(f"{path} is larger than {max_bytes} bytes{leads}")
    try:
        return read_bytes(os.path.dirname(real), os.path.basename(real), max_bytes)
    except PluginFileError as exc:  # replaced or grown since the stat above
        raise PluginFileError(f"{path}: {exc.reason}{leads}") from None


def read_named_text(path: str, max_bytes: int) -> str | None:
    """``read_named`` decoded as UTF-8 (refused otherwise): a client's config, a JSON file a person named."""
    data = read_named(path, max_bytes)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PluginFileError(f"{path} is not UTF-8 text (byte {exc.start})") from None


async def off_loop(fn: Callable[..., T], *args: object, what: str = "reading the plugin folder") -> T:
    """``fn(*args)`` (file-system work on a plugin folder) in a thread, under ``READ_DEADLINE_S``;
    past the deadline the thread is abandoned and ``PluginFileError`` raised."""
    with trio.move_on_after(READ_DEADLINE_S):
        return await trio.to_thread.run_sync(lambda: fn(*args), abandon_on_cancel=True)
    raise PluginFileError(f"{what} took longer than {READ_DEADLINE_S:g} s")


async def read_text_async(folder: str, relative: str, max_bytes: int = MAX_FILE_BYTES, *,
                          empty_ok: bool = True) -> str | None:
    """``read_text`` off the event loop, under the deadline."""
    return await off_loop(lambda: read_text(folder, relative, max_bytes, empty_ok=empty_ok), what=f"reading {relative}")


# -- copying a whole folder (``toolcell add FOLDER``) -------------------------------------------------

#: A folder copied in (``copy_folder``) is refused larger than this (sum of apparent file sizes).
MAX_COPY_BYTES = 512 * 1024 * 1024
#: ... or with more files and folders than this, or nested deeper than ``MAX_COPY_DEPTH``.
MAX_COPY_ENTRIES = 50_000
MAX_COPY_DEPTH = 64
#: Not copied: version-control history and caches (a local ``git clone`` hard-links ``.git/objects``).
COPY_SKIPS = frozenset({".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".hypothesis", ".ruff_cache"})


@dataclass(frozen=True)
class _Planned:
    relative: str
    is_dir: bool
    dev: int
    ino: int
    size: int
    mode: int
    nlink: int


def _plan(folder: str, max_bytes: int, max_entries: int) -> list[_Planned]:
    """Every entry of ``folder`` (parents first), checked by ``lstat`` through folder fds only: no
    file is opened, no link followed. Raises ``PluginFileError`` naming the first entry refused."""
    planned: list[_Planned] = []
    names_seen: dict[tuple[int, int], int] = {}
    total = 0

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        nonlocal total
        if depth > MAX_COPY_DEPTH:
            raise PluginFileError(f"{prefix.rstrip('/')} is nested more than {MAX_COPY_DEPTH} folders deep")
        for name in sorted(os.listdir(dir_fd)):
            if name in COPY_SKIPS:
                continue
            shown = prefix + name
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise PluginFileError(f"{shown} disappeared while being copied") from None
            if len(planned) >= max_entries:
                raise PluginFileError(f"the folder holds more than {max_entries} files and folders")
            if stat.S_ISDIR(st.st_mode):
                planned.append(_Planned(shown, True, st.st_dev, st.st_ino, 0, st.st_mode, st.st_nlink))
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError as exc:
                    raise PluginFileError(f"{shown} cannot be opened: {exc.strerror or exc}") from None
                try:
                    opened = os.fstat(fd)
                    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                        raise PluginFileError(f"{shown} was replaced while being copied")
                    walk(fd, shown + "/", depth + 1)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > max_bytes:
                    raise PluginFileError(f"the folder is larger than {max_bytes} bytes (at {shown})")
                names_seen[(st.st_dev, st.st_ino)] = names_seen.get((st.st_dev, st.st_ino), 0) + 1
                planned.append(_Planned(shown, False, st.st_dev, st.st_ino, st.st_size, st.st_mode, st.st_nlink))
            else:
                raise PluginFileError(f"{shown} is {file_kind(st.st_mode)}: only regular files and folders are copied")

    try:
        root = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise PluginFileError(f"{folder} cannot be opened as a folder: {exc.strerror or exc}") from None
    try:
        walk(root, "", 1)
    finally:
        os.close(root)
    for entry in planned:
        if not entry.is_dir and entry.nlink > names_seen[(entry.dev, entry.ino)]:
            raise PluginFileError(f"{entry.relative} has a hard link outside the folder (it is also another "
                                  f"file, which may not be its author's to read)")
    return planned


def _copy_file(folder: str, entry: _Planned, dest: str) -> None:
    fd = open_beneath(folder, entry.relative)
    if fd is None:
        raise PluginFileError(f"{entry.relative} disappeared while being copied")
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (entry.dev, entry.ino):
            raise PluginFileError(f"{entry.relative} was replaced while being copied")
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            left = entry.size + 1  # a file that reads longer than its size (it grew, or is not what it says)
            while left > 0:
                try:
                    chunk = os.read(fd, min(1 << 20, left))
                except OSError as exc:
                    raise PluginFileError(f"{entry.relative} cannot be read: {exc.strerror or exc}") from None
                if not chunk:
                    break
                left -= len(chunk)
                if left == 0:
                    raise PluginFileError(f"{entry.relative} grew while being copied")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
            os.fchmod(out, stat.S_IMODE(entry.mode) & 0o777)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def copy_folder(folder: str, dest: str, *, max_bytes: int = MAX_COPY_BYTES,
                max_entries: int = MAX_COPY_ENTRIES) -> None:
    """Copy the plugin folder ``folder`` to ``dest`` (which must not exist): regular files and folders
    only, every file opened as ``open_beneath`` opens one, nothing read beyond the size first seen.
    Raises ``PluginFileError`` naming the path refused and what it is; ``dest`` may then hold a part
    (the caller copies into a private staging folder and removes it). Blocking: not for an event loop
    (``off_loop``)."""
    planned = _plan(folder, max_bytes, max_entries)
    os.mkdir(dest, 0o700)
    for entry in planned:
        target = os.path.join(dest, entry.relative)
        if entry.is_dir:
            os.mkdir(target, 0o700)
        else:
            _copy_file(folder, entry, target)
    for entry in reversed(planned):  # folders last (and children first), so a read-only one is filled
        if entry.is_dir:
            os.chmod(os.path.join(dest, entry.relative), stat.S_IMODE(entry.mode) & 0o777 | 0o700)
    os.chmod(dest, 0o755)
