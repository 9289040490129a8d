"""Harness for the bundled plugins' tests: import a plugin the way the worker does and call its
tools through ``sandbox.worker.run_call`` (argument conversion, result shaping, frame encoding)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any

import msgspec

from runtime.manifest import Manifest, load_manifest
from sandbox import api
from sandbox.wire import Call, Log, Progress, Result, encode_frame
from sandbox.calls import run_call

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIRS: dict[str, Path] = {
    "textkit": REPO / "plugins" / "textkit",
    "mathkit": REPO / "plugins" / "mathkit",
    "codec": REPO / "plugins" / "codec",
    "timekit": REPO / "plugins" / "timekit",
    "jsonkit": REPO / "plugins" / "jsonkit",
    "conformance": REPO / "plugins" / "conformance",
    "echo": REPO / "benchmarks" / "plugins" / "echo",
}

try:
    import jsonschema_rs
except ImportError:  # pragma: no cover - optional: schemas are then only checked structurally
    jsonschema_rs = None


@dataclasses.dataclass
class Outcome:
    result: Result
    frames: list[Any]

    @property
    def text(self) -> str:
        assert self.result.content and self.result.content[0]["type"] == "text", self.result.content
        return str(self.result.content[0]["text"])

    @property
    def structured(self) -> Any:
        assert self.result.has_structured, self.result
        return self.result.structured


@dataclasses.dataclass
class LoadedPlugin:
    name: str
    folder: Path
    manifest: Manifest
    module: Any
    tools: dict[str, api.ToolDef]

    def call(self, tool: str, progress: bool = False, log_level: int = -1, **arguments: Any) -> Outcome:
        """Run one call as the worker does; check the result encodes and matches the declared schemas."""
        tdef = self.tools[tool]
        frames: list[Any] = []
        result = run_call(self.tools, Call(1, tool, arguments, progress, log_level), frames.append)
        encode_frame(result)  # must cross the msgpack channel (e.g. no ints beyond 64 bits)
        for frame in frames:
            assert isinstance(frame, (Progress, Log))
            encode_frame(frame)
        assert result.traceback is None, f"{tool} crashed:\n{result.traceback}"
        if result.has_structured and not result.is_error:
            assert tdef.output_schema is not None
            check_instance(tdef.output_schema, result.structured)
            assert msgspec.json.decode(result.content[0]["text"]) == result.structured
        return Outcome(result, frames)

    def error(self, tool: str, **arguments: Any) -> str:
        """Call a tool expecting a ToolError (an isError result); return its message."""
        out = self.call(tool, **arguments)
        assert out.result.is_error, f"{tool} did not fail: {out.result}"
        assert not out.result.has_structured
        return out.text


def check_instance(schema: dict[str, Any], instance: Any) -> None:
    if jsonschema_rs is not None:
        jsonschema_rs.validator_for(schema).validate(instance)


def import_plugin(name: str) -> LoadedPlugin:
    folder = PLUGIN_DIRS[name]
    manifest = load_manifest(folder)
    api.TOOLS.clear()
    sys.modules.pop(manifest.entry, None)
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(manifest.entry)
    finally:
        sys.path.remove(str(folder))
    tools = {t.name: t for t in api.TOOLS}
    api.TOOLS.clear()
    return LoadedPlugin(name, folder, manifest, module, tools)
