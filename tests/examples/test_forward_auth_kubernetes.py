"""The Kubernetes examples of examples/forward-auth (ingress-nginx, Traefik's CRDs, Istio),
checked without a cluster: the manifests parse and hold the fields their kinds require, each
front proxy asks the endpoint of its own convention on the decision Service, copies every
identity header the gateway answers with, and the gateway configurations pass validation.
The front proxies themselves are run by test_forward_auth_{nginx,traefik,caddy,envoy}.py."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway import settings as gateway_settings
from tests.examples.forward_auth import EXAMPLES, IDENTITY

MANIFESTS = (
    "kubernetes-gateway.yaml",
    "ingress-nginx.yaml",
    "traefik-kubernetes.yaml",
    "istio.yaml",
)
REQUIRED = {
    "Namespace": (),
    "ConfigMap": ("data",),
    "Deployment": ("spec",),
    "Service": ("spec",),
    "Ingress": ("spec",),
    "Middleware": ("spec",),
    "IngressRoute": ("spec",),
    "AuthorizationPolicy": ("spec",),
}
DECISIONS_HOST = "portcullis-ext-authz.portcullis.svc.cluster.local"


def documents() -> list[dict[str, Any]]:
    found = []
    for name in MANIFESTS:
        found += [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d is not None]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def decision_port() -> int:
    config = gateway_settings.load_text(
        one("ConfigMap", "portcullis-ext-authz")["data"]["gateway.yaml"], "configmap.yaml"
    )
    assert config.ext_authz is not None
    return config.ext_authz.listen.port


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_has_the_fields_its_kind_requires(doc: dict[str, Any]) -> None:
    api_version = doc["apiVersion"]
    assert api_version == "v1" or "/" in api_version
    assert doc["kind"] in REQUIRED
    assert doc["metadata"]["name"]
    for field in REQUIRED[doc["kind"]]:
        assert doc.get(field), f"{doc['kind']} needs {field}"


def test_the_gateway_configurations_are_valid_and_serve_decisions() -> None:
    for text, file in (
        (one("ConfigMap", "portcullis-ext-authz")["data"]["gateway.yaml"], "configmap.yaml"),
        ((EXAMPLES / "gateway.yaml").read_text(), "gateway.yaml"),
    ):
        config = gateway_settings.load_text(text, file)
        assert config.ext_authz is not None and config.ext_authz.trusted_callers
    service = one("Service", "portcullis-ext-authz")
    deployment = one("Deployment", "portcullis-ext-authz")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (exposed,) = service["spec"]["ports"]
    assert ports[exposed["targetPort"]] == decision_port()
    assert exposed["port"] == decision_port()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def _asks(url: str, path: str) -> None:
    parts = urlsplit(url)
    assert (parts.hostname, parts.port, parts.path) == (DECISIONS_HOST, decision_port(), path)


def test_ingress_nginx_asks_auth_request_and_copies_every_identity_header() -> None:
    annotations = one("Ingress", "orders-api")["metadata"]["annotations"]
    _asks(annotations["nginx.ingress.kubernetes.io/auth-url"], "/auth-request")
    copied = annotations["nginx.ingress.kubernetes.io/auth-response-headers"].split(",")
    assert copied == list(IDENTITY)


def test_the_traefik_middleware_asks_forward_auth_and_is_used_by_the_route() -> None:
    middleware = one("Middleware", "portcullis")
    forward_auth = middleware["spec"]["forwardAuth"]
    _asks(forward_auth["address"], "/forward-auth")
    assert forward_auth["trustForwardHeader"] is False
    assert forward_auth["authResponseHeaders"] == list(IDENTITY)
    (route,) = one("IngressRoute", "orders-api")["spec"]["routes"]
    assert {"name": "portcullis"} in route["middlewares"]
    # The same middleware as the tested file provider's.
    dynamic = yaml.safe_load((EXAMPLES / "traefik-dynamic.yml").read_text())
    tested = dynamic["http"]["middlewares"]["portcullis"]["forwardAuth"]
    assert tested["authResponseHeaders"] == forward_auth["authResponseHeaders"]


def test_istio_custom_policy_names_a_provider_that_asks_ext_authz() -> None:
    mesh = yaml.safe_load(one("ConfigMap", "istio")["data"]["mesh"])
    providers = {p["name"]: p for p in mesh["extensionProviders"]}
    policy = one("AuthorizationPolicy", "orders-api-portcullis")["spec"]
    assert policy["action"] == "CUSTOM"
    assert policy["rules"]
    provider = providers[policy["provider"]["name"]]["envoyExtAuthzHttp"]
    assert (provider["service"], provider["port"]) == (DECISIONS_HOST, decision_port())
    assert provider["pathPrefix"] == "/ext-authz"
    assert "authorization" in provider["includeRequestHeadersInCheck"]
    assert provider["headersToUpstreamOnAllow"] == [h.lower() for h in IDENTITY]
    assert {"www-authenticate", "retry-after"} <= set(provider["headersToDownstreamOnDeny"])
