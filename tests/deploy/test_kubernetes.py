"""The Kubernetes manifests (``deploy/kubernetes/``): rendered by ``kubectl kustomize``, every object
validated against the Kubernetes schema (``kubernetes-validate``, strict: unknown fields fail), and
what the pods need from each other checked: the probes, the sandbox's pod security settings, the
Secret and ConfigMap where toolcell.toml says they are, the HPA on the Deployment, Redis."""

from __future__ import annotations

import copy
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from runtime.approvals_shared import RedisBook
from runtime.config import ConfigError, load_config
from runtime.mrtr import load_state_key

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
#: The schema version validated against (kubernetes-validate's newest bundled at the time of writing).
SCHEMA_VERSION = "1.37.0"

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it renders the kustomizations)")


def render(folder: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(KUBE / folder)], capture_output=True, text=True, timeout=120,
                         check=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render("base")


@pytest.fixture(scope="module")
def with_redis() -> list[dict[str, Any]]:
    return render("overlays/with-redis")


@pytest.mark.parametrize("folder", ["base", "overlays/with-redis"])
def test_every_rendered_object_passes_the_kubernetes_schema_strictly(folder: str) -> None:
    docs = render(folder)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap", "Secret", "HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)


def test_the_schema_validation_catches_a_misspelt_field(base: list[dict[str, Any]]) -> None:
    broken = copy.deepcopy(one(base, "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["procMout"] = "Unmasked"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSION, strict=True)


def test_kubectl_client_dry_run_accepts_the_rendered_base(tmp_path: Path) -> None:
    assert KUBECTL is not None
    rendered = subprocess.run([KUBECTL, "kustomize", str(KUBE / "base")], capture_output=True, text=True,
                              timeout=120, check=True).stdout
    run = subprocess.run([KUBECTL, "apply", "--dry-run=client", "-f", "-"], input=rendered, capture_output=True,
                         text=True, timeout=120, check=False)
    if run.returncode != 0 and any(s in run.stderr for s in ("connection refused", "failed to download openapi",
                                                             "couldn't get current server API group list")):
        # kubectl's client-side dry run still asks an API server for discovery and the OpenAPI schema.
        pytest.skip("kubectl apply --dry-run=client needs a reachable API server (none here); the schema test "
                    f"above validates offline instead: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    assert "created (dry run)" in run.stdout or "configured (dry run)" in run.stdout


def test_replicas_are_behind_a_service_that_selects_their_pods(base: list[dict[str, Any]]) -> None:
    deployment, service = one(base, "Deployment"), one(base, "Service")
    assert deployment["spec"]["replicas"] >= 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"]: p for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["http"]["containerPort"] == 8765
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def test_readiness_and_liveness_probe_different_endpoints(base: list[dict[str, Any]]) -> None:
    container = one(base, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"


def test_the_pod_runs_unprivileged_with_only_what_the_sandbox_needs(base: list[dict[str, Any]]) -> None:
    spec = one(base, "Deployment")["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
    assert spec["hostUsers"] is False and spec["automountServiceAccountToken"] is False
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in ctx and "add" not in ctx["capabilities"]
    # unshare/mount for the workers' namespaces, and a /proc they may mount afresh:
    assert ctx["seccompProfile"]["type"] == "Unconfined" and ctx["appArmorProfile"]["type"] == "Unconfined"
    assert ctx["procMount"] == "Unmasked"
    shutdown_grace_s = tomllib.loads(one(base, "ConfigMap")["data"]["toolcell.toml"])["http"]["shutdown_grace_s"]
    assert spec["terminationGracePeriodSeconds"] > shutdown_grace_s


def _mounts(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    spec = one(docs, "Deployment", "toolcell")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in spec["containers"][0]["volumeMounts"]}


def test_the_config_map_and_the_secret_are_mounted_where_toolcell_toml_says(base: list[dict[str, Any]],
                                                                          tmp_path: Path) -> None:
    mounts = _mounts(base)
    config_map, secret = one(base, "ConfigMap"), one(base, "Secret")
    assert mounts["/etc/toolcell"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert mounts["/run/secrets/toolcell"]["secret"]["secretName"] == secret["metadata"]["name"]
    container = one(base, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["serve", "--config", "/etc/toolcell/toolcell.toml"]
    raw = tomllib.loads(config_map["data"]["toolcell.toml"])
    secret_files = {f"/run/secrets/toolcell/{name}": text for name, text in secret["stringData"].items()}
    assert raw["state_key_file"] in secret_files and raw["http"]["tokens_file"] in secret_files
    # Approvals are shared through the task store's Redis, signed with a key from the Secret.
    assert raw["approvals"]["store"] == raw["tasks"]["store"] and raw["approvals"]["key_file"] in secret_files
    approvals_key = tmp_path / "approvals.key"
    approvals_key.write_text(secret_files[raw["approvals"].pop("key_file")])
    approvals_key.chmod(0o600)
    raw["approvals"]["key_file"] = str(approvals_key)
    assert "needs at least 32 bytes" in RedisBook(raw["approvals"]["store"], str(approvals_key)).read().problem
    assert raw["state_dir"] in mounts  # writable (an emptyDir) under a read-only root filesystem
    # The config is valid once the Secret holds real values, and refused while it holds the placeholders.
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(secret_files[raw["http"]["tokens_file"]])
    raw["http"]["tokens_file"] = str(tokens)
    with pytest.raises(ConfigError, match="sha256 must be 64 lowercase hex"):
        load_config(None, raw)
    key = tmp_path / "key"
    key.write_text(secret_files[raw.pop("state_key_file")])
    key.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_state_key(str(key))
    tokens.write_text(f'[[tokens]]\nprincipal = "ci"\nsha256 = "{"d" * 64}"\n')
    cfg = load_config(None, raw)
    assert cfg.http.listen == "0.0.0.0:8765" and cfg.http.tokens[0].principal == "ci"


def test_the_autoscaler_scales_the_deployment_from_its_replica_count(base: list[dict[str, Any]]) -> None:
    hpa, deployment = one(base, "HorizontalPodAutoscaler"), one(base, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_redis_is_an_external_url_in_the_base_and_a_service_of_its_own_in_the_overlay(
        base: list[dict[str, Any]], with_redis: list[dict[str, Any]]) -> None:
    assert not [d for d in base if "redis" in d["metadata"]["name"]]
    assert tomllib.loads(one(base, "ConfigMap")["data"]["toolcell.toml"])["tasks"]["store"].startswith("redis://")
    store = tomllib.loads(one(with_redis, "ConfigMap")["data"]["toolcell.toml"])["tasks"]["store"]
    service = one(with_redis, "Service", "toolcell-redis")
    assert store == f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    redis = one(with_redis, "Deployment", "toolcell-redis")
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    # The overlay's config replaces the base's under the same name, and the pods mount that one.
    assert _mounts(with_redis)["/etc/toolcell"]["configMap"]["name"] == one(with_redis, "ConfigMap")["metadata"]["name"]
