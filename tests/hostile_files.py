"""Plugin folders with one hostile file each, as an attacker who can write a plugin folder would
make them: every file the daemon reads from a plugin folder (the manifest, a requirements lock of a
plugin or of a PyPI server, an npm lock, a server's script) tried as a FIFO, a link out of the
folder (to a secret), a link inside it, a link to a device, a device node, a directory, a huge
file, an empty one and one that is not UTF-8.

``build(plugins, secret)`` writes them all and returns what each refusal must say. Used by the
daemon's attack suite (``tests/reload/test_hostile_plugin_files.py``) and the CLI tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SECRET = "TOPSECRET-daemon-must-not-quote-this"

#: What each target file is in its plugin: the manifest (plus other files) around it.
PY_DEPS = 'name = "{name}"\nversion = "1.0"\nentry = "{entry}"\ndependencies = ["attrs"]\n'
PYPI_SERVER = 'name = "{name}"\nversion = "1.0"\nkind = "server"\n\n[server]\npackage = "pypi:mcp-server-time==2026.10.19"\n'
NPM_SERVER = ('name = "{name}"\nversion = "1.0"\nkind = "server"\n\n[server]\n'
              'package = "npm:@modelcontextprotocol/server-everything@2026.1.26"\n')
SCRIPT_SERVER = 'name = "{name}"\nversion = "1.0"\nkind = "server"\n\n[server]\ncommand = ["./run.sh"]\n'
PLUGIN = 'name = "{name}"\nversion = "1.0"\nentry = "{entry}"\n'

#: (target name in its folder, the manifest of its plugin, the cap the target is refused over)
TARGETS: dict[str, tuple[str, str, int]] = {
    "manifest": ("plugin.toml", PLUGIN, 256 * 1024),
    "pylock": ("requirements.lock", PY_DEPS, 8 << 20),
    "pypilock": ("requirements.lock", PYPI_SERVER, 8 << 20),
    "npmlock": ("package-lock.json", NPM_SERVER, 8 << 20),
    "script": ("run.sh", SCRIPT_SERVER, 0),
}


def _fifo(path: Path, cap: int, secret: Path) -> None:
    os.mkfifo(path)


def _link_out(path: Path, cap: int, secret: Path) -> None:
    path.symlink_to(secret)


def _link_in(path: Path, cap: int, secret: Path) -> None:
    (path.parent / "inside.txt").write_text(path.parent.joinpath("inside.txt").name)
    path.symlink_to("inside.txt")


def _device_link(path: Path, cap: int, secret: Path) -> None:
    path.symlink_to("/dev/zero")


def _device(path: Path, cap: int, secret: Path) -> None:
    os.mknod(path, 0o644 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers, made in the folder


def _directory(path: Path, cap: int, secret: Path) -> None:
    path.mkdir()


def _huge(path: Path, cap: int, secret: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(cap * 4)  # sparse


def _empty(path: Path, cap: int, secret: Path) -> None:
    path.write_bytes(b"")


def _not_utf8(path: Path, cap: int, secret: Path) -> None:
    path.write_bytes(b"\xff\xfe\xfd not text\n")


@dataclass(frozen=True)
class Kind:
    make: Callable[[Path, int, Path], None]
    #: What the refusal says (None: refused, for a reason of its own).
    says: str | None
    #: Only for files whose content is parsed (not for a script, which is executed, not read).
    content: bool = False


KINDS: dict[str, Kind] = {
    "fifo": Kind(_fifo, "a FIFO"),
    "link-out": Kind(_link_out, "symbolic link"),
    "link-in": Kind(_link_in, "symbolic link"),
    "device-link": Kind(_device_link, "symbolic link"),
    "directory": Kind(_directory, "a directory"),
    "huge": Kind(_huge, "larger than", content=True),
    "empty": Kind(_empty, "is empty", content=True),
    "not-utf8": Kind(_not_utf8, "not UTF-8", content=True),
}
if os.geteuid() == 0:
    KINDS["device"] = Kind(_device, "a device")


def build(plugins: Path, secret: Path) -> dict[str, str | None]:
    """One plugin folder per (target, kind) under ``plugins``; returns plugin name -> what its refusal says."""
    secret.write_text(SECRET + "\n")
    expected: dict[str, str | None] = {}
    for target, (file_name, manifest, cap) in TARGETS.items():
        for kind_name, kind in KINDS.items():
            if kind.content and target == "script":
                continue
            name = f"{target}-{kind_name}"
            folder = plugins / name
            folder.mkdir(parents=True)
            (folder / "plugin.toml").write_text(manifest.format(name=name, entry=name.replace("-", "_")))
            (folder / f"{name.replace('-', '_')}.py").write_text("from sandbox import tool\n")
            if target == "manifest":
                (folder / "plugin.toml").unlink()
            kind.make(folder / file_name, cap, secret)
            says = kind.says
            if target == "manifest" and kind_name == "empty":
                says = "missing required key 'name'"
            expected[name] = says
    return expected
