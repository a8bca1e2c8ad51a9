"""`make demo` end to end: the authorization server, the orders API, the gateway and the
example web app as real processes.

The demo script runs on free ports, in smoke mode (it runs its walkthrough — curl commands,
the machine client and a browser-less sign-in through the web app — checks every answer and
stops everything) and interactively (until Ctrl-C). Both config files are checked on their
own, and against each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from authserver import settings as authserver_settings
from authserver import users
from gateway import settings as gateway_settings
from gateway.core import rules
from tests.support import reserve_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "gateway.yaml"
AUTH_CONFIG = ROOT / "config" / "authserver.yaml"
DEMO = ROOT / "examples" / "demo.sh"
PORT_VARIABLES = (
    "DEMO_GATEWAY_PORT",
    "DEMO_ADMIN_PORT",
    "DEMO_API_PORT",
    "DEMO_AUTH_PORT",
    "DEMO_WEB_PORT",
    "DEMO_SPA_PORT",
    "DEMO_AUTH_ADMIN_PORT",
)
DEMO_PASSWORD = "wonderland"  # alice's, as the walkthrough and README give it

needs_curl = pytest.mark.skipif(
    shutil.which("curl") is None, reason="the demo walks through with curl"
)
slow = pytest.mark.slow  # runs the demo script: four real processes


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
    env.update(extra)
    return env


def demo_ports() -> dict[str, str]:
    """Ports reserved for the demo's processes (`reserve_port`), one per DEMO_*_PORT
    variable: the demo binds them a second or two after they are chosen."""
    return {name: str(reserve_port()) for name in PORT_VARIABLES}


def run_demo(env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    process = subprocess.Popen(
        ["bash", str(DEMO)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"the demo did not finish in {timeout}s:\n{out}")
    assert not stop_leftovers(process.pid), f"the demo left processes running:\n{out}"
    return subprocess.CompletedProcess(process.args, process.returncode, out, None)


def stop_leftovers(group: int) -> bool:
    """Kill what is left of a process group; True when something was."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    os.killpg(group, signal.SIGKILL)
    return True


def assert_closed(port: str) -> None:
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", int(port)))


def smoke_env(tmp_path: Path, ports: dict[str, str], **extra: str) -> dict[str, str]:
    return clean_env(
        DEMO_SMOKE="1", DEMO_PYTHON=sys.executable, TMPDIR=str(tmp_path), **ports, **extra
    )


def script_default(variable: str) -> str:
    """The default demo.sh gives `variable` (`export VAR=${VAR:-default}`)."""
    found = re.search(
        rf"^export {variable}=\$\{{{variable}:-([^}}]+)\}}$", DEMO.read_text(), re.MULTILINE
    )
    assert found, f"demo.sh sets no default for {variable}"
    return found.group(1)


def ok_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("ok: ")]


# ---------------------------------------------------------------------------- the configs


