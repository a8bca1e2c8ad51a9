"""The classic request-smuggling forms against the gateway, with Debian's nginx as the upstream.

nginx logs every request it parses out of what the gateway sent. Each attack carries a
request of the attacker's (`/admin/smuggled`, with a forged `X-Auth-Subject`) where a server
reading the framing another way would find it, and a victim's request follows on a
connection of its own. Whatever the gateway answers the attack, nginx must log only
requests the gateway admitted, and the victim's with the victim's subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    RawConnection,
    TestIssuer,
    issuer_entry,
    reserve_port,
    running_gateway,
    service_missing,
)

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SMUGGLED = (
    b"GET /admin/smuggled HTTP/1.1\r\nHost: upstream\r\nX-Auth-Subject: admin\r\n"
    b"Content-Length: 0\r\n\r\n"
)
CAPTURING = b"POST /admin/capture HTTP/1.1\r\nHost: upstream\r\nContent-Length: 400\r\n\r\n"
HEAD = b"POST /public/attack HTTP/1.1\r\nHost: gateway.test\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def coded(kind: str, tail: bytes) -> bytes:
    decoded = os.urandom(2048) + b"\r\n" * 1500 + tail
    return gzip.compress(decoded) if kind == "gzip" else zlib.compress(decoded)


def length(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n" % len(body)


GZIP, DEFLATE, GZIP_CAPTURE = (
    coded("gzip", SMUGGLED),
    coded("deflate", SMUGGLED),
    coded("gzip", CAPTURING),
)
# Each: the bytes a client sends on one connection.
CORPUS = {
    "cl-te": HEAD + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-cl": HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n5c\r\n" + SMUGGLED,
    "te-xchunked": HEAD + b"Transfer-Encoding: xchunked\r\nContent-Length: 4\r\n\r\n"
    b"0\r\n\r\n" + SMUGGLED,
    "te-space-before-colon": HEAD + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-tab": HEAD + b"Transfer-Encoding:\tchunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-twice": HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n"
    b"0\r\n\r\n" + SMUGGLED,
    "te-list": HEAD + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-gzip-chunked": HEAD
    + b"Transfer-Encoding: gzip, chunked\r\n\r\n"
    + chunk(GZIP)
    + b"0\r\n\r\n",
    "te-obs-fold": HEAD + b"X-A: a\r\n Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
    b"0\r\n\r\n" + SMUGGLED,
    "te-http10": b"POST /public/attack HTTP/1.0\r\nHost: gateway.test\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "cl-cl": HEAD + b"Content-Length: 4\r\nContent-Length: 0\r\n\r\n" + SMUGGLED,
    "cl-plus": HEAD + b"Content-Length: +4\r\n\r\nabcd" + SMUGGLED,
    "cl-hex": HEAD + b"Content-Length: 0x4\r\n\r\nabcd" + SMUGGLED,
    "cl-list": HEAD + b"Content-Length: 4, 4\r\n\r\nabcd" + SMUGGLED,
    "chunk-size-hex-prefix": HEAD
    + b"Transfer-Encoding: chunked\r\n\r\n0x4\r\nabcd\r\n0\r\n\r\n"
    + SMUGGLED,
    "chunk-lf-only": HEAD + b"Transfer-Encoding: chunked\r\n\r\n4\nabcd\n0\n\n" + SMUGGLED,
    "chunk-size-overflow": HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    b"10000000000000004\r\nabcd\r\n0\r\n\r\n" + SMUGGLED,
    "lf-line-ends": b"POST /public/attack HTTP/1.1\nHost: gateway.test\nContent-Length: 4\n\n"
    b"abcd" + SMUGGLED,
    "body-on-get": b"GET /public/attack HTTP/1.1\r\nHost: gateway.test\r\n"
    + length(SMUGGLED)
    + b"\r\n"
    + SMUGGLED,
    "http-0.9": b"GET /public/attack\r\n\r\n" + SMUGGLED,
    "http-2.0-line": b"GET /public/attack HTTP/2.0\r\nHost: gateway.test\r\n\r\n" + SMUGGLED,
    "gzip-length": HEAD + b"Content-Encoding: gzip\r\n" + length(GZIP) + b"\r\n" + GZIP,
    "deflate-length": HEAD + b"Content-Encoding: deflate\r\n" + length(DEFLATE) + b"\r\n" + DEFLATE,
    "gzip-chunked": HEAD
    + b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunk(GZIP)
    + b"0\r\n\r\n",
    "gzip-capture": HEAD
    + b"Content-Encoding: gzip\r\n"
    + length(GZIP_CAPTURE)
    + b"\r\n"
    + GZIP_CAPTURE,
    "put-gzip": HEAD.replace(b"POST", b"PUT")
    + b"Content-Encoding: gzip\r\n"
    + length(GZIP)
    + b"\r\n"
    + GZIP,
}


@contextlib.contextmanager
def nginx(tmp: Path) -> Iterator[tuple[str, Path]]:
    """nginx on a free loopback port, answering every request itself and logging it."""
    if not Path(NGINX).exists():
        service_missing("nginx is not installed (make test installs Debian's nginx-light as root)")
    port = reserve_port()
    log = tmp / "seen.log"
    for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / name).mkdir()
    (tmp / "nginx.conf").write_text(
        f"""
