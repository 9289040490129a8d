"""What reaches an installer is checked first; client configs translate as documented; approvals compare
and refuse as documented. No processes here: these are the pure parts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime import approvals
from runtime.imports import ImportProblem, plugin_name, read_client_config, translate
from runtime.manifest import Manifest, check_manifest
from runtime.server_spec import check_requirements, parse_package


@pytest.mark.parametrize("spec, expected", [
    ("npm:@modelcontextprotocol/server-filesystem@2026.8.31", ("npm", "@modelcontextprotocol/server-filesystem",
                                                               "2026.8.31")),
    ("npm:left-pad@1.3.0", ("npm", "left-pad", "1.3.0")),
    ("pypi:mcp-server-time==2026.10.19", ("pypi", "mcp-server-time", "2026.10.19")),
    ("pypi:Mcp_Server_Fetch==1.0", ("pypi", "mcp-server-fetch", "1.0")),
])
def test_package_specs_parse(spec: str, expected: tuple[str, str, str]) -> None:
    pkg = parse_package(spec)
    assert (pkg.ecosystem, pkg.name, pkg.version) == expected


@pytest.mark.parametrize("spec", [
    "npm:--registry=http://evil@1.0.0",        # an option, not a name
    "npm:-y@1.0.0",
    "npm:@scope/pkg;rm -rf /@1.0.0",
    "npm:../../etc/passwd@1.0.0",
    "npm:pkg@^1.0.0",                          # a range, not a pinned version
    "npm:pkg@1.0.0 --foreground-scripts",
    "npm:git+https://example.com/x.git@1.0.0",
    "pypi:pkg @ https://example.com/x.whl",
    "pypi:--index-url==1",
    "pypi:pkg==1.0; os_name=='posix'",
    "pypi:pkg",                                 # not pinned
    "docker:mcp/fetch",
])
def test_package_specs_that_could_steer_an_installer_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_package(spec)


def test_requirements_are_names_and_versions_only() -> None:
    assert check_requirements(["six==1.17.0", "MarkupSafe>=3,<4", "httpx[http2]~=0.28", "attrs"]) == []
    bad = ["--index-url https://evil/simple", "-e .", "pkg @ https://evil/pkg.whl", "./local", "pkg; python_version<'3'",
           "-r other.txt", "pkg==1.0 --hash=sha256:00"]
    assert len(check_requirements(bad)) == len(bad)


def manifest(**fields: Any) -> Manifest:
    base: dict[str, Any] = {"name": "srv", "version": "1.0.0", "kind": "server",
                            "server": {"command": ["/usr/bin/node", "x.js"]}}
    base.update(fields)
    return msgspec.convert(base, Manifest)


def test_a_server_manifest_needs_exactly_one_of_command_and_package(tmp_path: Path) -> None:
    assert check_manifest(manifest(), tmp_path) == []
    both = manifest(server={"command": ["/bin/true"], "package": "npm:x@1.0.0"})
    assert any("exactly one" in p for p in check_manifest(both, tmp_path))
    neither = manifest(server={})
    assert any("exactly one" in p for p in check_manifest(neither, tmp_path))
    with_entry = manifest(entry="srv")
    assert any("no entry" in p for p in check_manifest(with_entry, tmp_path))
    assert any("between 1 and 64" in p for p in check_manifest(manifest(server={"command": ["/bin/true"],
                                                                                "instances": 0}), tmp_path))
    plugin_with_server = msgspec.convert({"name": "p", "version": "1", "entry": "p", "server": {}}, Manifest)
    assert any("kind" in p for p in check_manifest(plugin_with_server, tmp_path))


def test_client_config_entries_translate_to_pinnable_packages_and_commands() -> None:
    server, paths = translate({"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]})
    assert server == {"package": "npm:@modelcontextprotocol/server-filesystem", "args": ["/tmp"]} and paths == ["/tmp"]
    server, _ = translate({"command": "npx", "args": ["--yes", "some-server@1.2.3", "--flag"]})
    assert server == {"package": "npm:some-server@1.2.3", "args": ["--flag"]}
    server, _ = translate({"command": "uvx", "args": ["mcp-server-time", "--local-timezone=UTC"]})
    assert server == {"package": "pypi:mcp-server-time", "args": ["--local-timezone=UTC"]}
    server, _ = translate({"command": "uvx", "args": ["--from", "mcp-server-git==1.0", "mcp-server-git", "-r", "."]})
    assert server == {"package": "pypi:mcp-server-git==1.0", "bin": "mcp-server-git", "args": ["-r", "."]}
    server, _ = translate({"command": "/bin/true", "args": ["${workspaceFolder}/x"]})
    assert server == {"command": ["/bin/true"], "args": [os.getcwd() + "/x"]}
    for entry, fragment in (({"command": "docker", "args": ["run", "-i", "mcp/x"]}, "container"),
                            ({"type": "http", "url": "https://example.com/mcp"}, "remote"),
                            ({"command": "npx", "args": ["-y"]}, "no package"),
                            ({"command": "no-such-command-here"}, "not on PATH"),
                            ({"command": "npx", "args": ["-y", "Bad Name"]}, "npm package name")):
        with pytest.raises(ImportProblem, match=fragment):
            translate(entry)


def test_an_imported_command_is_found_on_paths_absolute_entries_never_in_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cloned repository holding its own ``./mytool``, imported with an empty (or ``.``) PATH entry: the
    config's ``mytool`` used to become the repository's program (``shutil.which`` searched the cwd)."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    for folder in (repo, bin_dir):
        folder.mkdir()
        (folder / "mytool").write_text("#!/bin/sh\n")
        (folder / "mytool").chmod(0o755)
    monkeypatch.chdir(repo)
    for path in (f":{bin_dir}", f".:{bin_dir}", f"{bin_dir}::"):
        monkeypatch.setenv("PATH", path)
        server, _ = translate({"command": "mytool"})
        assert server["command"] == [str(bin_dir / "mytool")], path
    monkeypatch.setenv("PATH", ":.")
    with pytest.raises(ImportProblem, match="not on PATH"):
        translate({"command": "mytool"})
    with pytest.raises(ImportProblem, match="relative"):
        translate({"command": "./mytool"})


def test_the_three_client_config_formats_are_read(tmp_path: Path) -> None:
    claude = tmp_path / "claude_desktop_config.json"
    claude.write_text(json.dumps({"mcpServers": {"a": {"command": "npx", "args": ["-y", "x"]}}}))
    vscode = tmp_path / "mcp.json"
    vscode.write_text(json.dumps({"inputs": [{"type": "promptString", "id": "key", "description": "API key"}],
                                  "servers": {"b": {"type": "stdio", "command": "uvx", "args": ["y"],
                                                    "env": {"KEY": "${input:key}"}}}}))
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"mcp": {"servers": {"c": {"command": "/bin/true"}}}}))
    assert list(read_client_config(str(claude))[0]) == ["a"]
    servers, inputs = read_client_config(str(vscode))
    assert list(servers) == ["b"] and inputs == {"key": "API key"}
    assert list(read_client_config(str(settings))[0]) == ["c"]
    (tmp_path / "broken.json").write_text("{nope")
    with pytest.raises(ImportProblem):
        read_client_config(str(tmp_path / "broken.json"))


def test_a_client_config_that_is_a_fifo_or_leads_to_one_is_refused_without_waiting(tmp_path: Path) -> None:
    """``toolcell import`` reads a file that may come with a cloned repository: a FIFO (or a link to one)
    is refused at once, naming where the link leads; a link to a real config is followed."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ImportProblem, match="not a regular file: it is a FIFO"):
        read_client_config(str(fifo))
    link = tmp_path / ".mcp.json"
    link.symlink_to(fifo)
    with pytest.raises(ImportProblem, match=r"\.mcp\.json leads to .*fifo\.json"):
        read_client_config(str(link))
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"mcpServers": {"a": {"command": "a"}}}))
    followed = tmp_path / "followed.json"
    followed.symlink_to(real)
    assert list(read_client_config(str(followed))[0]) == ["a"]
    (tmp_path / "latin1.json").write_bytes(b'{"mcpServers": {"\xe9": {}}}')
    with pytest.raises(ImportProblem, match="not UTF-8"):
        read_client_config(str(tmp_path / "latin1.json"))