@pytest.mark.parametrize(
    ("module", "path"),
    [("gateway", "config/gateway.yaml"), ("authserver", "config/authserver.yaml")],
)
def test_demo_config_passes_its_check(module, path, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", module, "check", "--config", path],
        cwd=ROOT,
        env=clean_env(DEMO_STATE_DIR=str(tmp_path)),  # as demo.sh sets it
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"{path}: OK"
    assert result.stderr == ""


def test_gateway_config_defaults_to_the_documented_addresses_and_takes_port_overrides():
    default = gateway_settings.load(str(CONFIG), env={})
    assert (default.listen.host, default.listen.port) == ("127.0.0.1", 8080)
    assert (default.admin_listen.host, default.admin_listen.port) == ("127.0.0.1", 9901)
    assert default.upstream.url == "http://127.0.0.1:8081"
    assert [(i.issuer, i.audiences) for i in default.issuers] == [
        ("http://127.0.0.1:9000", ("orders-api",))
    ]
    assert default.unmatched == "deny"

    ports = demo_ports()
    moved = gateway_settings.load(str(CONFIG), env=ports)
    assert moved.listen.port == int(ports["DEMO_GATEWAY_PORT"])
    assert moved.admin_listen.port == int(ports["DEMO_ADMIN_PORT"])
    assert moved.upstream.url == f"http://127.0.0.1:{ports['DEMO_API_PORT']}"
    assert moved.issuers[0].issuer == f"http://127.0.0.1:{ports['DEMO_AUTH_PORT']}"


def test_authserver_config_defaults_to_the_documented_addresses_and_takes_overrides(tmp_path):
    default = authserver_settings.load(str(AUTH_CONFIG), env={})
    assert default.issuer == "http://127.0.0.1:9000"
    assert (default.listen.host, default.listen.port) == ("127.0.0.1", 9000)
    assert (default.admin_listen.host, default.admin_listen.port) == ("127.0.0.1", 9902)
    assert default.storage == "sqlite:///.demo/authserver.db"
    assert default.keys.dir == ".demo/keys"
    assert default.default_audience == "orders-api"
    web = default.client("demo-web")
    assert web is not None
    assert web.redirect_uris == ("http://127.0.0.1:8082/callback",)
    assert web.post_logout_redirect_uris == ("http://127.0.0.1:8082/signed-out",)

    state = tmp_path / "state"
    env = {**demo_ports(), "DEMO_STATE_DIR": str(state)}
    moved = authserver_settings.load(str(AUTH_CONFIG), env=env)
    assert moved.issuer == f"http://127.0.0.1:{env['DEMO_AUTH_PORT']}"
    assert moved.listen.port == int(env["DEMO_AUTH_PORT"])
    assert moved.admin_listen.port == int(env["DEMO_AUTH_ADMIN_PORT"])
    assert moved.storage == f"sqlite:///{state}/authserver.db"
    assert moved.keys.dir == f"{state}/keys"
    web = moved.client("demo-web")
    assert web is not None
    assert web.redirect_uris == (f"http://127.0.0.1:{env['DEMO_WEB_PORT']}/callback",)
    assert web.post_logout_redirect_uris == (f"http://127.0.0.1:{env['DEMO_WEB_PORT']}/signed-out",)


def test_authserver_config_registers_the_demo_clients_as_the_walkthrough_uses_them():
    loaded = authserver_settings.load(str(AUTH_CONFIG), env={})
    clients = {c.client_id: c for c in loaded.clients}
    assert set(clients) == {"demo-machine", "demo-web", "demo-spa", "demo-cli", "gateway"}

    machine = clients["demo-machine"]
    assert machine.token_endpoint_auth_method == "client_secret_basic"
    assert machine.grant_types == ("client_credentials",)
    assert set(machine.scope) == {"orders:read", "orders:write"}
    assert machine.resources == ("billing-api",)  # the walkthrough's token for another API

    web = clients["demo-web"]
    assert web.token_endpoint_auth_method == "client_secret_basic"
    assert not web.public and web.require_pkce
    assert set(web.grant_types) == {"authorization_code", "refresh_token"}
    assert " ".join(web.scope) == "openid profile email offline_access orders:read orders:write"

    spa = clients["demo-spa"]  # examples/spa: a public client in the browser
    assert spa.public and spa.require_pkce
    assert spa.redirect_uris == ("http://127.0.0.1:8083/callback",)
    assert spa.post_logout_redirect_uris == ("http://127.0.0.1:8083/",)
    assert set(spa.grant_types) == {"authorization_code", "refresh_token"}
    assert {"openid", "offline_access", "orders:read"} <= set(spa.scope)

    cli = clients["demo-cli"]  # examples/device_cli.py, as the README runs it
    assert cli.public
    assert "urn:ietf:params:oauth:grant-type:device_code" in cli.grant_types
    assert {"openid", "offline_access", "orders:read"} <= set(cli.scope)

    gateway = clients["gateway"]
    assert gateway.grant_types == ("client_credentials",)
    assert gateway.scope == () and gateway.introspection


@pytest.mark.parametrize(
    ("client_id", "variable"),
    [("demo-machine", "DEMO_MACHINE_SECRET"), ("demo-web", "DEMO_WEB_SECRET")],
)
def test_demo_script_and_authserver_config_default_to_the_same_client_secret(client_id, variable):
    # The script passes its value on to the config; run by hand, the config's own default
    # must be the one the walkthrough prints.
    secret = script_default(variable)
    assert len(secret) >= 32
    loaded = authserver_settings.load(str(AUTH_CONFIG), env={})
    client = loaded.client(client_id)
    assert client is not None
    assert client.client_secret_sha256 == hashlib.sha256(secret.encode()).digest()
    overridden = authserver_settings.load(str(AUTH_CONFIG), env={variable: "x" * 40})
    changed = overridden.client(client_id)
    assert changed is not None
    assert changed.client_secret_sha256 == hashlib.sha256(b"x" * 40).digest()


def test_demo_user_signs_in_with_the_documented_password_only():
    loaded = authserver_settings.load(str(AUTH_CONFIG), env={})
    assert [u.username for u in loaded.users] == ["alice"]
    alice = loaded.users[0]
    # The example API's sample orders belong to "alice": the web app shows them.
    assert alice.subject == "alice"
    assert alice.claims["email"] == "alice@example.com"
    assert alice.claims["name"]
    assert users.verify_password(DEMO_PASSWORD, alice.password_hash)
    assert not users.verify_password(DEMO_PASSWORD.upper(), alice.password_hash)


def test_gateway_trusts_exactly_what_the_authserver_issues():
    gateway = gateway_settings.load(str(CONFIG), env={})
    auth = authserver_settings.load(str(AUTH_CONFIG), env={})
    (trusted,) = gateway.issuers
    assert trusted.issuer == auth.issuer
    assert auth.default_audience in trusted.audiences
    assert auth.keys.access_token_alg in trusted.algorithms
    # Every scope a route asks for is one the authserver can grant some demo client.
    grantable = {scope for client in auth.clients for scope in client.scope}
    asked = {s for r in gateway.routes if r.scopes is not None for s in r.scopes.scopes}
    assert asked and asked - {"profile"} <= grantable


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/healthz", ("health", None)),
        ("GET", "/me", ("me", ("any", {"profile", "orders:read"}))),
        ("GET", "/orders", ("orders-read", ("any", {"orders:read"}))),
        ("GET", "/orders/ord_0001", ("orders-read", ("any", {"orders:read"}))),
        ("POST", "/orders", ("orders-create", ("all", {"orders:write"}))),
        ("PUT", "/orders/ord_0001", ("orders-change", ("all", {"orders:write"}))),
        ("DELETE", "/orders/ord_0001", ("orders-change", ("all", {"orders:write"}))),
        ("POST", "/orders/ord_0001", None),
        ("DELETE", "/orders", None),
        ("PATCH", "/orders/ord_0001", None),
        ("POST", "/healthz", None),
        ("GET", "/admin/users", None),
        ("GET", "/", None),
    ],
)
def test_demo_config_routes_each_request_to_the_intended_rule(method, path, expected):
    loaded = gateway_settings.load(str(CONFIG), env={})
    router = rules.compile_rules(loaded.routes, loaded.issuers)
    rule = router.match(method, rules.split_path(path))
    if expected is None:
        assert rule is None, rule and rule.name
        return
    name, scopes = expected
    assert rule is not None
    assert rule.name == name
    assert rule.public is (scopes is None)
    if scopes is not None:
        assert rule.settings.scopes is not None
        assert (rule.settings.scopes.mode, set(rule.settings.scopes.scopes)) == scopes
        assert dict(rule.audiences_by_issuer) == {"http://127.0.0.1:9000": {"orders-api"}}


