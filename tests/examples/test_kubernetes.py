"""The Kubernetes example (examples/kubernetes), checked without a cluster: the manifests
parse and hold the fields the API server requires, the orders Pod runs the API on loopback
with the gateway as its sidecar, probes and Services point at ports the configs really
listen on (readiness on /readyz of each program's admin listener), NetworkPolicies keep the
admin listeners within the namespace, an Ingress with TLS is the authserver's https
address, every container is confined, and the embedded configs pass `check`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from authserver import settings as authserver_settings
from gateway import settings as gateway_settings
from gateway.memory import worst_case
from portcullis.yamlconf import ConfigError
from tests.deploy.dockerfile import ROOT, parse, with_data_volume

K8S = ROOT / "examples" / "kubernetes"
SECRET = "kubernetes-test-machine-secret-0123456789abcdef"
IMAGE = "portcullis:latest"  # README: docker build -t portcullis .
REQUIRED = {
    "ConfigMap": ("data",),
    "PersistentVolumeClaim": ("spec",),
    "Deployment": ("spec",),
    "Service": ("spec",),
    "NetworkPolicy": ("spec",),
    "Ingress": ("spec",),
}
API_VERSIONS = {
    "Deployment": "apps/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Ingress": "networking.k8s.io/v1",
}


def kustomization() -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return found


def secret_keys(name: str) -> dict[str, str]:
    """The keys of a Secret kustomize generates, as the committed example file lists them."""
    (generator,) = [g for g in kustomization()["secretGenerator"] if g["name"] == name]
    (env_file,) = generator["envs"]
    example = (K8S / f"{env_file}.example").read_text()
    pairs = [line.split("=", 1) for line in example.splitlines() if line and line[0] != "#"]
    return dict(pairs)


def documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    spec = deployment["spec"]["template"]["spec"]
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def container_ports(entry: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in entry.get("ports", [])}


def container_env(entry: dict[str, Any]) -> dict[str, str]:
    """The container's environment; a value from a Secret is this test's secret."""
    env = {}
    for item in entry.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secret_keys(ref["name"]), ref
            env[item["name"]] = SECRET
    return env


def mounted_config(deployment: dict[str, Any], entry: dict[str, Any], file: str) -> str:
    """The text of /etc/portcullis/FILE in this container: a key of a mounted ConfigMap."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in entry["volumeMounts"] if m["mountPath"] == "/etc/portcullis"]
    assert mount["readOnly"] is True
    config_map = one("ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    text: str = config_map["data"][file]
    return text


def load_gateway(text: str, env: dict[str, str]) -> gateway_settings.Settings:
    return gateway_settings.load_text(text, "gateway.yaml", env)


def orders() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = one("Deployment", "orders")
    return deployment, container(deployment, "api"), container(deployment, "gateway")


def gateway_settings_of_the_pod() -> gateway_settings.Settings:
    deployment, _, gateway = orders()
    return load_gateway(mounted_config(deployment, gateway, "gateway.yaml"), container_env(gateway))


def port_of(entry: dict[str, Any], port: int | str) -> int:
    return container_ports(entry)[port] if isinstance(port, str) else port


def seconds(command: list[str]) -> int:
    assert command[0] == "sleep"
    return int(command[1])


# ---------------------------------------------------------------------------- structure


def test_every_manifest_parses_and_has_the_fields_its_kind_requires():
    docs = documents()
    assert {d["kind"] for d in docs} == set(REQUIRED)
    for doc in docs:
        assert doc["apiVersion"] == API_VERSIONS.get(doc["kind"], "v1")
        assert doc["metadata"]["name"] and doc["metadata"]["labels"]
        for field in REQUIRED[doc["kind"]]:
            assert field in doc, (doc["kind"], field)
    assert sorted(kustomization()["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_each_service_selects_a_deployments_pods_and_targets_a_named_container_port():
    deployments = [d for d in documents() if d["kind"] == "Deployment"]
    for service in (d for d in documents() if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (deployment,) = [
            d
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert deployment["spec"]["selector"]["matchLabels"] == selector
        named = {
            name: port
            for entry in deployment["spec"]["template"]["spec"]["containers"]
            for name, port in container_ports(entry).items()
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, port


def test_every_container_is_confined_and_has_resources():
    uid, gid = parse()[-1].one("USER").args.split(":")
    for deployment in (d for d in documents() if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        # The image's user: the state volume and the image's files are set up for it.
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (uid, gid)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        for entry in pod["containers"]:
            security = entry["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, entry["name"]
            assert security["readOnlyRootFilesystem"] is True, entry["name"]
            assert security["capabilities"] == {"drop": ["ALL"]}, entry["name"]
            for bound in ("requests", "limits"):
                assert set(entry["resources"][bound]) == {"cpu", "memory"}, entry["name"]


# ---------------------------------------------------------------------------- the orders Pod


def test_the_gateways_memory_limit_covers_its_worst_case():
    _, _, gateway = orders()
    limit = gateway["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    worst = worst_case(gateway_settings_of_the_pod())
    assert worst.total <= int(limit[:-2]) * 1024 * 1024, f"{limit} < {worst}"


def test_the_api_listens_on_loopback_and_the_gateway_is_its_only_way_in():
    _, api, gateway = orders()
    command = api["command"]
    host, port = command[command.index("--host") + 1], int(command[command.index("--port") + 1])
    assert host == "127.0.0.1"
    assert "ports" not in api  # nothing to reach from outside the Pod
    settings = gateway_settings_of_the_pod()
    assert settings.upstream.url == f"http://127.0.0.1:{port}"
    assert container_ports(gateway) == {
        "http": settings.listen.port,
        "admin": settings.admin_listen.port,
    }
    service = one("Service", "orders")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]  # never admin


def test_the_probes_ask_the_admin_listener_which_the_kubelet_can_reach():
    _, _, gateway = orders()
    settings = gateway_settings_of_the_pod()
    # The kubelet connects to the Pod's address, not to its loopback.
    assert settings.admin_listen.host == "0.0.0.0"
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = gateway[probe]["httpGet"]
        assert get["path"] == path
        assert port_of(gateway, get["port"]) == settings.admin_listen.port


def test_the_pod_drains_before_kubernetes_stops_waiting():
    deployment, api, gateway = orders()
    grace = gateway_settings_of_the_pod().shutdown_grace.total_seconds()
    pause = seconds(gateway["lifecycle"]["preStop"]["exec"]["command"])
    # The API keeps serving while the gateway drains the requests it forwards.
    assert seconds(api["lifecycle"]["preStop"]["exec"]["command"]) >= pause + grace
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pause + grace


def test_the_gateway_runs_the_image_with_its_config_from_the_config_map():
    _, _, gateway = orders()
    assert (gateway["image"], gateway["imagePullPolicy"]) == (IMAGE, "IfNotPresent")
    assert gateway["args"] == parse()[-1].one("CMD").exec_form()


# ---------------------------------------------------------------------------- authserver


def test_the_authserver_keeps_its_state_on_its_claim_and_runs_one_at_a_time():
    deployment = one("Deployment", "authserver")
    # SQLite: one writer, so one replica, and the old Pod gone before the new one starts.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    entry = container(deployment, "authserver")
    volumes = {v["name"]: v for v in pod["volumes"]}
    (data,) = [m for m in entry["volumeMounts"] if m["mountPath"] == "/var/lib/portcullis"]
    claim = volumes[data["name"]]["persistentVolumeClaim"]["claimName"]
    assert one("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    text = mounted_config(deployment, entry, "authserver.yaml")
    settings = authserver_settings.load_text(text, "authserver.yaml", container_env(entry))
    assert settings.storage == "sqlite:///var/lib/portcullis/authserver.db"
    assert settings.keys.dir == "/var/lib/portcullis/keys"
    assert container_ports(entry) == {
        "http": settings.listen.port,
        "admin": settings.admin_listen.port,
    }
    # The kubelet probes the Pod's address: the admin listener is not on loopback.
    assert settings.admin_listen.host == "0.0.0.0"
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = entry[probe]["httpGet"]
        assert (get["path"], port_of(entry, get["port"])) == (path, settings.admin_listen.port)
    assert [p["targetPort"] for p in one("Service", "authserver")["spec"]["ports"]] == ["http"]
    assert entry["args"][:2] == ["portcullis-authserver", "run"]
    assert (entry["image"], entry["imagePullPolicy"]) == (IMAGE, "IfNotPresent")


def test_the_gateway_trusts_the_authserver_and_fetches_its_keys_through_its_service():
    _, _, gateway = orders()
    entry = container(one("Deployment", "authserver"), "authserver")
    assert container_env(gateway)["PORTCULLIS_ISSUER"] == container_env(entry)["PORTCULLIS_ISSUER"]
    (trusted,) = gateway_settings_of_the_pod().issuers
    jwks = urlsplit(trusted.jwks_uri or "")
    service = one("Service", "authserver")
    assert (jwks.hostname, jwks.port) == (
        service["metadata"]["name"],
        service["spec"]["ports"][0]["port"],
    )


def test_the_secret_comes_from_a_file_kept_out_of_version_control():
    (generator,) = kustomization()["secretGenerator"]
    (env_file,) = generator["envs"]
    assert (K8S / ".gitignore").read_text().split() == [env_file]
    # The example has no value to copy by mistake, and the server refuses an empty one.
    assert secret_keys(generator["name"]) == {"MACHINE_CLIENT_SECRET": ""}
    deployment = one("Deployment", "authserver")
    entry = container(deployment, "authserver")
    text = mounted_config(deployment, entry, "authserver.yaml")
    env = {**container_env(entry), "MACHINE_CLIENT_SECRET": ""}
    with pytest.raises(ConfigError, match="client_secret"):
        authserver_settings.load_text(text, "authserver.yaml", env)
    assert not [d for d in documents() if d["kind"] == "Secret"]  # no secret in a manifest


@pytest.mark.parametrize(
    ("deployment", "name", "file"),
    [("orders", "gateway", "gateway.yaml"), ("authserver", "authserver", "authserver.yaml")],
)
def test_the_embedded_configs_pass_their_programs_check(deployment, name, file, tmp_path):
    manifest = one("Deployment", deployment)
    entry = container(manifest, name)
    path = tmp_path / file
    # The PersistentVolumeClaim mounted at /var/lib/portcullis: a directory that exists.
    path.write_text(with_data_volume(mounted_config(manifest, entry, file), tmp_path))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PORTCULLIS")},
        **container_env(entry),
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-m", name, "check", "--config", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"{path}: OK"
    assert Path(entry["args"][-1]).name == file


# ---------------------------------------------------------------------------- readiness


def portcullis_containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(Deployment name, container) of every container that runs one of our programs."""
    found = []
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        for entry in deployment["spec"]["template"]["spec"]["containers"]:
            if entry.get("args", [""])[0].startswith("portcullis-"):
                found.append((deployment["metadata"]["name"], entry))
    return found


def test_every_program_is_ready_on_the_readyz_of_its_admin_port_and_alive_on_healthz():
    containers = portcullis_containers(documents())
    assert {name for name, _ in containers} == {"orders", "authserver"}
    for name, entry in containers:
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = entry[probe]["httpGet"]
            assert (get["path"], get["port"]) == (path, "admin"), (name, probe)
            assert "admin" in container_ports(entry), name


# ---------------------------------------------------------------------------- network policies


def selects(policy: dict[str, Any], deployment: dict[str, Any]) -> bool:
    wanted = policy["spec"]["podSelector"].get("matchLabels", {})
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return bool(wanted) and wanted.items() <= labels.items()


def open_ports(policy: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The ports a policy admits from anywhere, and those it admits from Pods of its own
    namespace only (a `from` of podSelectors alone: no namespaceSelector, no ipBlock)."""
    anywhere: set[str] = set()
    namespace: set[str] = set()
    for rule in policy["spec"].get("ingress", []):
        ports = {str(p["port"]) for p in rule["ports"]}
        assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"]), rule
        sources = rule.get("from")
        if not sources:
            anywhere |= ports
        elif all(set(source) == {"podSelector"} for source in sources):
            namespace |= ports
        else:
            raise AssertionError(f"a rule that reaches past the namespace: {rule}")
    return anywhere, namespace


def test_network_policies_keep_every_admin_port_within_the_namespace():
    docs = documents()
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        (policy,) = [p for p in policies if selects(p, deployment)]
        # Selected for ingress: whatever the rules do not name is refused.
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        anywhere, namespace = open_ports(policy)
        named = {
            name
            for entry in deployment["spec"]["template"]["spec"]["containers"]
            for name in container_ports(entry)
        }
        assert anywhere | namespace <= named, "a rule names a port no container has"
        # The public listener from anywhere; the admin listener only from this namespace.
        assert anywhere == {"http"}, deployment["metadata"]["name"]
        assert namespace == {"admin"}, deployment["metadata"]["name"]
        # The Services route the public port only.
        for service in (d for d in docs if d["kind"] == "Service"):
            if (
                service["spec"]["selector"].items()
                <= policy["spec"]["podSelector"]["matchLabels"].items()
            ):
                assert {p["targetPort"] for p in service["spec"]["ports"]} <= anywhere


def test_the_orders_api_port_is_open_to_nothing_but_its_pod():
    _, api, gateway = orders()
    policy = one("NetworkPolicy", "orders")
    anywhere, namespace = open_ports(policy)
    # The API declares no port, listens on loopback, and no rule names its port.
    command = api["command"]
    api_port = command[command.index("--port") + 1]
    assert api_port not in anywhere | namespace
    assert set(container_ports(gateway)) == anywhere | namespace


# ---------------------------------------------------------------------------- the Ingress


def test_the_authserver_is_published_over_tls_at_its_issuers_address():
    ingress = one("Ingress", "authserver")
    spec = ingress["spec"]
    (tls,) = spec["tls"]
    assert tls["secretName"] and tls["hosts"]
    (rule,) = spec["rules"]
    assert rule["host"] in tls["hosts"]  # no host served without its certificate
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    backend = path["backend"]["service"]
    service = one("Service", backend["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == backend["port"]["name"]]
    assert port["targetPort"] == "http"  # the public listener, never the admin one
    # The issuer every token names is that https address, in both programs' environment.
    entry = container(one("Deployment", "authserver"), "authserver")
    issuer = urlsplit(container_env(entry)["PORTCULLIS_ISSUER"])
    assert (issuer.scheme, issuer.hostname, issuer.port, issuer.path) == (
        "https",
        rule["host"],
        None,
        "",
    )
    _, _, gateway = orders()
    assert container_env(gateway)["PORTCULLIS_ISSUER"] == container_env(entry)["PORTCULLIS_ISSUER"]
    # The certificate's Secret is the operator's to make, never a committed manifest.
    assert f"kubectl create secret tls {tls['secretName']} " in (K8S / "README.md").read_text()
    assert not [d for d in documents() if d["kind"] == "Secret"]
