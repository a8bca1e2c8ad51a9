"""The replicated Kubernetes example (examples/kubernetes-replicated), checked without a
cluster: its patches, applied to examples/kubernetes as kustomize's strategic merge does
for the fields they touch, give two authserver replicas on PostgreSQL with their signing
keys sealed under a secret from a Secret that no committed file holds, a readiness probe on
/readyz, and no volume left; the patched config passes `check`.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import sys
from typing import Any

import pytest
import yaml

from authserver import settings as authserver_settings
from portcullis.yamlconf import ConfigError
from tests.deploy.dockerfile import ROOT
from tests.examples.test_kubernetes import (
    K8S,
    container,
    container_ports,
    documents,
    open_ports,
    selects,
)

OVERLAY = ROOT / "examples" / "kubernetes-replicated"
KEY_SECRET = base64.b64encode(bytes(range(32))).decode()
VALUES = {  # what the Secrets hold in this test
    "MACHINE_CLIENT_SECRET": "kubernetes-test-machine-secret-0123456789abcdef",
    "PORTCULLIS_KEY_SECRET": KEY_SECRET,
    "POSTGRES_URL": "postgresql://portcullis:pw@postgres.example.internal:5432/portcullis",
}
# The list fields the patches touch, and the key kustomize merges their items by.
MERGE_KEYS = {
    "containers": "name",
    "ports": "containerPort",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumes": "name",
}


def kustomization() -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    return found


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into `base` for mappings and the lists of MERGE_KEYS."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = merge(base[key], value, key) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        by = MERGE_KEYS[field]
        merged_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            index = next((i for i, b in enumerate(merged_list) if b[by] == item[by]), None)
            if item.get("$patch") == "delete":
                assert index is not None, f"the patch deletes {item} that is not there"
                del merged_list[index]
            elif index is None:
                merged_list.append(item)
            else:
                merged_list[index] = merge(merged_list[index], item)
        return merged_list
    return patch


def patched() -> list[dict[str, Any]]:
    """examples/kubernetes with the overlay's patches and resources."""
    result = [copy.deepcopy(d) for d in documents()]
    (entry,) = kustomization()["patches"]
    for patch in yaml.safe_load_all((OVERLAY / entry["path"]).read_text()):
        kind, name = patch["kind"], patch["metadata"]["name"]
        (index,) = [
            i for i, d in enumerate(result) if d["kind"] == kind and d["metadata"]["name"] == name
        ]
        if patch.get("$patch") == "delete":
            del result[index]
        else:
            result[index] = merge(result[index], patch)
    for resource in kustomization()["resources"]:
        if resource.endswith(".yaml"):
            result += list(yaml.safe_load_all((OVERLAY / resource).read_text()))
    return result


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def env_of(entry: dict[str, Any]) -> dict[str, str]:
    """The container's environment, each Secret reference checked against the example file
    of the generator that makes that Secret."""
    env = {}
    for item in entry["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secret_example(ref["name"]), ref
        env[item["name"]] = VALUES[ref["key"]]
    return env


def secret_example(name: str) -> dict[str, str]:
    generators = {g["name"]: (OVERLAY / g["envs"][0]) for g in kustomization()["secretGenerator"]}
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generators.update({g["name"]: (K8S / g["envs"][0]) for g in base["secretGenerator"]})
    text = generators[name].with_name(generators[name].name + ".example").read_text()
    pairs = [line.split("=", 1) for line in text.splitlines() if line and line[0] != "#"]
    return dict(pairs)


def authserver() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], str]:
    docs = patched()
    deployment = one(docs, "Deployment", "authserver")
    entry = container(deployment, "authserver")
    text: str = one(docs, "ConfigMap", "authserver")["data"]["authserver.yaml"]
    return docs, deployment, entry, text


def test_the_overlay_builds_on_the_single_server_example():
    assert kustomization()["resources"][0] == "../kubernetes"
    names = {(d["kind"], d["metadata"]["name"]) for d in patched()}
    assert ("PersistentVolumeClaim", "authserver-data") not in names
    assert {("Deployment", "orders"), ("Service", "authserver")} <= names
    budget = one(patched(), "PodDisruptionBudget", "authserver")
    assert budget["spec"]["maxUnavailable"] == 1


def test_two_replicas_share_postgresql_and_keep_nothing_on_a_volume():
    _, deployment, entry, text = authserver()
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert [m["mountPath"] for m in entry["volumeMounts"]] == ["/etc/portcullis"]
    assert [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]] == ["config"]
    settings = authserver_settings.load_text(text, "authserver.yaml", env_of(entry))
    assert settings.storage == VALUES["POSTGRES_URL"]
    assert settings.keys.dir is None and settings.keys.encryption_key == KEY_SECRET
    assert settings.keys.reload_every <= settings.keys.jwks_max_age
    # Ready while the database answers and the keys are current: the admin listener.
    probe = entry["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"
    assert container_ports(entry)[probe["port"]] == settings.admin_listen.port
    assert container_ports(entry)["http"] == settings.listen.port


def test_the_key_secret_and_database_url_come_from_a_file_kept_out_of_version_control():
    (generator,) = kustomization()["secretGenerator"]
    (env_file,) = generator["envs"]
    assert (OVERLAY / ".gitignore").read_text().split() == [env_file]
    assert secret_example(generator["name"]) == {"PORTCULLIS_KEY_SECRET": "", "POSTGRES_URL": ""}
    _, _, entry, text = authserver()
    refs = {
        item["name"]: item["valueFrom"]["secretKeyRef"]["name"]
        for item in entry["env"]
        if "valueFrom" in item
    }
    assert refs["PORTCULLIS_KEY_SECRET"] == refs["POSTGRES_URL"] == generator["name"]
    # An empty key secret, as the example file has it, is refused.
    env = {**env_of(entry), "PORTCULLIS_KEY_SECRET": ""}
    with pytest.raises(ConfigError, match="encryption_key"):
        authserver_settings.load_text(text, "authserver.yaml", env)
    overlay_files = [p for p in OVERLAY.iterdir() if p.suffix == ".yaml"]
    for path in overlay_files:
        kinds = {d.get("kind") for d in yaml.safe_load_all(path.read_text()) if d}
        assert "Secret" not in kinds, path


def test_the_patched_config_passes_the_authservers_check(tmp_path):
    _, _, entry, text = authserver()
    path = tmp_path / "authserver.yaml"
    path.write_text(text)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PORTCULLIS")},
        **env_of(entry),
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-m", "authserver", "check", "--config", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_replicas_keep_the_probes_and_network_policy_of_the_single_server():
    docs, deployment, entry, text = authserver()
    settings = authserver_settings.load_text(text, "authserver.yaml", env_of(entry))
    assert settings.admin_listen.host == "0.0.0.0"  # the kubelet probes the Pod's address
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = entry[probe]["httpGet"]
        assert get["path"] == path
        assert container_ports(entry)[get["port"]] == settings.admin_listen.port
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d, deployment)]
    assert open_ports(policy) == ({"http"}, {"admin"})