# ---------------------------------------------------------------------------- the demo script


@slow
@needs_curl
def test_demo_smoke_run_answers_every_step_as_expected_and_stops_everything(tmp_path):
    ports = demo_ports()
    result = run_demo(smoke_env(tmp_path, ports))
    out = result.stdout
    assert result.returncode == 0, out
    assert "FAILED" not in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("demo smoke: all ") and summary.endswith(" answered as expected")
    steps = [line for line in out.splitlines() if line.startswith("==> ")]
    oks = ok_lines(out)
    assert len(steps) == len(oks) >= 15
    # Statuses the walkthrough promises, each seen at least once; the refusals come from the
    # gateway alone, checked against the API's own access log.
    statuses = {line.split()[1] for line in oks if not line.startswith("ok: exit")}
    assert statuses >= {"200", "201", "204", "400", "401", "403", "404", "422"}
    stopped = {line.split()[1] for line in oks if line.endswith("(API not reached)")}
    assert stopped == {"204", "401", "403", "404"}  # 204: the CORS preflight
    issued = {line.split()[1] for line in oks if line.endswith("(authorization server)")}
    assert issued == {"200", "400", "401"}
    # The token comes from the authorization server, by client_credentials with Basic.
    assert '"token_type":"Bearer"' in out and "invalid_client" in out
    # The machine client and the browser-less sign-in both ran, and reached the API.
    assert oks.count("ok: exit 0") == 2
    assert "GET /orders?limit=5 -> 200" in out
    assert "claims: sub alice, name Alice Liddell, email alice@example.com" in out
    assert "sign-in, API call, refresh and sign-out all worked" in out
    for port in ports.values():
        assert_closed(port)
    assert list(tmp_path.iterdir()) == [], "a clean run removes its logs and its state"


