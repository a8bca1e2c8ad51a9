"""nginx with auth_request in front of an API, run with examples/forward-auth/nginx.conf as
committed: the gateway's decisions at the client, with the gateway's statuses and challenges
restored by the example's error_page, and 500 when the gateway cannot be reached."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.examples.forward_auth import (
    EXAMPLES,
    FrontProxy,
    decisions,
    enforces_the_decisions,
    fails_closed,
    fill,
    host_port,
    refuses_untrusted_callers,
    reserve_port,
    running,
)
from tests.support import refusing_port, service_missing

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def nginx(tmp: Path, decisions_at: str, upstream_url: str) -> FrontProxy:
    if not Path(NGINX).exists():
        service_missing("nginx is not installed (make test installs Debian's nginx-light as root)")
    port = reserve_port()
    conf = tmp / "nginx.conf"
    conf.write_text(
        fill(
            (EXAMPLES / "nginx.conf").read_text(),
            {
                "LISTEN": f"127.0.0.1:{port}",
                "PORTCULLIS_EXT_AUTHZ": decisions_at,
                "API_UPSTREAM": host_port(upstream_url),
            },
        )
    )
    globals_ = f"daemon off; master_process off; pid {tmp}/nginx.pid; error_log stderr warn;"
    return FrontProxy(
        [NGINX, "-p", str(tmp), "-c", str(conf), "-e", "stderr", "-g", globals_],
        port,
    )


async def test_nginx_enforces_the_gateway_decisions(issuer, upstream, client, tmp_path):
    async with decisions(issuer, upstream) as gw:
        proxy = nginx(tmp_path, host_port(gw.decision_url), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await enforces_the_decisions(proxy, issuer, upstream, client)


async def test_nginx_is_refused_by_a_gateway_that_does_not_trust_it(
    issuer, upstream, client, tmp_path
):
    async with decisions(issuer, upstream, trusted="10.0.0.0/8") as gw:
        proxy = nginx(tmp_path, host_port(gw.decision_url), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            # The gateway's 403 untrusted_caller is passed on as a 403.
            await refuses_untrusted_callers(proxy, gw, issuer, upstream, client, 403)


async def test_nginx_fails_closed_without_the_gateway(issuer, upstream, client, tmp_path):
    with refusing_port() as port:
        proxy = nginx(tmp_path, f"127.0.0.1:{port}", upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await fails_closed(proxy, issuer, upstream, client, 500)
