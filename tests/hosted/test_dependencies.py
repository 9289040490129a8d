"""Plugins with dependencies: installed by toolcell (uv, wheels only) into an environment in the state dir
that only that plugin's workers can read; unsatisfiable ones are refused with uv's reason; a
source-only dependency is never built outside the sandbox."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import trio
from conftest import REPO, public, write_config

DEPS_PLUGIN = '''
import json

import markupsafe
import six
from markupsafe import _speedups

from sandbox import tool


@tool
def deps() -> str:
    """Use a pure-Python and a compiled dependency."""
    return json.dumps({"six": six.__version__, "compiled": _speedups.__file__,
                       "escaped": str(markupsafe.escape("<b>"))})
'''

SNOOP_PLUGIN = '''
import os

from sandbox import tool


@tool
def snoop(path: str) -> str:
    """Try to list another plugin's environment."""
    try:
        return "listed: " + ",".join(os.listdir(path))
    except OSError as exc:
        return f"refused: {type(exc).__name__}"
'''


async def toolcell(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = await trio.run_process([sys.executable, "-m", "runtime.cli", *args], cwd=str(REPO), capture_stdout=True,
                                  capture_stderr=True, check=False, env={**os.environ, **(env or {})})
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_a_plugin_with_a_pure_and_a_compiled_dependency_installs_loads_and_calls(
        make_plugin: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    plugins = make_plugin("withdeps", DEPS_PLUGIN, manifest={"dependencies": ["six==1.17.0", "MarkupSafe==3.0.2"]})
    make_plugin("snoop", SNOOP_PLUGIN)
    config = write_config(tmp_path, state_dir)
    code, out, err = await toolcell("call", "deps", "{}", "--plugins", str(plugins), "--config", str(config))
    assert code == 0, err
    got = json.loads(json.loads(out)["content"][0]["text"])
    assert got["six"] == "1.17.0" and got["escaped"] == "&lt;b&gt;"
    assert got["compiled"].endswith(".so") and got["compiled"].startswith(str(state_dir / "envs")), got
    env_dir = Path(got["compiled"]).parents[2]
    lock = (env_dir / "requirements.lock").read_text()
    assert "six==1.17.0" in lock and "markupsafe==3.0.2" in lock.lower() and "--hash=sha256:" in lock
    # Nothing else sees it: another plugin's worker cannot even list it.
    code, out, err = await toolcell("call", "snoop", json.dumps({"path": str(env_dir / "site")}), "--plugins",
                                    str(plugins), "--config", str(config))
    assert "refused: PermissionError" in out or "refused: FileNotFoundError" in out, out + err
    # Loading again (a restart, a hot reload) with the same requirements installs nothing.
    marker = env_dir / "toolcell-env.json"
    before = marker.stat().st_mtime_ns
    code, out, err = await toolcell("check", str(plugins / "withdeps"), "--config", str(config))
    assert code == 0, out + err
    assert marker.stat().st_mtime_ns == before


async def test_an_unsatisfiable_dependency_is_refused_with_the_installers_reason_and_others_serve(
        make_plugin: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    plugins = make_plugin("impossible", DEPS_PLUGIN, manifest={"dependencies": ["six==99.0.0"]})
    make_plugin("snoop", SNOOP_PLUGIN)
    config = write_config(tmp_path, state_dir)
    code, out, err = await toolcell("check", str(plugins / "impossible"), "--config", str(config))
    assert code == 1
    assert "dependencies:" in out and "six==99.0.0" in out and "unsatisfiable" in out, out
    code, out, err = await toolcell("list", "--json", "--plugins", str(plugins), "--config", str(config))
    listed = json.loads(out)
    status = {p["name"]: p["status"] for p in listed["plugins"]}
    assert status == {"impossible": "refused", "snoop": "ok"}
    assert [t["name"] for t in listed["tools"]] == ["snoop"]


def _sdist(folder: Path, name: str, files: dict[str, str]) -> None:
    base = f"{name.replace('-', '_')}-1.0"
    files = {**files, "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"}
    with tarfile.open(folder / f"{base}.tar.gz", "w:gz") as tar:
        for file_name, data in files.items():
            raw = data.encode()
            info = tarfile.TarInfo(f"{base}/{file_name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def _evil_sdist(folder: Path, canary: Path) -> None:
    """A source distribution whose build writes ``canary``: running it at all is the attack."""
    _sdist(folder, "toolcell-evil-sdist", {
        "setup.py": f"open({str(canary)!r}, 'w').write('built outside the sandbox')\nfrom setuptools import setup\n"
                    "setup(name='toolcell-evil-sdist', version='1.0', py_modules=[])\n"})


GOOD_PLUGIN = '''
import toolcell_good

