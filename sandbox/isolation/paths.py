"""The worker's file allowlist, shared by the mount view (what stays visible) and Landlock (what is allowed).

Every path is resolved with ``realpath`` (trap 12: never a shim or a symlink the rules would not follow)
and dropped when it does not exist.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from sandbox.wire import Init

#: Where this package lives: ``<repo root>/sandbox``.
SANDBOX_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO_ROOT = os.path.dirname(SANDBOX_DIR)

SYSTEM_READ = ("/usr/lib", "/lib", "/lib64", "/usr/lib64", "/usr/share/zoneinfo", "/etc/localtime", "/etc/ld.so.cache")
DEVICES_READ = ("/dev/urandom", "/dev/random", "/dev/zero")
DEVICES_WRITE = ("/dev/null",)
PRIVATE_TMP = ("/tmp", "/dev/shm")


def _real(paths: list[str] | tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if not p:
            continue
        r = os.path.realpath(p)
        if os.path.exists(r) and r not in out:
            out.append(r)
    return out


def interpreter_dirs() -> list[str]:
    exe_prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    return _real([exe_prefix, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix])


def _is_site_dir(p: str) -> bool:
    return "site-packages" in p or "dist-packages" in p


@dataclass
class Allowlist:
    #: Readable and executable trees (directories or single files).
    read: list[str] = field(default_factory=list)
    #: Directories only listable (their files stay closed): ``sys.path`` roots such as the repo root.
    list_only: list[str] = field(default_factory=list)
    #: Readable and writable trees.
    write: list[str] = field(default_factory=list)
    #: Files under /dev that must stay readable and writable.
    devices_write: list[str] = field(default_factory=list)
    #: Device files only read.
    devices_read: list[str] = field(default_factory=list)

    def host_paths(self) -> list[str]:
        """Paths of the host file system the worker needs to see (not devices, not its private tmpfs)."""
        return [*self.read, *self.list_only, *self.write]


def allowlist(init: Init) -> Allowlist:
    read = interpreter_dirs()
    read += [SANDBOX_DIR]
    read += [p for p in sys.path if _is_site_dir(p)]
    # The daemon lists the repo root (an ancestor of sandbox/) in sys_path: only listable, not readable.
    read += [p for p in init.sys_path if not is_under(SANDBOX_DIR, os.path.realpath(p))]
    read += [init.plugin_dir]
    read += list(SYSTEM_READ)
    read += list(init.permissions.read)
    read += list(init.command_read)
    read = _real(read)
    write = _real(list(init.permissions.write))
    for granted in (*init.permissions.read, *init.permissions.write):
        link = through_writable_symlink(granted, write)
        if link is not None:
            raise ValueError(f"permissions path {granted!r} leads through the symlink {link!r}, in a folder this "
                             "plugin may write (it could have made it): name the real folder instead")
    read = [p for p in read if p not in write]
    covered = read + write
    list_only = [
        p for p in _real([REPO_ROOT, *sys.path, *init.sys_path])
        if os.path.isdir(p) and not any(p == c or p.startswith(c.rstrip("/") + "/") for c in covered)
    ]
    return Allowlist(
        read=read,
        list_only=list_only,
        write=write,
        devices_write=_real(list(DEVICES_WRITE)),
        devices_read=_real(list(DEVICES_READ)),
    )


def through_writable_symlink(path: str, writable: list[str]) -> str | None:
    """The first symlink on the way to ``path`` that sits in a folder under ``writable`` (resolved), or
    None. Grants are resolved when a worker starts: a symlink the plugin itself could have made (it
    may write where it sits) would send a grant anywhere it points, so such a grant is refused."""
    current = "/"
    for part in os.path.normpath(path).split("/"):
        if not part:
            continue
        step = os.path.join(current, part)
        if os.path.islink(step):
            if any(is_under(current, w) for w in writable):
                return step
            step = os.path.realpath(step)
        current = step
    return None


def is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def minimal(paths: list[str]) -> list[str]:
    """Drop every path that lies inside another one of the list."""
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(is_under(p, q) for q in out):
            out.append(p)
    return out
