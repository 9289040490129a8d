"""Shared fixtures: a helper that writes a plugin folder (manifest + module) under ``tmp_path``."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from skip_reasons import pytest_runtest_makereport  # noqa: F401 (a hook: the reason of a skip in a trio test)

REPO = Path(__file__).resolve().parents[1]

#: The daemons the tests start keep their default state (task store, pid files, keys, scopes) in a
#: directory of this test run, never in the user's (``$XDG_RUNTIME_DIR/toolcell-UID``, else
#: ``/tmp/toolcell-UID``), which a developer's own daemon, or another test run, would share: they then
#: took each other for replicas of one deployment (``catalog_differs``) and left pid files behind there.
_RUN_STATE = tempfile.mkdtemp(prefix="toolcell-tests-")
os.environ["XDG_RUNTIME_DIR"] = _RUN_STATE
atexit.register(shutil.rmtree, _RUN_STATE, True)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


@pytest.fixture
def make_plugin(tmp_path: Path) -> Callable[..., Path]:
    """``make_plugin(name, code, prefix=..., limits={...}, manifest={...}, root="plugins")``.

    Writes ``<tmp_path>/<root>/<name>/plugin.toml`` and ``<name>.py`` (``code`` is dedented) and
    returns the *folder of plugins* (``<tmp_path>/<root>``), ready for ``--plugins``.
    ``manifest`` entries are written verbatim at the top level (to break a manifest on purpose).
    """

    def make(name: str, code: str, *, prefix: str = "", limits: dict[str, Any] | None = None,
             manifest: dict[str, Any] | None = None, root: str = "plugins", folder: str | None = None) -> Path:
        plugins = tmp_path / root
        plugins.mkdir(parents=True, exist_ok=True)
        plugins.chmod(0o755)
        tmp_path.chmod(0o755)
        folder_path = plugins / (folder or name)
        folder_path.mkdir()
        folder_path.chmod(0o755)
        top: dict[str, Any] = {"name": name, "version": "0.1.0", "entry": name.replace("-", "_").replace(".", "_"),
                               "description": f"test plugin {name}"}
        if prefix:
            top["prefix"] = prefix
        top.update(manifest or {})
        lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
        if limits:
            lines.append("")
            lines.append("[limits]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in limits.items()]
        (folder_path / "plugin.toml").write_text("\n".join(lines) + "\n")
        module = folder_path / f"{top['entry']}.py"
        module.write_text(textwrap.dedent(code))
        module.chmod(0o644)
        return plugins

    return make
