"""The MCP Compose example (examples/compose/compose.mcp.yaml), read as Compose reads it and
held to what the other Compose examples are held to (tests/examples/test_compose.py): the
upstream, here the example MCP server run unchanged, listens on loopback in a namespace it
shares with the gateway alone; only the gateway's and the authorization server's ports are
published; every mounted config exists and passes its program's `check`; the Portcullis
services run the image the README builds, read-only and without capabilities; health
checks ask `/readyz` and `/healthz`; the gateway drains within the stop grace; the state is
in a named volume. Then what makes it the MCP example: the rules of examples/mcp, one
resource URI the gateway and the authorization server agree on, and an MCP server image on
the SDK version the example is tested with.

Last, the three services run as their containers would (each one's command, environment and
mounted config, on this machine's Python, with the container addresses moved to free
loopback ports and the public addresses given through MCP_PUBLIC_URL and
PORTCULLIS_ISSUER, as a user reaching them elsewhere would set them), and the official
Python SDK's client, given the gateway's /mcp URL alone, registers, signs alice in, calls
the tools and steps up for delete_order (tests/e2e/test_mcp_clients.py's user and client).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from authserver import settings as authserver_settings
from gateway import settings as gateway_settings
from portcullis.yamlconf import duration
from tests.deploy import compose
from tests.deploy.dockerfile import ROOT, parse, with_data_volume
from tests.deploy.test_dockerfile import hadolint
from tests.e2e.test_mcp_clients import NATIVE_APP, Browser, Recorder, connected
from tests.examples.test_compose import (
    IMAGE_TAG,
    gateway_config,
    mounted_config,
    published,
    sidecars,
)
from tests.support import reserve_port

MCP_COMPOSE = "compose.mcp.yaml"
DOCKERFILE = compose.COMPOSE_DIR / "mcp-server.Dockerfile"
EXAMPLE = ROOT / "examples" / "mcp"
SERVER_PORT = 8091  # examples/mcp's own default


@pytest.fixture
def model() -> dict[str, Any]:
    """The file as `docker compose -f compose.mcp.yaml up` reads it: no .env needed."""
    return compose.load(MCP_COMPOSE, env={})


def authserver_config(model: dict[str, Any]) -> authserver_settings.Settings:
    service = model["services"]["authserver"]
    return authserver_settings.load(
        str(mounted_config(service, "authserver.yaml")), env=compose.environment(service)
    )


# ---------------------------------------------------------------------------- the sidecar


def test_the_gateway_shares_the_mcp_servers_namespace_and_only_its_port_is_published(model):
    ((server_name, gateway_name),) = sidecars(model)
    assert server_name == "mcp-server"
    server, gateway = model["services"][server_name], model["services"][gateway_name]
    settings = gateway_config(model, gateway_name)
    # The example server unchanged, on loopback: only the gateway, in its namespace, reaches it.
    command = server["command"]
    assert command == ["python", "-m", "examples.mcp", "--host", "127.0.0.1", "--port", "8091"]
    assert settings.upstream.url == f"http://127.0.0.1:{SERVER_PORT}"
    assert [container for _, container in published(server)] == [settings.listen.port]
    assert settings.listen.port != SERVER_PORT
    assert "ports" not in gateway and "expose" not in gateway and "networks" not in gateway
    assert "expose" not in server
    assert settings.admin_listen.host == "127.0.0.1"


def test_the_gateway_and_the_authserver_are_the_only_ways_in(model):
    open_ports = {
        (name, host, container)
        for name, service in model["services"].items()
        for host, container in published(service)
    }
    # What compose.yaml publishes, and nothing more: 8080 and 9000 on the host.
    assert open_ports == {("mcp-server", "8080", 8080), ("authserver", "9000", 9000)}
    base = compose.load(compose.BASE, env={"MACHINE_CLIENT_SECRET": "x" * 32})
    published_by_base = {
        host for service in base["services"].values() for host, _ in published(service)
    }
    assert {host for _, host, _ in open_ports} == published_by_base


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
            assert service["command"] == [f"portcullis-{program}", "run", "--config", target]
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("PORTCULLIS", "MCP"))},
                **compose.environment(service),
                "PYTHONPATH": str(ROOT),
            }
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
    portcullis = 0
    for name, service in model["services"].items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert service.get("security_opt") == ["no-new-privileges:true"], name
        command = service.get("command") or []
        if command[0].startswith("portcullis-"):
            assert service["image"] == IMAGE_TAG, name
            portcullis += 1
    assert portcullis == 2
    raw = compose.raw(MCP_COMPOSE)["services"]
    base = compose.raw(compose.BASE)["services"]
    assert raw["gateway"]["image"] == raw["authserver"]["image"] == base["gateway"]["image"]


def test_the_gateway_drains_before_compose_stops_waiting(model):
    grace = gateway_config(model, "gateway").shutdown_grace
    assert duration(model["services"]["gateway"]["stop_grace_period"]) > grace


def test_health_checks_ask_each_programs_own_endpoint(model):
    image_env = parse()[-1].env()
    default = urlsplit(image_env["PORTCULLIS_HEALTH_URL"])
    gateway = model["services"]["gateway"]
    # The image's default: the gateway's /readyz on its admin port.
    assert "PORTCULLIS_HEALTH_URL" not in compose.environment(gateway)
    admin = gateway_config(model, "gateway").admin_listen
    assert (default.port, default.path) == (admin.port, "/readyz")
    auth = model["services"]["authserver"]
    health = urlsplit(compose.environment(auth)["PORTCULLIS_HEALTH_URL"])
    assert (health.hostname, health.port, health.path) == ("127.0.0.1", 9000, "/healthz")
    assert authserver_config(model).listen.port == 9000
    # The gateway starts once the authorization server is healthy (it needs the keys to be
    # ready), and the MCP server's own check asks its port.
    assert gateway["depends_on"]["authserver"] == {"condition": "service_healthy"}
    server_check = " ".join(model["services"]["mcp-server"]["healthcheck"]["test"])
    assert f"('127.0.0.1', {SERVER_PORT})" in server_check


def test_the_authserver_keeps_its_state_in_a_named_volume(model):
    auth = model["services"]["authserver"]
    source, options = compose.mounts(auth)["/var/lib/portcullis"]
    assert source in model["volumes"] and options == "rw"
    settings = authserver_config(model)
    assert settings.storage == "sqlite:///var/lib/portcullis/authserver.db"
    assert settings.keys.dir == "/var/lib/portcullis/keys"


def test_no_secret_is_needed_and_none_is_written_in_the_file():
    raw = compose.raw(MCP_COMPOSE)
    for service in raw["services"].values():
        for name in compose.environment(service):
            assert "SECRET" not in name and "PASSWORD" not in name, name
    compose.load(MCP_COMPOSE, env={})  # nothing required from .env


# ---------------------------------------------------------------------------- the MCP example


def test_the_gateway_applies_the_rules_of_examples_mcp(model):
    """The same routes, call rules and resource description as `make mcp-demo`'s gateway."""
    settings = gateway_config(model, "gateway")
    example = gateway_settings.load(str(EXAMPLE / "gateway.yaml"), env={})

    def rules(s: gateway_settings.Settings) -> list[Any]:
        """Each route's rules, without the lines they are written on."""
        return [
            (r.name, r.path, r.methods, r.auth, r.scopes)
            + (
                (None,)
                if r.mcp is None
                else (r.mcp.max_message_size, [(c.method, c.name, c.scopes) for c in r.mcp.calls])
            )
            for r in s.routes
        ]

    assert rules(settings) == rules(example)
    assert [(r.path, r.name) for r in settings.resources] == [
        (r.path, r.name) for r in example.resources
    ]
    (mcp_route,) = [r for r in settings.routes if r.mcp is not None]
    assert mcp_route.mcp is not None and mcp_route.mcp.calls