from sandbox import tool


@tool
def answer() -> int:
    """The answer, from a package built from source inside the sandbox."""
    return toolcell_good.ANSWER
'''


async def test_a_source_only_dependency_is_refused_and_its_build_never_runs(
        make_plugin: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    canary = tmp_path / "canary"
    _evil_sdist(links, canary)
    plugins = make_plugin("sdistonly", DEPS_PLUGIN, manifest={"dependencies": ["toolcell-evil-sdist==1.0"]})
    config = write_config(tmp_path, state_dir)
    code, out, err = await toolcell("check", str(plugins / "sdistonly"), "--config", str(config),
                                    env={"UV_FIND_LINKS": str(links)})
    assert code == 1 and "dependencies:" in out, out + err
    assert "wheel" in out.lower() or "only-binary" in out.lower() or "binary" in out.lower(), out
    assert not canary.exists(), "the sdist's build ran outside the sandbox"
    # The canary of the canary: an installer allowed to build does run that code.
    from runtime.installer import uv_bin

    target = tmp_path / "target"
    await trio.run_process([uv_bin(), "pip", "install", "--quiet", "--no-index", "--find-links", str(links),
                            "--no-build-isolation", "--python", sys.executable, "--target", str(target),
                            "toolcell-evil-sdist==1.0"], check=False, capture_stdout=True, capture_stderr=True)
    assert canary.exists(), "the evil sdist cannot detect its own build"


async def test_with_source_builds_allowed_the_build_runs_inside_the_sandbox(
        make_plugin: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    canary = tmp_path / "canary"
    _evil_sdist(links, canary)
    _sdist(links, "toolcell-good-sdist", {
        "setup.py": "from setuptools import setup\nsetup(name='toolcell-good-sdist', version='1.0', "
                    "py_modules=['toolcell_good'])\n",
        "toolcell_good.py": "ANSWER = 42\n"})
    # The build backend comes from the same local folder: the build runs offline (this machine's
    # registry resolves to a reserved address, which the egress proxy refuses as it should).
    fetched = await trio.run_process([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:",
                                      "-d", str(links), "setuptools"], check=False, capture_stdout=True,
                                     capture_stderr=True)
    assert fetched.returncode == 0, fetched.stderr
    public(links)
    for p in links.iterdir():
        p.chmod(0o644)
    env = {"UV_FIND_LINKS": str(links), "UV_OFFLINE": "1"}
    plugins = make_plugin("built", GOOD_PLUGIN, manifest={"dependencies": ["toolcell-good-sdist==1.0"],
                                                         "allow_source_builds": True})
    make_plugin("evilbuild", DEPS_PLUGIN, manifest={"dependencies": ["toolcell-evil-sdist==1.0"],
                                                    "allow_source_builds": True})
    config = write_config(tmp_path, state_dir)
    code, out, err = await toolcell("call", "answer", "{}", "--plugins", str(plugins), "--config", str(config), env=env)
    assert code == 0 and json.loads(out)["structuredContent"] == {"result": 42}, out + err
    code, out, err = await toolcell("check", str(plugins / "evilbuild"), "--config", str(config), env=env)
    assert code == 1 and "building in the sandbox failed" in out, out + err
    assert ("Permission denied" in out or "PermissionError" in out) and str(canary) in out, out
    assert not canary.exists(), "the sdist's build touched the host"
