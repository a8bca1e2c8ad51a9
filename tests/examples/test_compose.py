"""The Compose example (examples/compose), read as Compose reads it, checked for what makes
it the sidecar pattern: the API listens on loopback in a network namespace it shares with the
gateway alone, only the gateway's port is published, every config file mounted exists and
passes its program's `check`, health checks ask each program's /readyz, every container has
CPU and memory limits (the gateway's above its worst case), and secrets come from the
environment.

tests/deploy/test_image.py runs the same commands, environment and config files.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from authserver import settings as authserver_settings
from gateway import settings as gateway_settings
from gateway.memory import worst_case
from portcullis.yamlconf import duration
from tests.deploy import compose
from tests.deploy.dockerfile import ROOT, parse, with_data_volume

SECRET = "compose-test-machine-secret-0123456789abcdef"
KEY_SECRET = base64.b64encode(bytes(range(32))).decode()
ENV = {  # what .env provides
    "MACHINE_CLIENT_SECRET": SECRET,
    "POSTGRES_PASSWORD": "compose-test-database-password",
    "PORTCULLIS_KEY_SECRET": KEY_SECRET,
}
SCENARIOS = {
    "sidecar": (compose.BASE,),
    "scaled": (compose.BASE, compose.SCALED),
    "replicated": (compose.BASE, compose.REPLICATED),
}
IMAGE_TAG = "portcullis"  # README: docker build -t portcullis .


@pytest.fixture(params=list(SCENARIOS))
def model(request: pytest.FixtureRequest) -> dict[str, Any]:
    return compose.load(*SCENARIOS[request.param], env=ENV)


def sidecars(model: dict[str, Any]) -> list[tuple[str, str]]:
    """(api service, gateway service) for each gateway joining another service's namespace."""
    pairs = []
    for name, service in model["services"].items():
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            pairs.append((mode.removeprefix("service:"), name))
    return pairs


