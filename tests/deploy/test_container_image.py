"""The OCI image (``deploy/Containerfile``) and its entrypoint (``runtime.entrypoint``): what the
file must say, checked statically; the doctor gate, in-process; and a real build and run where this
machine has a container engine that can reach the base image (otherwise the test says precisely
what is missing and skips)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest

from runtime import entrypoint
from runtime.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "deploy" / "Containerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    steps = _instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def test_the_image_is_built_on_a_slim_python_base() -> None:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", CONTAINERFILE.read_text(), re.M))
    assert re.fullmatch(r"docker\.io/library/python:3\.1[1-9]-slim(-\w+)?", args["PYTHON_IMAGE"])
    assert [rest for word, rest in _instructions() if word == "FROM"] == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]


def test_the_daemon_runs_as_an_unprivileged_user() -> None:
    users = [rest for word, rest in _final_stage() if word == "USER"]
    assert users, "the final stage sets no USER: the daemon would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000  # numeric, so runAsNonRoot can verify it
    runs = " ".join(rest for word, rest in _final_stage() if word == "RUN")
    assert f"--uid {uid}" in runs and "/var/lib/toolcell" in runs


def test_the_entrypoint_runs_the_doctor_before_serving() -> None:
    final = _final_stage()
    (entry,) = [rest for word, rest in final if word == "ENTRYPOINT"]
    (cmd,) = [rest for word, rest in final if word == "CMD"]
    assert json.loads(entry) == ["python", "-m", "runtime.entrypoint"]  # exec form: python is pid 1
    assert '"serve"' in cmd and "/etc/toolcell/toolcell.toml" in cmd
    assert [rest for word, rest in final if word == "STOPSIGNAL"] == ["SIGTERM"]
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert "/readyz" in health


def test_what_the_sandbox_needs_from_the_engine_is_written_in_the_file() -> None:
    head = CONTAINERFILE.read_text()
    for needed in ("user namespaces", "seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined",
                   "unmask=ALL", "cgroup v2", "--cgroupns=private", "libseccomp2"):
        assert needed in head, needed


def test_every_path_the_file_copies_exists_in_the_checkout() -> None:
    for word, rest in _instructions():
        if word == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), source


def test_the_default_config_of_the_image_is_valid_and_needs_tokens(tmp_path: Path) -> None:
    raw: dict[str, Any] = tomllib.loads((REPO / "deploy" / "toolcell.toml").read_text())
    assert raw["policy"] == "strict" and raw["http"]["listen"] == "0.0.0.0:8765"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tokens]]\nprincipal = "ci"\nsha256 = "{"c" * 64}"\n')
    raw["http"]["tokens_file"] = str(tokens)
    cfg = load_config(None, raw)
    assert cfg.state_dir == "/var/lib/toolcell" and [t.principal for t in cfg.http.tokens] == ["ci"]


# -- the entrypoint's doctor gate ---------------------------------------------------------------------

ALL_LAYERS = ("hygiene", "rlimits", "identity", "cgroup", "namespaces", "landlock", "seccomp")


def _report(missing: tuple[str, ...]) -> dict[str, Any]:
    layers = {name: {"available": name not in missing, "reason": f"{name} reason", "fix": f"fix {name}"}
              for name in ALL_LAYERS}
    return {"layers": layers, "strict": {"ok": not missing, "detail": "x"}, "python": "3", "euid": 10001}


@pytest.fixture
def exec_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(entrypoint.os, "execv", lambda path, argv: calls.append(list(argv)))
    monkeypatch.setattr(entrypoint.cgroups, "enter_daemon_leaf", lambda: None)
    return calls


def test_a_container_that_cannot_isolate_says_why_and_refuses_under_strict(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exec_calls: list[list[str]]) -> None:
    monkeypatch.setattr(entrypoint.doctor, "run_probe", lambda: _report(("namespaces",)))
    assert entrypoint.main(["serve", "--http"]) == entrypoint.EXIT_CANNOT_ISOLATE
    err = capsys.readouterr().err
    assert "namespaces   MISSING" in err and "fix namespaces" in err
    assert "refusing to start: the strict policy needs every isolation layer" in err
    assert exec_calls == []


def test_under_compat_or_with_every_layer_the_entrypoint_becomes_toolcell_serve(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exec_calls: list[list[str]],
        tmp_path: Path) -> None:
    monkeypatch.setattr(entrypoint.doctor, "run_probe", lambda: _report(("cgroup",)))
    config = tmp_path / "toolcell.toml"
    config.write_text('policy = "compat"\n')
    assert entrypoint.main(["serve", "--config", str(config), "--http"]) == 0
    assert exec_calls[-1][1:] == ["-m", "runtime.cli", "serve", "--config", str(config), "--http"]
    assert "cgroup       MISSING" in capsys.readouterr().err
    monkeypatch.setattr(entrypoint.doctor, "run_probe", lambda: _report(()))
    assert entrypoint.main(["serve", "--http"]) == 0
    assert exec_calls[-1][-2:] == ["serve", "--http"]


def test_the_policy_is_read_from_the_flag_then_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "toolcell.toml"
    config.write_text('policy = "compat"\n')
    assert entrypoint.policy_of(["--config", str(config)]) == "compat"
    assert entrypoint.policy_of([f"--config={config}", "--policy", "strict"]) == "strict"
    assert entrypoint.policy_of([]) == "strict"
    assert entrypoint.policy_of(["--config", str(tmp_path / "missing.toml")]) is None


def test_other_commands_are_run_without_the_gate(monkeypatch: pytest.MonkeyPatch,
                                                 exec_calls: list[list[str]]) -> None:
    monkeypatch.setattr(entrypoint.doctor, "run_probe", lambda: pytest.fail("doctor run for `toolcell list`"))
    assert entrypoint.main(["list"]) == 0
    assert exec_calls == [[exec_calls[0][0], "-m", "runtime.cli", "list"]]


# -- a real build and run -----------------------------------------------------------------------------


def _engine() -> tuple[str | None, str]:
    """A container engine that answers, or None and exactly why not."""
    why = []
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if path is None:
            why.append(f"{name} is not installed")
            continue
        probe = subprocess.run([path, "info"], capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode == 0:
            return path, ""
        last = (probe.stderr.strip() or probe.stdout.strip()).splitlines()[-1:] or ["no output"]
        why.append(f"`{name} info` failed: {last[0]}")
    return None, "; ".join(why)


@pytest.fixture(scope="module")
def image() -> Any:
    engine, why = _engine()
    if engine is None:
        pytest.skip(f"cannot build the image on this machine: no container engine ({why})")
    tag = f"localhost/toolcell-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run([engine, "build", "-f", str(CONTAINERFILE), "-t", tag, str(REPO)],
                           capture_output=True, text=True, timeout=1800, check=False)
    if build.returncode != 0:
        output = build.stdout + build.stderr
        if re.search(r"(pull|resolv|manifest|registry|TLS handshake|dial tcp|no such host|i/o timeout)", output, re.I) \
                and "python" in output:
            pytest.skip(f"cannot build the image on this machine: the base image is not reachable:\n{output[-1500:]}")
        pytest.fail(f"{engine} build failed:\n{output[-4000:]}")
    yield engine, tag
    subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=300, check=False)


def test_the_built_image_runs_the_doctor_as_its_unprivileged_user(image: tuple[str, str]) -> None:
    engine, tag = image
    whoami = subprocess.run([engine, "run", "--rm", "--entrypoint", "id", tag, "-u"], capture_output=True,
                            text=True, timeout=300, check=True)
    assert whoami.stdout.strip() == "10001"
    doctor = subprocess.run([engine, "run", "--rm", tag, "doctor"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert doctor.returncode in (0, 1), doctor.stderr
    for layer in ALL_LAYERS:
        assert layer in doctor.stdout


def test_the_built_image_refuses_under_strict_without_the_engine_options_and_says_why(image: tuple[str, str]) -> None:
    engine, tag = image
    # The engine's default seccomp profile and masked /proc leave a worker without namespaces.
    run = subprocess.run([engine, "run", "--rm", tag, "serve", "--policy", "strict", "--http", "127.0.0.1:8765"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == entrypoint.EXIT_CANNOT_ISOLATE, run.stdout + run.stderr
    assert "refusing to start" in run.stderr and "MISSING" in run.stderr