def test_the_gateway_and_the_authserver_agree_on_the_mcp_servers_uri_and_issuer(model):
    gateway = gateway_config(model, "gateway")
    auth = authserver_config(model)
    resource = f"{gateway.public_url}/mcp"
    assert resource == "http://localhost:8080/mcp"  # what the README tells the user to paste
    (issuer,) = gateway.issuers
    assert issuer.issuer == auth.issuer == "http://localhost:9000"
    assert issuer.audiences == (resource,)
    (registered,) = auth.resources
    assert registered.uri == resource
    # Every scope the gateway's rules ask for is one the resource accepts and the consent
    # page can describe.
    (route,) = [r for r in gateway.routes if r.mcp is not None]
    assert route.mcp is not None
    needed = set(route.scopes.scopes) | {s for c in route.mcp.calls for s in c.scopes.scopes}
    assert needed <= set(registered.scopes) <= {s.name for s in auth.scopes}
    assert auth.registration.enabled
    # One variable moves both, for an MCP server reached at another address.
    moved = compose.load(MCP_COMPOSE, env={"MCP_PUBLIC_URL": "https://mcp.example.com"})
    gateway = gateway_config(moved, "gateway")
    assert gateway.public_url == "https://mcp.example.com"
    assert authserver_config(moved).resources[0].uri == "https://mcp.example.com/mcp"


