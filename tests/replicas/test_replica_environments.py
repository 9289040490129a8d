"""Installed plugin environments are not shared between replicas: each replica builds its own in its own
state dir from the lock the plugin folder ships, and they come out byte-identical (the same files with
the same contents), so the catalogs are byte-identical too. Real uv, real PyPI (as
tests/hosted/test_dependencies.py), two replicas behind HAProxy with one Redis."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx2
from replica_cluster import open_cluster
from task_e2e import TOKENS, WAIT_S, Http, text_of

from runtime import installer

SIX_PLUGIN = '''
import six

from sandbox import tool


@tool
def six_version() -> str:
    """Which six this replica's environment holds."""
    return six.__version__ + " " + six.__file__.rsplit("/envs/", 1)[1]
'''


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file and link below ``folder`` (relative path -> sha256 of its content, or its target), and
    each one's mode: what "byte-identical" compares."""
    found: dict[str, str] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            st = path.lstat()
            if path.is_symlink():
                found[rel] = f"link {os.readlink(path)}"
            elif path.is_file():
                found[rel] = f"{st.st_mode:o} {hashlib.sha256(path.read_bytes()).hexdigest()}"
            else:
                found[rel] = f"{st.st_mode:o} dir"
    return found


async def test_two_replicas_build_byte_identical_environments_and_catalogs_from_one_locked_folder(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("sixer", SIX_PLUGIN, manifest={"dependencies": ["six==1.17.0"]})
    folder = plugins / "sixer"
    # The lock ``toolcell add`` writes: every version pinned, with its hashes.
    (tmp_path / "requirements.in").write_text("six==1.17.0\n")
    subprocess.run([installer.uv_bin(), "pip", "compile", "--quiet", "--no-header", "--generate-hashes", "--only-binary",
                    ":all:", "--python", installer.python_exe(), "--no-config", "-o", str(folder / "requirements.lock"),
                    str(tmp_path / "requirements.in")], check=True, timeout=300, cwd=str(tmp_path),
                   env=installer._installer_env())  # as toolcell runs uv (the machine's trust store, ...)
    assert "--hash=sha256:" in (folder / "requirements.lock").read_text()
    async with open_cluster(tmp_path / "cluster", plugins, replicas=2) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        envs = [sorted((cluster.folder / name / "state" / "envs").glob("py-*")) for name in ("replica1", "replica2")]
        assert [len(e) for e in envs] == [1, 1], envs
        one, two = envs[0][0], envs[1][0]
        assert one.name == two.name  # the same key: the same lock, interpreter and platform
        assert one != two  # each replica's own, in its own state dir
        assert tree_digest(one) == tree_digest(two)
        assert any(rel.startswith("site/six") for rel in tree_digest(one))
        # What each serves: the same catalog, byte for byte, and the same answer from its own environment.
        listings, answers = set(), set()
        for daemon in cluster.replicas:
            http = Http(client, daemon.url, TOKENS["alice"])
            headers, body = http.modern_request("tools/list", {}, ext=False)
            r = await client.post(daemon.url, content=body, headers=headers)
            listings.add(r.content.replace(b'"id":' + str(json.loads(r.content)["id"]).encode(), b""))
            status, reply = await http.modern("tools/call", {"name": "six_version", "arguments": {}}, ext=False)
            assert status == 200, reply
            answers.add(text_of(reply["result"]))
        assert len(listings) == 1
        assert answers == {f"1.17.0 {one.name}/site/six.py"}
        prints = {(await cluster.healthz(client, d))[1]["catalog"] for d in cluster.replicas}
        assert len(prints) == 1