events {{}}
http {{
    log_format seen escape=json '{{"request":"$request","sub":"$http_x_auth_subject"}}';
    access_log {log} seen;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{ return 200 "$request_uri\\n"; }}
    }}
}}
"""
    )
    globals_ = f"daemon off; master_process off; pid {tmp}/nginx.pid; error_log stderr error;"
    process = subprocess.Popen(
        [NGINX, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", "stderr", "-g", globals_],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        process.terminate()
        process.wait(10)


def logged(log: Path) -> list[dict[str, str]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


async def wait_listening(url: str) -> None:
    for _ in range(200):
        try:
            connection = await RawConnection.open(url)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        connection.close()
        return
    raise TimeoutError("nginx did not start")


@pytest.fixture
async def behind_nginx(tmp_path) -> AsyncIterator[tuple[str, Path, TestIssuer]]:
    issuer = TestIssuer()
    issuer.add_key("ES256")
    await issuer.start()
    with nginx(tmp_path) as (upstream, log):
        await wait_listening(upstream)
        config = f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}", connect_timeout: 1s, read_timeout: 2s, max_connections: 2}}
forward: {{buffer_size: 1KiB}}
issuers:
{issuer_entry(issuer.url)}
routes:
  - {{name: public, path: "/public/**", auth: none}}
  - {{name: mine, path: "/mine/**"}}
"""
        try:
            async with running_gateway(config) as gateway:
                yield gateway.url, log, issuer
        finally:
            await issuer.stop()


@pytest.mark.parametrize("attack", list(CORPUS))
async def test_no_smuggling_form_reaches_nginx_as_a_request_of_its_own(behind_nginx, attack):
    url, log, issuer = behind_nginx
    connection = await RawConnection.open(url)
    statuses = []
    try:
        await connection.send(CORPUS[attack])
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            for _ in range(3):
                statuses.append((await connection.response(timeout=3)).status)
    finally:
        connection.close()
    token = issuer.token(sub="victim")
    # Two victims, so that one meets any upstream connection the attack left behind.
    for n in range(2):
        victim = await RawConnection.open(url)
        try:
            await victim.send(
                f"GET /mine/{n} HTTP/1.1\r\nHost: gateway.test\r\n"
                f"Authorization: Bearer {token}\r\n\r\n".encode()
            )
            answer = await victim.response(timeout=5)
        finally:
            victim.close()
        assert (answer.status, answer.body) == (200, f"/mine/{n}\n".encode())
    await asyncio.sleep(0.05)  # nginx writes its log line as it answers
    seen = logged(log)
    requests = [entry["request"] for entry in seen]
    assert not any("/admin" in r for r in requests), requests
    admitted = statuses.count(200)
    assert requests.count("GET /mine/0 HTTP/1.1") == requests.count("GET /mine/1 HTTP/1.1") == 1
    assert len(requests) == admitted + 2, (statuses, requests)
    assert [e["sub"] for e in seen if e["request"].startswith("GET /mine/")] == ["victim"] * 2
    assert all(e["sub"] == "" for e in seen if not e["request"].startswith("GET /mine/"))
