"""The line between the two sides of the house: what may import what."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import nodes under ``if TYPE_CHECKING:`` (names for annotations, never loaded)."""
    nodes: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                nodes.update(ast.walk(child))
    return nodes


def imported_modules(path: Path, at_run_time: bool = False) -> set[str]:
    """Every module ``path`` imports; ``at_run_time``: not those imported for annotations only."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _type_checking_only(tree) if at_run_time else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def sources(*parts: str) -> list[Path]:
    return sorted((REPO.joinpath(*parts)).rglob("*.py"))


def modules_after_import(*modules: str) -> set[str]:
    """``sys.modules`` of a fresh interpreter after importing ``modules`` (nothing else loaded)."""
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=str(REPO), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_protocol_package_never_imports_trio_in_its_source() -> None:
    files = sources("runtime", "protocol")
    assert files
    for path in files:
        assert "trio" not in top_level(imported_modules(path)), path


def test_importing_the_protocol_core_loads_no_trio() -> None:
    loaded = modules_after_import("runtime.protocol.core", "runtime.protocol.eras", "runtime.protocol.jsonrpc",
                                  "runtime.protocol.framing")
    assert "runtime.protocol.core" in loaded
    assert not any(m == "trio" or m.startswith("trio.") for m in loaded)


def test_the_sandbox_never_imports_trio_in_its_source() -> None:
    files = sources("sandbox")
    assert files
    for path in files:
        assert "trio" not in top_level(imported_modules(path)), path


def test_the_sandbox_never_imports_the_daemon_side() -> None:
    for path in sources("sandbox"):
        assert "runtime" not in top_level(imported_modules(path)), path


def test_importing_the_worker_side_loads_no_trio() -> None:
    loaded = modules_after_import("sandbox", "sandbox.api", "sandbox.wire", "sandbox.worker")
    assert "sandbox.worker" in loaded
    assert not any(m == "trio" or m.startswith("trio.") for m in loaded)
    assert not any(m == "runtime" or m.startswith("runtime.") for m in loaded)


@pytest.mark.parametrize("plugin", sorted(p.name for p in (REPO / "plugins").iterdir()
                                          if (p / "plugin.toml").is_file()))
def test_bundled_plugins_import_only_the_authoring_api_never_trio_or_the_daemon(plugin: str) -> None:
    for path in sources("plugins", plugin):
        imported = top_level(imported_modules(path))
        assert not imported & {"trio", "runtime", "anyio"}, (path, imported)


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_the_protocol_package_is_closed_it_imports_nothing_else_of_the_daemon() -> None:
    """Sans-io and self-contained: ``runtime.protocol`` may use only itself, the shared ``sandbox.wire``
    vocabulary and ``runtime``'s version string, so it can be read and tested on its own. Only the
    seam's type (``runtime.execution.runner``, what runs a tool's calls) may be named, for annotations."""
    files = sources("runtime", "protocol")
    for path in files:
        for module in imported_modules(path, at_run_time=True):
            if module == "runtime" or module.startswith("runtime.") and not module.startswith("runtime.protocol"):
                assert module == "runtime", (path, module)
        for module in imported_modules(path) - imported_modules(path, at_run_time=True):
            assert module == "runtime.execution.runner" or module.startswith("runtime.protocol"), (path, module)
    assert "import" not in (REPO / "runtime" / "__init__.py").read_text(encoding="utf-8")


def test_no_module_of_the_daemon_or_the_worker_side_imports_in_a_circle() -> None:
    """Module-level imports between ``runtime`` and ``sandbox`` modules form no cycle (a function-level
    import would hide one from Python's own import order, so those count too)."""
    files = sources("runtime") + sources("sandbox")
    names = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets: set[str] = set()
        for module in imported_modules(path):
            if module in names:
                targets.add(module)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # ``from runtime import spares`` names a module, not an attribute
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names)
        targets.discard(name)
        graph[name] = {t for t in targets if not name.startswith(t + ".")}  # a package's own __init__
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_readme_layout_names_every_module_of_the_daemon_and_the_worker_side() -> None:
    """A newcomer finds every room in one look: each module of runtime/ and sandbox/ is in the table."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout"):]
    missing = []
    for path in sources("runtime") + sources("sandbox"):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(REPO)
        name = path.stem
        inside = rel.parts[1:-1]  # e.g. ("protocol",) or ("isolation",)
        named = (f"`{'/'.join(inside + (path.name,))}`" in layout or f"`{path.name}`" in layout
                 or (inside == ("isolation",) and f"`{name}`" in layout))
        if not named:
            missing.append(str(rel))
    assert not missing, f"README's Layout does not name: {missing}"


def test_every_repository_path_the_readme_names_exists() -> None:
    """A path in backticks (`runtime/...`, `benchmarks/...`) leads somewhere: `runtime/hosted.py` was
    named long after the module moved to `runtime/execution/`."""
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:runtime|sandbox|benchmarks|tests|deploy|plugins|\.ci)/[^`\s:]*)", readme))
    assert named, "no path found: the pattern is wrong"
    assert sorted(p for p in named if not (REPO / p.rstrip("/")).exists()) == []


def _json_rpc_code_literals(path: Path) -> list[tuple[int, int]]:
    """(line, code) of every ``-32xxx`` / ``-31xxx`` number written in ``path``'s code (not in its
    strings or comments): a JSON-RPC error code chosen outside the error table."""
    import io
    import tokenize

    found = []
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
    for before, tok in zip(tokens, tokens[1:], strict=False):
        if before.type == tokenize.OP and before.string == "-" and tok.type == tokenize.NUMBER:
            try:
                value = int(tok.string.replace("_", ""), 0)
            except ValueError:
                continue
            if 31000 <= value <= 32768:
                found.append((tok.start[0], -value))
    return found


def test_no_json_rpc_error_code_is_chosen_outside_the_error_table() -> None:
    """Issue 11: one module (``runtime/protocol/errors.py``) writes the codes; everything else raises
    or names one of its types. ``runtime/bench`` is exempt: its trivial server is a stand-in peer,
    not the daemon."""
    table = REPO / "runtime" / "protocol" / "errors.py"
    assert _json_rpc_code_literals(table), "the scanner must find the table's own codes"
    offenders = []
    for path in sorted((REPO / "runtime").rglob("*.py")) + sorted((REPO / "sandbox").rglob("*.py")):
        if path == table or (REPO / "runtime" / "bench") in path.parents:
            continue
        offenders += [f"{path.relative_to(REPO)}:{line}: {code}" for line, code in _json_rpc_code_literals(path)]
    assert offenders == []