def test_hadolint_finds_nothing_in_the_mcp_servers_dockerfile():
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""
    lint = (ROOT / "Makefile").read_text()
    assert f"examples/compose/{DOCKERFILE.name}" in lint  # `make lint` runs it too


def test_the_mcp_servers_image_runs_the_example_unchanged_on_the_tested_sdk():
    (stage,) = parse(DOCKERFILE)
    assert stage.base == parse()[-1].base, "build on Portcullis's base image, pinned alike"
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", stage.one("USER").args)
    # The SDK version of the `mcp` extra, which the example and its end-to-end tests use.
    pyproject = (ROOT / "pyproject.toml").read_text()
    (extra,) = re.findall(r'^mcp = \["mcp==([^"]+)"\]', pyproject, re.M)
    (pinned,) = re.findall(r"mcp==(\S+)", stage.one("RUN").args)
    assert pinned == extra, "update mcp-server.Dockerfile's pin"
    # The example's own modules, copied as they are, and the command compose.mcp.yaml runs.
    (copied,) = stage.all("COPY")
    *sources, target = copied.args.split()
    assert target == "/srv/examples/mcp/"
    for source in sources:
        assert (ROOT / "examples" / source).is_file(), source
    imported = {"__init__.py", "__main__.py", "server.py"}
    assert {Path(s).name for s in sources} == imported
    assert (
        stage.one("CMD").exec_form()
        == compose.load(MCP_COMPOSE, env={})["services"]["mcp-server"]["command"]
    )
    model = compose.raw(MCP_COMPOSE)
    build = model["services"]["mcp-server"]["build"]
    assert (compose.COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


def test_the_readme_and_the_docs_give_the_commands_and_the_url():
    commands = [
        "docker build -t portcullis .",
        "cd examples/compose && docker compose -f compose.mcp.yaml up -d",
    ]
    header = (compose.COMPOSE_DIR / MCP_COMPOSE).read_text()
    assert all(f"#   {command}" in header for command in commands)
    for path in (compose.COMPOSE_DIR / "README.md", ROOT / "docs" / "mcp.md"):
        text = path.read_text()
        assert all(command in text for command in commands), path
        assert "http://localhost:8080/mcp" in text, path


# ---------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Ports:
    """Free loopback ports for the container addresses."""

    gateway: int
    admin: int
    server: int
    auth: int
    auth_admin: int

    def move(self, text: str) -> str:
        for old, new in (
            ("0.0.0.0:8080", f"127.0.0.1:{self.gateway}"),
            ("127.0.0.1:9901", f"127.0.0.1:{self.admin}"),
            (f"127.0.0.1:{SERVER_PORT}", f"127.0.0.1:{self.server}"),
            ("0.0.0.0:9000", f"127.0.0.1:{self.auth}"),
            ("127.0.0.1:9000", f"127.0.0.1:{self.auth}"),
            ("authserver:9000", f"127.0.0.1:{self.auth}"),
        ):
            text = text.replace(old, new)
        return text


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def wait_until_answers(service: Service, url: str, timeout: float = 30) -> None:
    """Until `url` answers 2xx, as the services' health checks ask."""
    deadline = time.monotonic() + timeout
    while True:
        assert service.process.poll() is None, f"{service.name} exited:\n{service.output()}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"{service.name} never ready:\n{service.output()}"
        time.sleep(0.1)


@contextlib.contextmanager
def services_running(tmp_path: Path) -> Iterator[tuple[Ports, dict[str, Any]]]:
    """The three services, each as its container runs it, on fresh state."""
    ports = Ports(*(reserve_port() for _ in range(5)))
    public = {
        "MCP_PUBLIC_URL": f"http://127.0.0.1:{ports.gateway}",
        "PORTCULLIS_ISSUER": f"http://127.0.0.1:{ports.auth}",
    }
    model = compose.load(MCP_COMPOSE, env=public)
    data = tmp_path / "var-lib-portcullis"
    data.mkdir()
    started: list[Service] = []

    def start(name: str, command: list[str], env: dict[str, str]) -> Service:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append(Service(name, process, log))
        return started[-1]

    def portcullis(name: str) -> Service:
        service = model["services"][name]
        command = list(service["command"])
        command[0] = str(Path(sys.executable).parent / command[0])  # on the image's PATH
        target = command[command.index("--config") + 1]
        source, _ = compose.mounts(service)[target]
        text = ports.move(compose.config_file(source).read_text())
        if name == "authserver":  # its admin listener, which the file leaves at its default
            text += f'\nadmin_listen: "127.0.0.1:{ports.auth_admin}"\n'
        config = tmp_path / f"{name}.yaml"
        config.write_text(text.replace("/var/lib/portcullis", str(data)))
        command[command.index("--config") + 1] = str(config)
        env = {k: ports.move(v) for k, v in compose.environment(service).items()}
        return start(name, command, env)

    try:
        server = model["services"]["mcp-server"]
        command = list(server["command"])
        command[command.index("--port") + 1] = str(ports.server)
        start("mcp-server", [sys.executable, *command[1:]], {})
        auth = portcullis("authserver")
        health = compose.environment(model["services"]["authserver"])["PORTCULLIS_HEALTH_URL"]
        wait_until_answers(auth, ports.move(health))
        gateway = portcullis("gateway")
        # The image's default health check: /readyz on the gateway's admin port.
        wait_until_answers(gateway, f"http://127.0.0.1:{ports.admin}/readyz")
        yield ports, model
    finally:
        for service in reversed(started):
            service.process.terminate()
        for service in started:
            try:
                service.process.wait(20)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()


@pytest.mark.slow
async def test_an_mcp_client_given_the_one_url_signs_in_and_calls_the_tools(tmp_path):
    with services_running(tmp_path) as (ports, _):
        mcp_url = f"http://127.0.0.1:{ports.gateway}/mcp"
        recorder = Recorder()
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            browser = Browser(session)
            async with connected(mcp_url, browser, recorder, NATIVE_APP) as (client, storage):
                whoami = await client.call_tool("whoami", {})
                deleted = await client.call_tool("delete_order", {"order_id": "1001"})
                orders = await client.call_tool("list_orders", {})
    assert not whoami.is_error, whoami
    caller = whoami.structured_content
    assert caller is not None and storage.client_info is not None
    assert caller["subject"] == "alice"
    assert caller["clientId"] == storage.client_info.client_id
    assert caller["tokenReceived"] is False
    # delete_order needed mcp:admin: a 403 naming it, the user asked again, the call made.
    assert [e.status for e in recorder.exchanges].count(403) == 1
    assert len(browser.asked) == 2
    assert "mcp:admin" in browser.asked[1]["scope"].split()
    assert not deleted.is_error, deleted
    assert orders.structured_content is not None
    assert "1001" not in [o["id"] for o in orders.structured_content["result"]]
    # Discovery went to the addresses the two variables gave.
    auth = f"http://127.0.0.1:{ports.auth}"
    assert recorder.exchanges[1].url == (
        f"http://127.0.0.1:{ports.gateway}/.well-known/oauth-protected-resource/mcp"
    )
    assert recorder.exchanges[2].url == f"{auth}/.well-known/oauth-authorization-server"
    assert recorder.exchanges[3].url == f"{auth}/register"
