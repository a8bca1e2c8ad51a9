"""python -m examples.spa --issuer URL --api URL [--client-id demo-spa] [--port 8083]"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from .app import DEFAULT_SCOPE, Config, create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.spa",
        description=(
            "Example single-page app: a public client signing in with the authorization code "
            "flow and PKCE in the browser, calling an API through the gateway with CORS."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8083, help="port to listen on (8083)")
    parser.add_argument("--issuer", required=True, help="the OpenID provider's issuer URL")
    parser.add_argument("--client-id", default="demo-spa", help="this client's id (demo-spa)")
    parser.add_argument("--api", required=True, help="base URL of the API (the gateway)")
    parser.add_argument(
        "--scope", default=DEFAULT_SCOPE, help=f"scopes to ask for ({DEFAULT_SCOPE})"
    )
    parser.add_argument(
        "--public-url",
        help="where browsers reach this app (http://HOST:PORT): PUBLIC_URL/callback must be a "
        "registered redirect URI (the authorization server then allows its origin's pages to "
        "call its token endpoint), and the gateway's CORS policy must allow the origin",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = Config(
        issuer=args.issuer.rstrip("/"),
        client_id=args.client_id,
        api=args.api.rstrip("/"),
        base_url=(args.public_url or f"http://{args.host}:{args.port}").rstrip("/"),
        scope=args.scope,
    )

    def announce(_: str) -> None:
        print(f"example single-page app on {config.base_url}/", flush=True)

    # The app logs each request itself, leaving out query strings (codes, states).
    web.run_app(create_app(config), host=args.host, port=args.port, print=announce, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