@pytest.mark.parametrize("raw, expected", [("filesystem", "filesystem"), ("My Server!", "my-server"),
                                           ("../../etc", "etc"), ("@scope/pkg", "pkg")])
def test_plugin_names_from_configs_never_leave_the_folder(raw: str, expected: str) -> None:
    assert plugin_name(raw) == expected


def test_asking_for_more_than_approved_is_named_item_by_item() -> None:
    approved = approvals.grants(manifest(permissions={"read": ["/srv"], "write": ["/srv/out"],
                                                      "network": ["api.example.com:443"]},
                                         env={"allow": ["TOKEN"]}))
    same_or_less = approvals.grants(manifest(permissions={"read": ["/srv/sub"], "write": ["/srv/out/x"]},
                                             limits={"memory_mb": 256}))
    assert approvals.exceeds(same_or_less, approved) == []
    more = approvals.grants(manifest(permissions={"read": ["/etc"], "write": ["/srv"], "network": ["evil.com:443"]},
                                     env={"allow": ["TOKEN", "AWS_SECRET"]}, limits={"memory_mb": 4096},
                                     server={"command": ["/usr/bin/node", "other.js"]}))
    assert approvals.exceeds(more, approved) == [
        "+ read /etc", "+ write /srv", "+ network evil.com:443", "+ env AWS_SECRET", "limits.memory_mb: 512 -> 4096",
        "runs: ['/usr/bin/node', 'x.js'] -> ['/usr/bin/node', 'other.js']"]