@slow
@needs_curl
def test_demo_smoke_run_fails_on_every_step_that_does_not_answer_as_expected(tmp_path):
    # The gateway config, except that creating an order needs only orders:read.
    text = CONFIG.read_text()
    head, marker, tail = text.partition("name: orders-create")
    assert marker
    loosened = tail.replace('{all: ["orders:write"]}', '{all: ["orders:read"]}', 1)
    assert loosened != tail
    config = tmp_path / "loose.yaml"
    config.write_text(head + marker + loosened)
    # The authserver config, except that the web app may no longer ask for orders:write,
    # which it does ask for: its authorization request is refused and nobody signs in.
    text = AUTH_CONFIG.read_text()
    narrowed = text.replace(
        'scope: "openid profile email offline_access orders:read orders:write"',
        'scope: "openid profile email offline_access orders:read"',
    )
    assert narrowed != text
    auth_config = tmp_path / "authserver.yaml"
    auth_config.write_text(narrowed)
    logs = tmp_path / "tmp"
    logs.mkdir()

    ports = demo_ports()
    env = smoke_env(logs, ports, DEMO_CONFIG=str(config), DEMO_AUTH_CONFIG=str(auth_config))
    result = run_demo(env)
    out = result.stdout
    assert result.returncode == 1, out
    assert "FAILED: expected status 403, got 201" in out
    assert "FAILED: the API got a request the gateway should have stopped" in out
    assert "FAILED: expected exit status 0, got 1" in out
    assert "invalid_scope" in out  # the refusal the web app shows
    assert "demo smoke: 2 of " in out
    assert (
        len(ok_lines(out))
        == len([line for line in out.splitlines() if line.startswith("==> ")]) - 2
    )
    for port in ports.values():
        assert_closed(port)
    kept = list(logs.iterdir())
    assert len(kept) == 1 and f"logs kept in {kept[0]}" in out
    assert {p.name for p in kept[0].iterdir()} >= {
        "authserver.log",
        "api.log",
        "gateway.log",
        "web.log",
        "state",
    }


