"""A lock shipped in a plugin folder is not covered by the user's approval: a ``requirements.lock``
may hold only pinned, hashed requirements (an option line would override uv's command line and
build a source distribution outside the sandbox), a ``package-lock.json`` only registry tarballs
with their integrity, and a hosted package's lock must pin the approved package. No network here."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from conftest import REPO, write_config

from runtime import installer
from runtime.installer import InstallError, check_npm_lock, check_requirements_lock
from runtime.server_spec import parse_package

H1 = "59bb03251907983d1603d27c3087ddb1e93299ea2163adcdba37899a4fb12ffb"
H2 = "c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026"

#: What ``uv pip compile --generate-hashes`` writes (``--universal`` adds markers).
UV_LOCK = f"""\
anyio==4.16.0 \\
    --hash=sha256:{H1} \\
    --hash=sha256:{H2}
    # via httpx
certifi==2026.10.19.post1 \\
    --hash=sha256:{H1}
    # via
    #   httpcore
    #   httpx

typing-extensions==4.16.0 ; python_full_version < '3.15' \\
    --hash=sha256:{H2}
    # via anyio
colorama==0.4.6 ; (python_full_version < '3.11' and sys_platform == "win32") or platform_system == 'Windows' \\
    --hash=sha256:{H1}
Mcp_Server.Time==2026.10.19 --hash=sha256:{H2.upper()}
"""


def test_a_lock_as_uv_writes_it_is_accepted_and_rewritten_from_its_parts() -> None:
    pins = check_requirements_lock(UV_LOCK)
    assert [(p.name, p.version) for p in pins] == [
        ("anyio", "4.16.0"), ("certifi", "2026.10.19.post1"), ("typing-extensions", "4.16.0"),
        ("colorama", "0.4.6"), ("Mcp_Server.Time", "2026.10.19")]
    assert pins[0].hashes == (H1, H2) and pins[4].hashes == (H2,)
    assert pins[2].marker == "python_full_version < '3.15'"
    assert pins[3].marker == ("(python_full_version < '3.11' and sys_platform == \"win32\") or "
                              "platform_system == 'Windows'")
    assert check_requirements_lock(UV_LOCK.replace("\n", "\r\n")) == pins
    text = installer._checked_requirements_lock(UV_LOCK)
    assert text.splitlines()[2] == f"typing-extensions==4.16.0 ; python_full_version < '3.15' --hash=sha256:{H2}"
    assert check_requirements_lock(text) == pins  # what uv is given reads back the same
    assert installer._checked_requirements_lock("") == ""


HASH = f" --hash=sha256:{H1}"


@pytest.mark.parametrize("line", [
    # every option uv reads in a requirements file, with or without a value
    "-r other.txt", "--requirement other.txt", "-c constraints.txt", "--constraint=c.txt", "-e .",
    "--editable ./pkg", "--index-url https://evil.example/simple", "-i https://evil.example/simple",
    "--extra-index-url https://evil.example/simple", "--find-links /tmp/links", "-f /tmp/links",
    "--find-links=/tmp/links", "--no-binary evilpkg", "--no-binary=:all:", "--only-binary :none:", "--no-index",
    "--trusted-host evil.example", "--pre", "--prefer-binary", "--require-hashes", "--no-build",
    "--index https://evil.example", "--default-index https://evil.example", f"--hash=sha256:{H1}",
    # options after a requirement, on its line or on a continuation line
    f"six==1.17.0{HASH} --no-binary six", f"six==1.17.0{HASH} \\\n    --index-url https://evil.example/simple",
    f"six==1.17.0 \\\n    --no-binary six \\\n   {HASH}", f"six==1.17.0{HASH} -f /tmp/links",
    f"six==1.17.0{HASH} --hash=md5:{'0' * 32}",
    # URLs, paths and direct references
    f"evil @ https://evil.example/evil-1.0.tar.gz{HASH}", f"evil@https://evil.example/evil.whl{HASH}",
    f"https://evil.example/evil-1.0-py3-none-any.whl{HASH}", f"./evil{HASH}", f"/tmp/evil-1.0.tar.gz{HASH}",
    f"file:///tmp/evil-1.0.tar.gz{HASH}", f"evil @ file:///tmp/evil{HASH}", f"git+https://evil.example/x.git{HASH}",
    f"~/evil{HASH}", f"evil/setup.py{HASH}",
    # not one exact version
    f"six{HASH}", f"six>=1.0{HASH}", f"six==1.*{HASH}", f"six===1.0{HASH}", f"six~=1.0{HASH}",
    f"six==1.0,!=1.1{HASH}", f"six[extra]==1.0{HASH}",
    # hashes missing or malformed
    "six==1.17.0", f"six==1.17.0 --hash=sha256:{H1[:-1]}", f"six==1.17.0 --hash=sha256:{H1}0",
    f"six==1.17.0 --hash sha256:{H1}", f"six==1.17.0 --hash=sha512:{H1}{H1}",
    # markers that are not plain environment markers
    f"six==1.17.0 ; __import__('os'){HASH}", f"six==1.17.0 ; python_version < '3' --no-index{HASH}",
    f"six==1.17.0 ; python_version{HASH}", f"six==1.17.0 ; python_version < '3 --no-index'{HASH}",
    f"six==1.17.0 ; python_version < '--no-index'{HASH}", f"six==1.17.0 ; (python_version < '3'{HASH}",
    f"six==1.17.0 ; {HASH}", f"six==1.17.0 ; 'a' == 'b'{HASH}",
    # what two parsers could read differently
    f"six==1.17.0{HASH}  # trailing comment", f"six==1.17.0#--no-index{HASH}", "# comment \\\n--no-index",
    f"six==1.17.0 \\\n# via x\n   {HASH}", f"six==1.17.0 \\\n\n   {HASH}", f"six==1.17.0{HASH} \\",
    f"six==1.17.0{HASH} \\ ", f"six==1.17.0\\{HASH}", f"six==1.17.0{HASH}\u2028--no-index",
    f"six==1.17.0{HASH}\x0c--no-index", f"six==1.17.0{HASH}\x0b", f"six==1.17.0{HASH}\x00", f"six==1.17.0{HASH}\rx",
    f"sïx==1.17.0{HASH}",
])
def test_anything_but_pinned_hashed_requirements_is_refused_naming_the_line(line: str) -> None:
    text = f"# a lock\nanyio==4.16.0{HASH}\n{line}\nidna==3.20{HASH}\n"
    with pytest.raises(InstallError) as info:
        check_requirements_lock(text)
    assert "requirements.lock line 3 is refused" in info.value.reason, info.value.reason


def test_a_refusal_says_which_option_and_an_empty_lock_is_refused() -> None:
    with pytest.raises(InstallError, match=r"line 1 is refused \(the option --no-binary is not allowed\): "
                                           r"'--no-binary toolcell-evil-sdist'"):
        check_requirements_lock("--no-binary toolcell-evil-sdist\n")
    with pytest.raises(InstallError, match=r"line 1 is refused \(the option --find-links is not allowed\)"):
        check_requirements_lock(f"six==1.17.0 \\\n  --find-links=/tmp{HASH}\n")
    with pytest.raises(InstallError, match="holds no requirement"):
        check_requirements_lock("# nothing\n\n")


def test_a_hosted_packages_lock_must_pin_the_approved_package() -> None:
    pkg = parse_package("pypi:Mcp_Server_Time==2026.10.19.0")
    assert "mcp-server-time" not in installer._checked_requirements_lock(f"mcp_server.time==2026.10.19{HASH}\n", pkg)
    for other in (f"mcp-server-time==2026.10.18{HASH}", f"mcp-server-timer==2026.10.19{HASH}",
                  f"six==1.17.0{HASH}", f"mcp-server-time==2026.10.19 ; os_name == 'nt'{HASH}"):
        with pytest.raises(InstallError, match="does not pin mcp-server-time==2026.10.19.0, the approved package"):
            installer._checked_requirements_lock(other + "\n", pkg)


# --- npm ---------------------------------------------------------------------------------------

SRI = "sha512-" + "A" * 86 + "=="
NPMJS = "https://registry.npmjs.org/"


def npm_lock(**entries: dict[str, object]) -> dict[str, object]:
    packages: dict[str, object] = {
        "": {"name": "toolcell-hosted", "dependencies": {"@scope/server": "1.2.3"}},
        "node_modules/@scope/server": {"version": "1.2.3", "resolved": f"{NPMJS}@scope/server/-/server-1.2.3.tgz",
                                       "integrity": SRI},
        "node_modules/ansi-regex": {"version": "6.0.1", "resolved": f"{NPMJS}ansi-regex/-/ansi-regex-6.0.1.tgz",
                                    "integrity": SRI, "dev": True},
        "node_modules/no-resolved": {"version": "2.0.0", "integrity": "sha1-" + "B" * 27 + "="},
        "node_modules/string-width-cjs": {"name": "string-width", "version": "4.2.3",
                                          "resolved": f"{NPMJS}string-width/-/string-width-4.2.3.tgz", "integrity": SRI},
        "node_modules/@scope/server/node_modules/bundled": {"version": "1.0.0", "inBundle": True},
    }
    packages.update(entries)
    return {"name": "toolcell-hosted", "lockfileVersion": 3, "requires": True, "packages": packages}


PKG = parse_package("npm:@scope/server@1.2.3")


def test_an_npm_lock_of_registry_tarballs_with_integrity_is_accepted() -> None:
    check_npm_lock(json.dumps(npm_lock()), PKG)
    mirror = npm_lock(**{"node_modules/ansi-regex": {"version": "6.0.1", "integrity": SRI,
                                                     "resolved": "https://npm.corp.example/r/ansi-regex/-/ansi-regex-6.0.1.tgz"}})
    check_npm_lock(json.dumps(mirror), PKG, (NPMJS, "https://npm.corp.example/r"))
    v2 = {**npm_lock(), "lockfileVersion": 2, "dependencies": {
        "@scope/server": {"version": "1.2.3", "resolved": f"{NPMJS}@scope/server/-/server-1.2.3.tgz",
                          "integrity": SRI, "dependencies": {"bundled": {"version": "1.0.0", "bundled": True}}},
        "string-width-cjs": {"version": "npm:string-width@4.2.3", "integrity": SRI,
                             "resolved": f"{NPMJS}string-width/-/string-width-4.2.3.tgz"}}}
    check_npm_lock(json.dumps(v2), PKG)


EVIL = {"version": "6.0.1", "integrity": SRI}


@pytest.mark.parametrize("entries, why", [
    ({"node_modules/ansi-regex": {**EVIL, "resolved": "http://registry.npmjs.org/ansi-regex/-/ansi-regex-6.0.1.tgz"}},
     "not an https tarball of the registry"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": "https://evil.example/ansi-regex/-/ansi-regex-6.0.1.tgz"}},
     "not an https tarball of the registry"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": "https://registry.npmjs.org.evil.example/ansi-regex/-/"
                                                      "ansi-regex-6.0.1.tgz"}}, "not an https tarball of the registry"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": "https://registry.npmjs.org@evil.example/ansi-regex/-/"
                                                      "ansi-regex-6.0.1.tgz"}}, "not an https tarball of the registry"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": "git+ssh://git@github.com/evil/evil.git#abc"}},
     "not an https tarball of the registry"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": "file:../evil"}}, "not an https tarball of the registry"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": f"{NPMJS}evil/-/evil-6.0.1.tgz"}},
     "not the tarball of ansi-regex@6.0.1"),
    ({"node_modules/ansi-regex": {**EVIL, "resolved": f"{NPMJS}ansi-regex/-/ansi-regex-6.0.1.tgz?x=../../evil"}},
     "not the tarball of ansi-regex@6.0.1"),
    ({"node_modules/ansi-regex": {"version": "6.0.1", "resolved": f"{NPMJS}ansi-regex/-/ansi-regex-6.0.1.tgz"}},
     "no valid integrity"),
    ({"node_modules/ansi-regex": {"version": "6.0.1", "integrity": "md5-abc"}}, "no valid integrity"),
    ({"node_modules/ansi-regex": {"version": "https://evil.example/x.tgz", "integrity": SRI}}, "is not a registry"),
    ({"node_modules/ansi-regex": {"version": "6.0.1", "integrity": SRI, "inBundle": True,
                                  "resolved": "https://evil.example/x.tgz"}}, "not an https tarball"),
    ({"node_modules/ansi-regex": {"link": True, "resolved": "../../../tmp/evil"}}, "a link to a folder"),
    ({"packages/evil": {"version": "1.0.0", "integrity": SRI}}, "a folder, not a registry package"),
    ({"node_modules/@scope/server": {"version": "1.2.4", "integrity": SRI,
                                     "resolved": f"{NPMJS}@scope/server/-/server-1.2.4.tgz"}}, "the approved package"),
    ({"node_modules/@scope/server": {"name": "evil", "version": "1.2.3", "integrity": SRI,
                                     "resolved": f"{NPMJS}evil/-/evil-1.2.3.tgz"}}, "the approved package"),
    ({"node_modules/@scope/server": {"version": "1.2.3", "integrity": SRI,
                                     "resolved": f"{NPMJS}evil/-/evil-1.2.3.tgz"}}, "not the tarball of @scope/server"),
])
def test_an_npm_lock_that_fetches_anything_else_is_refused(entries: dict[str, dict[str, object]], why: str) -> None:
    with pytest.raises(InstallError) as info:
        check_npm_lock(json.dumps(npm_lock(**entries)), PKG)
    assert why in info.value.reason and "package-lock.json entry" in info.value.reason, info.value.reason


def test_an_npm_lock_without_the_approved_package_or_of_an_old_format_is_refused() -> None:
    lock = npm_lock()
    del lock["packages"]["node_modules/@scope/server"]  # type: ignore[attr-defined]
    with pytest.raises(InstallError, match="does not hold npm:@scope/server@1.2.3"):
        check_npm_lock(json.dumps(lock), PKG)
    with pytest.raises(InstallError, match="lockfileVersion 2 or 3"):
        check_npm_lock(json.dumps({"lockfileVersion": 1, "dependencies": {}}), PKG)
    with pytest.raises(InstallError, match="not JSON"):
        check_npm_lock("{", PKG)
    with pytest.raises(InstallError, match="'string-width-cjs' is refused: resolved"):
        check_npm_lock(json.dumps({**npm_lock(), "lockfileVersion": 2, "dependencies": {"string-width-cjs": {
            "version": "npm:string-width@4.2.3", "integrity": SRI, "resolved": "https://evil.example/x.tgz"}}}), PKG)


# --- refused before any installer runs ---------------------------------------------------------

def _evil_sdist(folder: Path, canary: Path) -> str:
    """A source distribution with an in-tree build backend (builds offline) whose build writes
    ``canary``; returns its sha256."""
    base = "toolcell_evil_sdist-1.0"
    files = {"PKG-INFO": "Metadata-Version: 2.1\nName: toolcell-evil-sdist\nVersion: 1.0\n",
             "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "evil_backend"\nbackend-path = ["."]\n',
             "evil_backend.py": f"open({str(canary)!r}, 'w').write('built outside the sandbox')\n"
                                "raise SystemExit('the attack ran')\n"}
    path = folder / f"{base}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            raw = data.encode()
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _attack_lock(tmp_path: Path) -> tuple[str, Path]:
    links = tmp_path / "links"
    links.mkdir()
    canary = tmp_path / "canary"
    digest = _evil_sdist(links, canary)
    return (f"--no-binary toolcell-evil-sdist\n--no-index\n--find-links {links}\n"
            f"toolcell-evil-sdist==1.0 --hash=sha256:{digest}\n"), canary


PLUGIN = '''
from sandbox import tool


@tool
def {name}() -> str:
    """A tool."""
    return "{name}"
'''


async def test_a_lock_with_options_refuses_its_plugin_builds_nothing_and_others_load(
        make_plugin: Callable[..., Path], state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))  # nothing built is reused from a shared cache
    lock, canary = _attack_lock(tmp_path)
    plugins = make_plugin("locked", PLUGIN.format(name="locked"), manifest={"dependencies": ["toolcell-evil-sdist"]})
    make_plugin("other", PLUGIN.format(name="other"))
    (plugins / "locked" / "requirements.lock").write_text(lock)
    config = write_config(tmp_path, state_dir)

    async def toolcell(*args: str) -> tuple[int, str]:
        done = await trio.run_process([sys.executable, "-m", "runtime.cli", *args], cwd=str(REPO), check=False,
                                      capture_stdout=True, capture_stderr=True, env=dict(os.environ))
        return done.returncode, done.stdout.decode()

    code, out = await toolcell("check", str(plugins / "locked"), "--config", str(config))
    assert code == 1 and "requirements.lock line 1 is refused" in out and "--no-binary" in out, out
    assert not canary.exists(), "a shipped lock built an sdist outside the sandbox"
    code, out = await toolcell("list", "--json", "--plugins", str(plugins), "--config", str(config))
    status = {p["name"]: p["status"] for p in json.loads(out)["plugins"]}
    assert status == {"locked": "refused", "other": "ok"}, out
    assert not canary.exists()


async def test_hosted_packages_with_a_bad_lock_are_refused_before_any_installer_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    lock, canary = _attack_lock(tmp_path)
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "requirements.lock").write_text(lock.replace("toolcell-evil-sdist==1.0",
                                                           "mcp-server-time==1.0 --hash=sha256:" + H1 + "\n"
                                                           "toolcell-evil-sdist==1.0"))
    ran: list[list[str]] = []
    real_run = installer._run

    async def spy(argv: list[str], cwd: str, what: str) -> str:
        ran.append(argv)
        return await real_run(argv, cwd, what)

    monkeypatch.setattr(installer, "_run", spy)
    with pytest.raises(InstallError, match="line 1 is refused"):
        await installer.install_package(parse_package("pypi:mcp-server-time==1.0"), str(tmp_path / "state"), str(plugin))
    assert not canary.exists() and ran == []
    (plugin / "package-lock.json").write_text(json.dumps(npm_lock(**{"node_modules/ansi-regex": {
        **EVIL, "resolved": "https://evil.example/ansi-regex/-/ansi-regex-6.0.1.tgz"}})))
    with pytest.raises(InstallError, match="'node_modules/ansi-regex' is refused"):
        await installer.install_package(PKG, str(tmp_path / "state"), str(plugin))
    assert all(argv[1:] == ["config", "get", "registry"] for argv in ran), ran  # npm install/ci never ran
