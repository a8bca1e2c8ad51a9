"""python -m examples.web_client --issuer URL --client-id ID --client-secret SECRET --api URL"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web

from .app import DEFAULT_SCOPE, Config, create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.web_client",
        description=(
            "Example web application: signs people in at an OpenID provider (authorization "
            "code flow with PKCE, client_secret_basic) and calls an API with their token."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8082, help="port to listen on (8082)")
    parser.add_argument("--issuer", required=True, help="the OpenID provider's issuer URL")
    parser.add_argument("--client-id", default="demo-web", help="this client's id (demo-web)")
    parser.add_argument(
        "--client-secret",
        default=os.environ.get("WEB_CLIENT_SECRET"),
        help="this client's secret (default: the WEB_CLIENT_SECRET environment variable)",
    )
    parser.add_argument("--api", required=True, help="base URL of the API (the gateway)")
    parser.add_argument(
        "--scope", default=DEFAULT_SCOPE, help=f"scopes to ask for ({DEFAULT_SCOPE})"
    )
    parser.add_argument(
        "--public-url",
        help="where browsers reach this app (http://HOST:PORT); "
        "PUBLIC_URL/callback must be a registered redirect URI",
    )
    args = parser.parse_args(argv)
    if not args.client_secret:
        parser.error("give --client-secret or set WEB_CLIENT_SECRET")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = Config(
        issuer=args.issuer.rstrip("/"),
        client_id=args.client_id,
        client_secret=args.client_secret,
        api=args.api.rstrip("/"),
        base_url=(args.public_url or f"http://{args.host}:{args.port}").rstrip("/"),
        scope=args.scope,
    )

    def announce(_: str) -> None:
        print(f"example web app on {config.base_url}/", flush=True)

    # The app logs each request itself, leaving out query strings (codes, states).
    web.run_app(create_app(config), host=args.host, port=args.port, print=announce, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