def _as_from_a_terminal() -> None:
    """In the child, before the script starts: no signal blocked and Ctrl-C's default, as a
    shell in a terminal has them. A process inherits its parent's signal mask, and a test
    process may have SIGINT blocked (some library in it blocks it for a thread and leaves it
    so); bash started that way never sees the Ctrl-C this test sends."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@slow
@needs_curl
def test_interactive_demo_prints_the_walkthrough_and_stops_everything_on_ctrl_c(tmp_path):
    ports = demo_ports()
    state = tmp_path / "state"
    env = clean_env(
        DEMO_PYTHON=sys.executable, TMPDIR=str(tmp_path), DEMO_STATE_DIR=str(state), **ports
    )
    output = tmp_path / "out.txt"
    with output.open("w") as out:
        process = subprocess.Popen(
            ["bash", str(DEMO)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_as_from_a_terminal,
        )
    web = f"http://127.0.0.1:{ports['DEMO_WEB_PORT']}"
    try:
        deadline = time.monotonic() + 60
        while "Press Ctrl-C" not in output.read_text():
            assert process.poll() is None, output.read_text()
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(0.1)
        text = output.read_text()
        # Everything is up while the demo waits.
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['DEMO_ADMIN_PORT']}/readyz") as r:
            assert r.status == 200
        with urllib.request.urlopen(web + "/") as r:
            assert r.status == 200
            assert 'href="/login"' in r.read().decode()
        auth = f"http://127.0.0.1:{ports['DEMO_AUTH_PORT']}"
        with urllib.request.urlopen(auth + "/.well-known/openid-configuration") as r:
            assert r.status == 200
        spa = f"http://127.0.0.1:{ports['DEMO_SPA_PORT']}"
        with urllib.request.urlopen(spa + "/config.json") as r:
            settings = json.load(r)
        assert (settings["clientId"], settings["issuer"]) == ("demo-spa", auth)
        assert settings["api"] == f"http://127.0.0.1:{ports['DEMO_GATEWAY_PORT']}"
        process.send_signal(signal.SIGINT)  # to the script alone, which must stop the rest
        assert process.wait(timeout=30) == 0, output.read_text()
        assert not stop_leftovers(process.pid), "the demo left processes running"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert f"Open {web}/ in a browser and sign in as alice, password {DEMO_PASSWORD}" in text
    assert f"{spa}/ does the same from the browser itself" in text
    assert f"GW=http://127.0.0.1:{ports['DEMO_GATEWAY_PORT']}" in text
    assert f"AUTH={auth}" in text
    assert "READ_TOKEN=$(token -d scope=orders:read)" in text
    assert "WRITE_TOKEN=$(" in text and "OTHER_API_TOKEN=$(" in text
    assert 'curl -sS -i "$GW/orders"' in text
    assert 'examples/machine_client.py" --issuer "$AUTH" --client-id demo-machine' in text
    for port in ports.values():
        assert_closed(port)
    assert {p.name for p in tmp_path.iterdir()} == {"out.txt", "state"}, (
        "logs are removed on Ctrl-C"
    )
    # A state directory the caller names is kept: the database and the signing keys.
    assert (state / "authserver.db").is_file()
    assert any((state / "keys").iterdir())


@slow
@needs_curl
def test_demo_refuses_to_start_when_one_of_its_ports_is_taken(tmp_path):
    ports = demo_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(ports["DEMO_AUTH_PORT"])))
        taken.listen()
        result = run_demo(smoke_env(tmp_path, ports), timeout=30)
    assert result.returncode == 1
    assert f"port {ports['DEMO_AUTH_PORT']} is in use" in result.stdout
    assert "DEMO_AUTH_PORT" in result.stdout
    for name in ("DEMO_GATEWAY_PORT", "DEMO_API_PORT", "DEMO_WEB_PORT"):
        assert_closed(ports[name])