def published(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host port, container port) of each `ports` entry."""
    found = []
    for entry in service.get("ports") or []:
        host, _, container = str(entry).rpartition(":")
        found.append((host, int(container)))
    return found


def mounted_config(service: dict[str, Any], name: str) -> Path:
    source, options = compose.mounts(service)[f"/etc/portcullis/{name}"]
    assert options == "ro", f"{name} is mounted writable"
    return compose.config_file(source)


def gateway_config(model: dict[str, Any], name: str) -> gateway_settings.Settings:
    service = model["services"][name]
    return gateway_settings.load(
        str(mounted_config(service, "gateway.yaml")), env=compose.environment(service)
    )


def api_address(service: dict[str, Any]) -> tuple[str, int]:
    command = service["command"]
    assert command[:3] == ["python", "-m", "examples.legacy_api"]
    return command[command.index("--host") + 1], int(command[command.index("--port") + 1])


# ---------------------------------------------------------------------------- the sidecar


def test_each_gateway_shares_its_apis_namespace_and_only_its_port_is_published(model):
    pairs = sidecars(model)
    assert len(pairs) == (2 if "gateway-2" in model["services"] else 1)
    for api_name, gateway_name in pairs:
        api, gateway = model["services"][api_name], model["services"][gateway_name]
        settings = gateway_config(model, gateway_name)
        host, port = api_address(api)
        # The API listens on loopback: only processes of its namespace (the gateway) reach it.
        assert host == "127.0.0.1"
        assert settings.upstream.url == f"http://127.0.0.1:{port}"
        # The pair's one published port is the gateway's listener.
        assert [container for _, container in published(api)] == [settings.listen.port]
        assert settings.listen.port != port
        # A service in another's namespace cannot publish ports of its own.
        assert "ports" not in gateway and "expose" not in gateway and "networks" not in gateway
        assert "expose" not in api
        # The admin listener stays inside the namespace.
        assert settings.admin_listen.host == "127.0.0.1"


def test_the_gateways_are_the_only_way_in(model):
    api_ports = {api_address(model["services"][a])[1] for a, _ in sidecars(model)}
    gateway_ports = {gateway_config(model, g).listen.port for _, g in sidecars(model)}
    open_ports = set()
    for name, service in model["services"].items():
        for _, container in published(service):
            assert container not in api_ports, f"{name} publishes the API's port"
            open_ports.add((name, container))
    apis = {a for a, _ in sidecars(model)}
    expected = {(api, port) for api in apis for port in gateway_ports}
    assert {(n, p) for n, p in open_ports if n in apis} == expected
    # Besides the gateways, only the authorization server (browsers sign in there).
    assert {n for n, _ in open_ports} - apis == set(authservers(model))


def authservers(model: dict[str, Any]) -> list[str]:
    return [
        name
        for name, service in model["services"].items()
        if (service.get("command") or [""])[0] == "portcullis-authserver"
    ]


def authserver_config(model: dict[str, Any], name: str) -> authserver_settings.Settings:
    service = model["services"][name]
    return authserver_settings.load(
        str(mounted_config(service, "authserver.yaml")), env=compose.environment(service)
    )


def test_every_mounted_config_exists_and_passes_its_programs_check(model, tmp_path):
    checked = set()
    for name, service in model["services"].items():
        for target, (source, _) in compose.mounts(service).items():
            if not target.startswith("/etc/portcullis/"):
                continue
            path = compose.config_file(source)
            assert path.is_file(), f"{name} mounts {source}, which does not exist"
            program = {"gateway.yaml": "gateway", "authserver.yaml": "authserver"}[
                Path(target).name
            ]
            assert service["command"][:2] == [f"portcullis-{program}", "run"]
            assert service["command"][2:] == ["--config", target]
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("PORTCULLIS")},
                **compose.environment(service),
                "PYTHONPATH": str(ROOT),
            }
            # Checked as the container runs it: its data volume is there (a temporary
            # directory standing in for /var/lib/portcullis, which `check` requires).
            mounted = tmp_path / name / path.name
            mounted.parent.mkdir(parents=True, exist_ok=True)
            mounted.write_text(with_data_volume(path.read_text(), tmp_path))
            result = subprocess.run(
                [sys.executable, "-m", program, "check", "--config", str(mounted)],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, f"{name}: {result.stderr}"
            checked.add(program)
    assert checked == {"gateway", "authserver"}


def test_every_portcullis_service_runs_the_image_the_readme_builds(model):
    for name, service in model["services"].items():
        command = service.get("command") or []
        if command and command[0].startswith("portcullis-"):
            assert service["image"] == IMAGE_TAG, name
            assert service.get("read_only") is True, name
            assert service.get("cap_drop") == ["ALL"], name


def test_the_gateway_drains_before_compose_stops_waiting(model):
    for _, gateway_name in sidecars(model):
        grace = gateway_config(model, gateway_name).shutdown_grace
        stop_period = duration(model["services"][gateway_name]["stop_grace_period"])
        assert stop_period > grace  # otherwise SIGKILL cuts in-flight requests


def test_health_checks_ask_each_programs_own_endpoint(model):
    image_env = parse()[-1].env()
    default = urlsplit(image_env["PORTCULLIS_HEALTH_URL"])
    for _, gateway_name in sidecars(model):
        # The image's default: the gateway's /readyz on its admin port.
        assert "PORTCULLIS_HEALTH_URL" not in compose.environment(model["services"][gateway_name])
        admin = gateway_config(model, gateway_name).admin_listen
        assert (default.port, default.path) == (admin.port, "/readyz")
    for name in authservers(model):
        # The authorization server's readiness: its admin listener, never published.
        admin = authserver_config(model, name).admin_listen
        health = urlsplit(compose.environment(model["services"][name])["PORTCULLIS_HEALTH_URL"])
        assert (health.hostname, health.port, health.path) == (admin.host, admin.port, "/readyz")
        assert admin.host == "127.0.0.1"
        assert admin.port not in [port for _, port in published(model["services"][name])]
    assert published(model["services"]["authserver"]) == [("9000", 9000)]


MEMORY_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def memory_bytes(text: str) -> int:
    """A Compose byte value: digits and a unit (b, k, m, g, of either case, `mb` for `m`)."""
    found = re.fullmatch(r"(\d+)([bkmg]?)b?", text.lower())
    assert found is not None, f"not a Compose byte value: {text!r}"
    return int(found.group(1)) * MEMORY_UNITS[found.group(2)]


def test_memory_values_are_read_as_compose_reads_them():
    assert memory_bytes("640M") == memory_bytes("640m") == memory_bytes("640mb") == 640 << 20
    assert memory_bytes("1G") == 1 << 30 and memory_bytes("512") == 512


def test_every_container_has_cpu_and_memory_limits(model):
    for name, service in model["services"].items():
        limits = service["deploy"]["resources"]["limits"]
        assert set(limits) == {"cpus", "memory"}, name
        assert 0 < float(limits["cpus"]) <= 2, name
        assert memory_bytes(limits["memory"]) >= 128 << 20, name


def test_each_gateways_memory_limit_covers_its_worst_case(model):
    for _, gateway_name in sidecars(model):
        limits = model["services"][gateway_name]["deploy"]["resources"]["limits"]
        limit = memory_bytes(limits["memory"])
        worst = worst_case(gateway_config(model, gateway_name))
        assert worst.total <= limit, f"{gateway_name}: {limit} < {worst}"


def test_the_authserver_keeps_its_state_in_a_named_volume():
    model = compose.load(compose.BASE, env=ENV)
    auth = model["services"]["authserver"]
    source, options = compose.mounts(auth)["/var/lib/portcullis"]
    assert source in model["volumes"] and options == "rw"
    text = mounted_config(auth, "authserver.yaml").read_text()
    assert 'storage: "sqlite:///var/lib/portcullis/authserver.db"' in text
    assert "dir: /var/lib/portcullis/keys" in text


def test_secrets_come_only_from_the_environment_and_are_required():
    raw = compose.raw(compose.BASE, compose.SCALED, compose.REPLICATED)
    secrets = set()
    for service in raw["services"].values():
        for name, value in compose.environment(service).items():
            if "SECRET" in name or "PASSWORD" in name:
                assert value.startswith(f"${{{name}:?"), f"{name} must come from .env"
                secrets.add(name)
    assert secrets == {"MACHINE_CLIENT_SECRET", "POSTGRES_PASSWORD", "PORTCULLIS_KEY_SECRET"}
    with pytest.raises(compose.Unset, match="MACHINE_CLIENT_SECRET"):
        compose.load(compose.BASE, env={})
    for missing in ("POSTGRES_PASSWORD", "PORTCULLIS_KEY_SECRET"):
        without = {k: v for k, v in ENV.items() if k != missing}
        compose.load(compose.BASE, compose.SCALED, env=without)  # only the replicas need it
        with pytest.raises(compose.Unset, match=missing):
            compose.load(compose.BASE, compose.REPLICATED, env=without)
    example = (compose.COMPOSE_DIR / ".env.example").read_text()
    assert "MACHINE_CLIENT_SECRET=\n" in example  # no value to copy by mistake
    assert "# POSTGRES_PASSWORD=\n" in example and "# PORTCULLIS_KEY_SECRET=\n" in example
    assert (compose.COMPOSE_DIR / ".gitignore").read_text().split() == [".env"]


def test_the_scaled_setup_shares_rate_limits_through_its_redis():
    base = compose.load(compose.BASE, env=ENV)
    assert gateway_config(base, "gateway").rate_limits.backend == "memory"
    scaled = compose.load(compose.BASE, compose.SCALED, env=ENV)
    redis = scaled["services"]["redis"]
    assert "ports" not in redis
    backends = set()
    for _, gateway_name in sidecars(scaled):
        settings = gateway_config(scaled, gateway_name)
        backends.add(settings.rate_limits.backend)
        assert "redis" in scaled["services"][gateway_name]["depends_on"]
    (backend,) = backends
    assert urlsplit(backend).hostname == "redis"
    # The authorization server stays one: its SQLite store is not shared.
    assert "authserver-2" not in scaled["services"]
    readme = (compose.COMPOSE_DIR / "README.md").read_text()
    assert "PostgreSQL" in readme


def test_the_three_commands_are_the_same_wherever_they_are_given():
    commands = [
        "docker build -t portcullis .",
        'cd examples/compose && echo "MACHINE_CLIENT_SECRET=$(openssl rand -hex 32)" > .env',
        "docker compose up -d",
    ]
    for path in (ROOT / "README.md", compose.COMPOSE_DIR / "README.md"):
        text = path.read_text()
        assert all(command in text for command in commands), path
    header = (compose.COMPOSE_DIR / compose.BASE).read_text()
    assert all(f"#   {command}" in header for command in commands)
    # The tag those commands build is the image the services run.
    assert f"-t {IMAGE_TAG} ." in commands[0]


def test_the_replicated_setup_runs_two_authservers_on_one_postgresql_with_sealed_keys():
    model = compose.load(compose.BASE, compose.REPLICATED, env=ENV)
    names = authservers(model)
    assert names == ["authserver", "authserver-2"]
    settings = [authserver_config(model, name) for name in names]
    # One service: one issuer, one database, one key secret.
    assert len({s.issuer for s in settings}) == 1
    assert len({s.storage for s in settings}) == 1
    storage = urlsplit(settings[0].storage)
    assert (storage.scheme, storage.hostname, storage.password) == (
        "postgresql",
        "postgres",
        ENV["POSTGRES_PASSWORD"],
    )
    for each in settings:
        assert each.keys.dir is None and each.keys.encryption_key == KEY_SECRET
        assert each.keys.reload_every <= each.keys.jwks_max_age
        # replicas × max_size within PostgreSQL's default max_connections (100)
        assert len(settings) * each.storage_pool.max_size < 100
    postgres = model["services"]["postgres"]
    assert "ports" not in postgres
    assert compose.environment(postgres)["POSTGRES_PASSWORD"] == ENV["POSTGRES_PASSWORD"]
    for name in names:
        service = model["services"][name]
        assert service["depends_on"]["postgres"] == {"condition": "service_healthy"}
        assert service["image"] == IMAGE_TAG and service.get("read_only") is True
    # Each replica answers on a port of its own, for the load balancer in front of both.
    assert [published(model["services"][n]) for n in names] == [
        [("9000", 9000)],
        [("9001", 9000)],
    ]
    readme = (compose.COMPOSE_DIR / "README.md").read_text()
    assert "docker compose -f compose.yaml -f compose.replicated.yaml up -d" in readme
    assert "PORTCULLIS_KEY_SECRET" in readme
