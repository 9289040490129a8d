"""``runtime.plugin_files``: every file read out of a plugin folder is hostile. Each kind of hostile
file an author can place is refused with a reason naming what it is, without blocking, without
following a link, and without quoting anything it points at. (The daemon-level attack suite, over
every file the daemon reads, is ``tests/reload/test_hostile_plugin_files.py``.)"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from runtime import plugin_files
from runtime.fingerprints import fingerprint
from runtime.plugin_files import PluginFileError, excerpt, read_bytes, read_text

SECRET = "TOPSECRET-plugin-files-7f3a"


def _fifo(folder: Path, name: str, outside: Path) -> None:
    os.mkfifo(folder / name)


def _link_out(folder: Path, name: str, outside: Path) -> None:
    (folder / name).symlink_to(outside)


def _link_in(folder: Path, name: str, outside: Path) -> None:
    (folder / "real.txt").write_text("fine\n")
    (folder / name).symlink_to("real.txt")


def _device_link(folder: Path, name: str, outside: Path) -> None:
    (folder / name).symlink_to("/dev/zero")


def _directory(folder: Path, name: str, outside: Path) -> None:
    (folder / name).mkdir()


def _parent_link(folder: Path, name: str, outside: Path) -> None:
    """``sub`` is a link to the folder holding the secret: ``sub/<name>`` would read through it."""
    (folder / "sub").symlink_to(outside.parent)


HOSTILE: dict[str, tuple[Callable[[Path, str, Path], None], str]] = {
    "fifo": (_fifo, "a FIFO"),
    "symlink outside": (_link_out, "symbolic link"),
    "symlink inside": (_link_in, "symbolic link"),
    "device link": (_device_link, "symbolic link"),
    "directory": (_directory, "a directory"),
}


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET + "\n")
    return path


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_file_is_refused_naming_what_it_is_never_what_it_points_at(
        tmp_path: Path, secret: Path, kind: str) -> None:
    make, says = HOSTILE[kind]
    folder = tmp_path / "plugin"
    folder.mkdir()
    make(folder, "requirements.lock", secret)
    with pytest.raises(PluginFileError) as exc:
        read_text(str(folder), "requirements.lock")
    assert says in exc.value.reason and "requirements.lock" in exc.value.reason
    assert SECRET not in exc.value.reason


def test_a_device_node_is_refused_without_being_opened(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    folder = tmp_path / "plugin"
    folder.mkdir()
    os.mknod(folder / "plugin.toml", 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero
    with pytest.raises(PluginFileError, match="a device"):
        read_bytes(str(folder), "plugin.toml")


def test_a_link_in_a_parent_folder_is_not_followed_either(tmp_path: Path, secret: Path) -> None:
    folder = tmp_path / "plugin"
    folder.mkdir()
    _parent_link(folder, "secret.txt", secret)
    with pytest.raises(PluginFileError, match="symbolic link") as exc:
        read_text(str(folder), "sub/secret.txt")
    assert SECRET not in exc.value.reason


@pytest.mark.parametrize("name", ["../elsewhere/secret.txt", "/etc/passwd", "a/../../x", ""])
def test_a_name_that_leaves_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "plugin").mkdir()
    with pytest.raises(PluginFileError, match="not a name inside the plugin folder"):
        read_bytes(str(tmp_path / "plugin"), name)


def test_a_file_over_its_cap_is_refused_unread_and_a_missing_one_is_none(tmp_path: Path) -> None:
    folder = tmp_path / "plugin"
    folder.mkdir()
    with open(folder / "huge.lock", "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: nothing is written, and nothing may be read
    with pytest.raises(PluginFileError, match="larger than 1024 bytes"):
        read_bytes(str(folder), "huge.lock", 1024)
    assert read_bytes(str(folder), "absent.lock") is None
    assert read_text(str(folder), "sub/absent.lock") is None


def test_empty_and_invalid_utf8_text_are_refused_with_their_reason(tmp_path: Path) -> None:
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "empty.lock").write_bytes(b"")
    (folder / "latin1.lock").write_bytes(b"caf\xe9\n")
    with pytest.raises(PluginFileError, match="empty.lock is empty"):
        read_text(str(folder), "empty.lock", empty_ok=False)
    assert read_text(str(folder), "empty.lock") == ""
    with pytest.raises(PluginFileError, match="not UTF-8 text"):
        read_text(str(folder), "latin1.lock")
    (folder / "ok.lock").write_text("x==1\n")
    assert read_text(str(folder), "./ok.lock") == "x==1\n"


def test_an_excerpt_is_short_and_escaped() -> None:
    assert excerpt("a\x1b[2Jb") == repr("a\x1b[2Jb")
    long = excerpt("x" * 10_000)
    assert len(long) < 70 and long.endswith("…")


async def test_a_read_past_its_deadline_refuses_instead_of_waiting(autojump_clock: trio.abc.Clock) -> None:
    """A folder on a stuck mount: the read is abandoned, the caller told why, the loop never waits."""
    release = threading.Event()
    with pytest.raises(PluginFileError, match="took longer than"):
        await plugin_files.off_loop(release.wait, 30, what="reading a stuck folder")
    release.set()
    await trio.sleep(0)


def test_a_fingerprint_never_opens_a_fifo_or_follows_a_link(tmp_path: Path, secret: Path) -> None:
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "plugin.toml").write_text('name = "p"\n')
    os.mkfifo(folder / "data.fifo")
    (folder / "secret.lock").symlink_to(secret)
    first = fingerprint(folder)  # returns (a FIFO opened for reading would block here)
    secret.write_text("changed\n")
    assert fingerprint(folder) == first  # what a link points at is not part of the folder


# -- copy_folder (``toolcell add FOLDER``; the CLI's attack cases are in tests/hosted/test_import_and_approve.py) --


def test_a_copy_refuses_a_huge_sparse_file_before_copying_a_byte(tmp_path: Path) -> None:
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "plugin.toml").write_text('name = "p"\n')
    with open(folder / "huge.bin", "wb") as f:
        f.truncate(1 << 40)  # a terabyte that takes no disk: its apparent size is what counts
    with pytest.raises(PluginFileError, match=r"larger than .* bytes \(at huge.bin\)"):
        plugin_files.copy_folder(str(folder), str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()


def test_a_copy_refuses_too_many_entries_and_too_deep_a_nesting(tmp_path: Path) -> None:
    folder = tmp_path / "plugin"
    folder.mkdir()
    for i in range(5):
        (folder / f"f{i}").write_text("x")
    with pytest.raises(PluginFileError, match="more than 4 files and folders"):
        plugin_files.copy_folder(str(folder), str(tmp_path / "copy"), max_entries=4)
    deep = tmp_path / "deep"
    (deep / "/".join(["d"] * (plugin_files.MAX_COPY_DEPTH + 1))).mkdir(parents=True)
    with pytest.raises(PluginFileError, match="nested more than"):
        plugin_files.copy_folder(str(deep), str(tmp_path / "copy2"))


def test_a_file_that_reads_longer_than_its_size_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that grows between the check and the copy (or a /proc-like file whose size says 0)."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "grows.txt").write_text("abc")
    real_plan = plugin_files._plan

    def plan_then_grow(*args: object) -> list[object]:
        planned = real_plan(*args)  # type: ignore[arg-type]
        (folder / "grows.txt").write_text("abcdef")
        return planned  # type: ignore[return-value]

    monkeypatch.setattr(plugin_files, "_plan", plan_then_grow)
    with pytest.raises(PluginFileError, match="grows.txt grew while being copied"):
        plugin_files.copy_folder(str(folder), str(tmp_path / "copy"))


def test_an_entry_module_that_is_a_link_is_refused_not_probed_through(tmp_path: Path, secret: Path) -> None:
    """The entry check used ``is_file()``, which follows a link: a plugin could learn through the
    daemon's refusal (or its absence) whether a file outside its folder exists."""
    from runtime.manifest import ManifestError, load_manifest

    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "plugin.toml").write_text('name = "p"\nversion = "1"\nentry = "tool"\n')
    (folder / "tool.py").symlink_to(secret)
    with pytest.raises(ManifestError, match="tool.py is a symbolic link"):
        load_manifest(folder)
    (folder / "tool.py").unlink()
    (folder / "tool").mkdir()
    assert load_manifest(folder).entry == "tool"
