"""The configs the bench writes (bench/configs.sh) are ones the servers accept.

The bench runs rarely; a setting that changes under it would otherwise break it unseen. Each
config is written by the bench's own shell function, with the variables the bench sets, and
checked by `authserver check` (what the function itself runs), without starting any server
or database.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from authserver.settings import encryption_key_bytes
from tests.support import reserve_port

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
