"""`make test` beside a running `make demo`: the demo listens on the fixed ports its two
config files name, and no server a test starts takes one of them. With every one of those
ports held, the servers the tests start (an authorization server, an upstream, a gateway
in front of it) come up elsewhere and work together."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from authserver import settings as authserver_settings
from gateway import settings as gateway_settings
from tests.authserver.conftest import client_credentials
from tests.support import EchoUpstream, gateway_yaml, running_gateway

ROOT = Path(__file__).resolve().parents[2]


def demo_ports() -> set[int]:
    """What the demo binds on 127.0.0.1 with its defaults (no DEMO_* variable set): both
    programs' listeners, the orders API behind the gateway, and the web app and single-page
    app that the authorization server's demo clients redirect to."""
    gateway = gateway_settings.load(str(ROOT / "config" / "gateway.yaml"), env={})
    authserver = authserver_settings.load(str(ROOT / "config" / "authserver.yaml"), env={})
    ports = {
        gateway.listen.port,
        gateway.admin_listen.port,
        authserver.listen.port,
        authserver.admin_listen.port,
    }
    ports.add(urlsplit(gateway.upstream.url).port or 80)
    for client_id in ("demo-web", "demo-spa"):
        client = authserver.client(client_id)
        assert client is not None, client_id
        ports.update(urlsplit(uri).port or 80 for uri in client.redirect_uris)
    return ports


@contextlib.contextmanager
def held(ports: set[int]) -> Iterator[None]:
    """Each port listened on at 127.0.0.1, as the demo's servers do, for the whole block; a
    port something already listens on (the demo itself, say) is held as it is."""
    with contextlib.ExitStack() as stack:
        for port in sorted(ports):
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as error:
                assert error.errno == errno.EADDRINUSE, error
                continue
            sock.listen()
        yield


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


async def test_the_servers_tests_start_come_up_beside_the_demo_on_ports_of_their_own(
    start_authserver, http
):
    ports = demo_ports()
    assert ports == {8080, 8081, 8082, 8083, 9000, 9901, 9902}  # as the README gives them
    with held(ports):
        server = await start_authserver()
        upstream = await EchoUpstream().start()
        try:
            # Ready only once it holds the authorization server's keys.
            async with running_gateway(gateway_yaml(server.url, upstream.url)) as gateway:
                listening = {
                    "authorization server": port_of(server.url),
                    # Bound by the tests that run it as a program (its own process).
                    "authorization server's admin": server.settings.admin_listen.port,
                    "upstream": port_of(upstream.url),
                    "gateway": port_of(gateway.url),
                    "gateway's admin": port_of(gateway.admin_url),
                }
                taken = {name: port for name, port in listening.items() if port in ports}
                assert taken == {}, f"on the demo's ports: {taken}"

                status, body = await client_credentials(http, server, scope="orders:read")
                assert status == 200, body
                headers = {"Authorization": f"Bearer {body['access_token']}"}
                async with http.get(gateway.url + "/orders/1", headers=headers) as answer:
                    assert answer.status == 200
                assert upstream.requests[-1]["raw_path"] == "/orders/1"
        finally:
            await upstream.stop()
