"""`make demo` end to end: the dev issuer, the orders API and the gateway as real processes.

The demo script runs on free ports, in smoke mode (it runs its curl walkthrough, checks every
answer and stops everything) and interactively (until Ctrl-C). Its gateway config is checked
on its own, and so is the development issuer.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest

from examples import dev_issuer
from gateway import rules
from gateway import settings as gateway_settings

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "gateway.yaml"
DEMO = ROOT / "examples" / "demo.sh"
DEV_ISSUER = ROOT / "examples" / "dev_issuer.py"
PORT_VARIABLES = ("DEMO_GATEWAY_PORT", "DEMO_ADMIN_PORT", "DEMO_API_PORT", "DEMO_ISSUER_PORT")

needs_curl = pytest.mark.skipif(
    shutil.which("curl") is None, reason="the demo walks through with curl"
)
slow = pytest.mark.slow  # runs the demo script: three real processes


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
    env.update(extra)
    return env


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def demo_ports() -> dict[str, str]:
    """Four free ports below the ephemeral range.

    The demo binds them a second or two after they are chosen; a port the kernel hands out
    for outgoing connections (as `bind(0)` ports are) may be taken by then on a busy machine.
    """
    high = _ephemeral_floor()
    candidates = random.sample(range(max(1024, high - 10_000), high), 200)
    ports = [p for p in candidates if _bindable(p)][: len(PORT_VARIABLES)]
    assert len(ports) == len(PORT_VARIABLES), "no free ports"
    return dict(zip(PORT_VARIABLES, (str(p) for p in ports), strict=True))


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


# ---------------------------------------------------------------------------- the config


def test_demo_config_passes_gateway_check():
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", "config/gateway.yaml"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "config/gateway.yaml: OK"
    assert result.stderr == ""


def test_demo_config_defaults_to_the_documented_addresses_and_takes_port_overrides():
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
    assert moved.issuers[0].issuer == f"http://127.0.0.1:{ports['DEMO_ISSUER_PORT']}"


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
    assert result.returncode == 0, result.stdout
    assert "FAILED" not in result.stdout
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("demo smoke: all ") and summary.endswith(" answered as expected")
    steps = [line for line in result.stdout.splitlines() if line.startswith("==> ")]
    oks = [line for line in result.stdout.splitlines() if line.startswith("ok: ")]
    assert len(steps) == len(oks) >= 10
    # Statuses the walkthrough promises, each seen at least once; the refusals come from the
    # gateway alone, checked against the API's own access log.
    assert {line.split()[1] for line in oks} >= {"200", "201", "204", "401", "403", "404", "422"}
    stopped = {line.split()[1] for line in oks if line.endswith("(API not reached)")}
    assert stopped == {"401", "403", "404"}
    for port in ports.values():
        assert_closed(port)
    assert list(tmp_path.iterdir()) == [], "a clean run removes its logs"


@slow
@needs_curl
def test_demo_smoke_run_fails_when_the_gateway_lets_through_what_it_should_refuse(tmp_path):
    # The same config, except that creating an order needs only orders:read.
    text = CONFIG.read_text()
    head, marker, tail = text.partition("name: orders-create")
    assert marker
    loosened = tail.replace('{all: ["orders:write"]}', '{all: ["orders:read"]}', 1)
    assert loosened != tail
    config = tmp_path / "loose.yaml"
    config.write_text(head + marker + loosened)
    logs = tmp_path / "tmp"
    logs.mkdir()

    ports = demo_ports()
    result = run_demo(smoke_env(logs, ports, DEMO_CONFIG=str(config)))
    assert result.returncode == 1, result.stdout
    assert "FAILED: expected status 403, got 201" in result.stdout
    assert "FAILED: the API got a request the gateway should have stopped" in result.stdout
    assert "demo smoke: 1 of " in result.stdout
    for port in ports.values():
        assert_closed(port)
    kept = list(logs.iterdir())
    assert len(kept) == 1 and f"logs kept in {kept[0]}" in result.stdout
    assert {p.name for p in kept[0].iterdir()} >= {"issuer.log", "api.log", "gateway.log"}


@slow
@needs_curl
def test_interactive_demo_prints_the_walkthrough_and_stops_everything_on_ctrl_c(tmp_path):
    ports = demo_ports()
    env = clean_env(DEMO_PYTHON=sys.executable, TMPDIR=str(tmp_path), **ports)
    output = tmp_path / "out.txt"
    with output.open("w") as out:
        process = subprocess.Popen(
            ["bash", str(DEMO)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
        process.send_signal(signal.SIGINT)  # to the script alone, which must stop the rest
        assert process.wait(timeout=30) == 0, output.read_text()
        assert not stop_leftovers(process.pid), "the demo left processes running"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert f"GW=http://127.0.0.1:{ports['DEMO_GATEWAY_PORT']}" in text
    assert "READ_TOKEN=$(" in text and "WRITE_TOKEN=$(" in text
    assert 'curl -sS -i "$GW/orders"' in text
    for port in ports.values():
        assert_closed(port)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"], "logs are removed on Ctrl-C"


@slow
@needs_curl
def test_demo_refuses_to_start_when_one_of_its_ports_is_taken(tmp_path):
    ports = demo_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(ports["DEMO_API_PORT"])))
        taken.listen()
        result = run_demo(smoke_env(tmp_path, ports), timeout=30)
    assert result.returncode == 1
    assert f"port {ports['DEMO_API_PORT']} is in use" in result.stdout
    assert "DEMO_API_PORT" in result.stdout
    for name in ("DEMO_GATEWAY_PORT", "DEMO_ISSUER_PORT"):
        assert_closed(ports[name])


# ---------------------------------------------------------------------------- the dev issuer


def mint(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`dev_issuer.py mint ARGS` in this process; the printed token."""
    capsys.readouterr()
    assert dev_issuer.main(["mint", *args]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return out.strip()


def segment(part: str) -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    return decoded


@pytest.fixture
def served_issuer(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    keys = tmp_path / "keys"
    port = int(demo_ports()["DEMO_ISSUER_PORT"])
    process = subprocess.Popen(
        [sys.executable, str(DEV_ISSUER), "serve", "--port", str(port), "--keys", str(keys)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/jwks", timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, process.stdout and process.stdout.read()
                assert time.monotonic() < deadline, "the dev issuer did not start"
                time.sleep(0.05)
        yield url, keys
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout:
            process.stdout.close()


def fetch(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_dev_issuer_keeps_its_private_key_owner_only_and_serves_the_matching_public_key(
    served_issuer, capsys
):
    url, keys = served_issuer
    key_files = list(keys.iterdir())
    assert len(key_files) == 1
    assert stat.S_IMODE(key_files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700

    metadata = fetch(url + "/.well-known/openid-configuration")
    assert metadata["issuer"] == url
    assert metadata["jwks_uri"] == url + "/jwks"
    published = fetch(metadata["jwks_uri"])["keys"]
    assert len(published) == 1
    assert not {"d", "p", "q"} & set(published[0])

    token = mint(
        capsys, "--keys", str(keys), "--issuer", url, "--sub", "alice", "--scope", "orders:read"
    )
    header = segment(token.split(".")[0])
    assert header == {"alg": "ES256", "typ": "at+jwt", "kid": published[0]["kid"]}
    claims = jwt.decode(
        token,
        jwt.PyJWK(published[0]).key,
        algorithms=["ES256"],
        audience="orders-api",
        issuer=url,
    )
    assert set(claims) == {"iss", "sub", "aud", "client_id", "scope", "iat", "exp", "jti"}
    assert (claims["sub"], claims["scope"], claims["aud"]) == ("alice", "orders:read", "orders-api")
    assert claims["exp"] - claims["iat"] == 300


def test_dev_issuer_mint_takes_audiences_lifetime_and_client_id(tmp_path, capsys):
    keys = str(tmp_path / "keys")
    token = mint(
        capsys,
        "--keys", keys,
        "--issuer", "http://127.0.0.1:9999/",
        "--sub", "svc",
        "--scope", "orders:read  orders:write",
        "--aud", "orders-api",
        "--aud", "billing-api",
        "--lifetime", "30s",
        "--client-id", "cli",
    )  # fmt: skip
    claims = segment(token.split(".")[1])
    assert claims["iss"] == "http://127.0.0.1:9999"
    assert claims["aud"] == ["orders-api", "billing-api"]
    assert claims["scope"] == "orders:read orders:write"
    assert claims["client_id"] == "cli"
    assert claims["exp"] - claims["iat"] == 30
    again = mint(capsys, "--keys", keys, "--sub", "svc")
    assert segment(again.split(".")[1])["jti"] != claims["jti"]
    # The key made on first use signs the next token too.
    assert segment(again.split(".")[0])["kid"] == segment(token.split(".")[0])["kid"]


def test_dev_issuer_says_it_is_for_development_only(capsys):
    for args in ([], ["serve"], ["mint"]):
        with pytest.raises(SystemExit) as exit_info:
            dev_issuer.main([*args, "--help"])
        assert exit_info.value.code == 0
        assert "development only" in capsys.readouterr().out.lower()
    assert "development only" in (dev_issuer.__doc__ or "").lower()
