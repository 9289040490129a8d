"""Where workers' cgroups go on a delegated cgroup v2 (``sandbox.isolation.cgroups``), and what the
probe says when /proc is masked, read from fake ``/proc/self/cgroup`` and mount tables (this
machine's controllers are on cgroup v1, so the v2 layout is checked on a fake hierarchy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.isolation import cgroups, probe


def _fake_v2(monkeypatch: pytest.MonkeyPatch, root: Path, own: str) -> None:
    delegated = root / "system.slice" / "toolcell.service"
    (delegated / "daemon").mkdir(parents=True)
    (delegated / "cgroup.controllers").write_text("cpu memory pids\n")
    (delegated / "daemon" / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(cgroups, "_own_paths", lambda pid="self": {"": own})
    monkeypatch.setattr(cgroups, "_mounts", lambda: [(str(root), "cgroup2", {"rw"})])


def test_a_daemon_in_the_daemon_leaf_puts_its_workers_beside_it_in_the_delegated_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel refuses to enable controllers in a cgroup that holds a process: the daemon's own
    # leaf cannot be the workers' parent (systemd's DelegateSubgroup=daemon, the image's entrypoint).
    _fake_v2(monkeypatch, tmp_path, "/system.slice/toolcell.service/daemon")
    lay = cgroups.layout(4242)
    assert lay == cgroups.Layout(2, (str(tmp_path / "system.slice/toolcell.service/toolcell/4242"),))


def test_a_daemon_elsewhere_keeps_its_workers_under_its_own_cgroup(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_v2(monkeypatch, tmp_path, "/system.slice/toolcell.service")
    lay = cgroups.layout(7)
    assert lay == cgroups.Layout(2, (str(tmp_path / "system.slice/toolcell.service/toolcell/7"),))


def test_mounts_over_proc_are_found(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "23 22 0:21 /sys /proc/sys ro,nosuid - proc proc rw\n"
        "24 22 0:5 /null /proc/kcore rw,nosuid - devtmpfs udev rw\n"
        "25 1 0:22 / /sys rw - sysfs sysfs rw\n")
    assert probe.proc_overmounts(str(mountinfo)) == ["/proc/kcore", "/proc/sys"]
    assert probe.proc_overmounts(str(tmp_path / "missing")) == []


def test_a_masked_proc_is_named_as_the_cause_with_the_engine_options_that_unmask_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "proc_overmounts", lambda mountinfo="": ["/proc/kcore", "/proc/sys"])
    cause, fix = probe._namespaces_fix("PermissionError: [Errno 1] mount(/proc): Operation not permitted")
    assert "/proc is partly masked (/proc/kcore, /proc/sys mounted over)" in cause
    assert "systempaths=unconfined" in fix and "procMount: Unmasked" in fix


def test_a_daemon_alone_in_a_delegated_cgroup_moves_into_the_daemon_leaf(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    _fake_v2(monkeypatch, tmp_path, "/system.slice/toolcell.service")
    delegated = tmp_path / "system.slice" / "toolcell.service"
    (delegated / "cgroup.procs").write_text(f"{os.getpid()}\n")
    assert cgroups.enter_daemon_leaf() == str(delegated / "daemon")
    assert (delegated / "daemon" / "cgroup.procs").read_text() == "0"  # "0": the writing process


def test_a_daemon_that_is_not_alone_in_its_cgroup_stays_where_it_is(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    _fake_v2(monkeypatch, tmp_path, "/user.slice/session-3.scope")
    scope = tmp_path / "user.slice" / "session-3.scope"
    scope.mkdir(parents=True)
    (scope / "cgroup.controllers").write_text("memory pids\n")
    (scope / "cgroup.procs").write_text(f"1234\n{os.getpid()}\n")  # a login shell beside us
    assert cgroups.enter_daemon_leaf() is None
    assert not (scope / "daemon").exists()


def test_a_daemon_already_in_the_leaf_or_without_v2_controllers_does_nothing(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_v2(monkeypatch, tmp_path, "/system.slice/toolcell.service/daemon")
    assert cgroups.enter_daemon_leaf() is None
    monkeypatch.setattr(cgroups, "_mounts", lambda: [(str(tmp_path), "cgroup", {"memory"})])
    monkeypatch.setattr(cgroups, "_own_paths", lambda pid="self": {"": "/system.slice/toolcell.service"})
    assert cgroups.enter_daemon_leaf() is None