def test_a_recorded_approval_holds_a_wider_manifest_and_an_untrusted_file_is_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state"
    folder = tmp_path / "srv"
    folder.mkdir()
    approvals.record(str(state), manifest(), str(folder), "test")
    assert (state / "approvals.json").stat().st_mode & 0o777 == 0o600
    assert approvals.check(manifest(), folder, str(state)) is None
    wider = manifest(permissions={"network": ["evil.com:443"]})
    held = approvals.check(wider, folder, str(state))
    assert held is not None and held.startswith(approvals.HELD) and "+ network evil.com:443" in held
    # Another folder with the same plugin name is not covered by this approval.
    assert approvals.check(wider, tmp_path / "elsewhere", str(state)) is None
    # A file others could have written is not trusted (and not written to).
    (state / "approvals.json").chmod(0o666)
    with pytest.raises(approvals.ApprovalsError):
        approvals.load(str(state))
    with pytest.raises(approvals.ApprovalsError):
        approvals.record(str(state), wider, str(folder), "test")


def test_an_installed_packages_metadata_is_read_without_following_a_link(tmp_path: Path) -> None:
    """``entry_points.txt`` / ``package.json`` come from the package (hostile content): one that is a
    link is refused, not read -- the console script named by a file outside used to be run."""
    from runtime import installer
    from runtime.installer import InstallError
    from runtime.server_spec import parse_package

    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("[console_scripts]\nstolen = x:y\n")
    venv = tmp_path / "venv"
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (site / "demo_pkg-1.0.dist-info").mkdir(parents=True)
    (site / "demo_pkg-1.0.dist-info" / "entry_points.txt").symlink_to(elsewhere)
    with pytest.raises(InstallError, match="symbolic link"):
        installer._pypi_script(str(venv), parse_package("pypi:demo-pkg==1.0"), "")
    (site / "demo_pkg-1.0.dist-info" / "entry_points.txt").unlink()
    (site / "demo_pkg-1.0.dist-info" / "entry_points.txt").write_text("[console_scripts]\ndemo-pkg = x:y\n")
    assert installer._pypi_script(str(venv), parse_package("pypi:demo-pkg==1.0"), "") == "demo-pkg"
    package = venv / "node_modules" / "demo"
    package.mkdir(parents=True)
    (tmp_path / "elsewhere.json").write_text(json.dumps({"bin": "../../../elsewhere.txt"}))
    (package / "package.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(InstallError, match="symbolic link"):
        installer._npm_bin(str(venv), parse_package("npm:demo@1.0.0"), "")
