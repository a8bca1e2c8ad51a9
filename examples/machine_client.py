"""An example service calling the orders API on its own behalf (OAuth 2.0 client credentials).

    python examples/machine_client.py --issuer http://127.0.0.1:9000 \\
        --client-id demo-machine --client-secret SECRET --api http://127.0.0.1:8080 \\
        [--scope "orders:read"] [--path /me --path "/orders?limit=5"]

It finds the token endpoint in the issuer's discovery document (RFC 8414 / OIDC Discovery),
asks for an access token with its id and secret in HTTP Basic (RFC 6749 §2.3.1, §4.4), then
calls each path of the API with that token and prints what came back. The secret may come from
the MACHINE_CLIENT_SECRET environment variable instead of the command line, where other users
of the machine could read it. Exit status: 0 when every call answered 2xx, 1 when one did not,
2 when no token was issued.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import quote_plus

import aiohttp

DEFAULT_PATHS = ("/me", "/orders?limit=5")
WELL_KNOWN = ("/.well-known/openid-configuration", "/.well-known/oauth-authorization-server")
TIMEOUT = aiohttp.ClientTimeout(total=10)
MAX_BODY = 1024 * 1024


class TokenRefused(Exception):
    """No access token: the issuer said no, or could not be asked."""


@dataclass(frozen=True)
class AccessToken:
    value: str
    scope: str
    expires_in: int | None


def basic_credentials(client_id: str, client_secret: str) -> str:
    """RFC 6749 §2.3.1: each part form-url-encoded before the Base64, so that a `:` or a
    non-ASCII character in either cannot shift the boundary between them."""
    raw = f"{quote_plus(client_id)}:{quote_plus(client_secret)}".encode()
    return "Basic " + base64.b64encode(raw).decode()


async def _json(response: aiohttp.ClientResponse) -> Any:
    raw = await response.content.read(MAX_BODY)
    try:
        return json.loads(raw)
    except ValueError:
        return None


async def token_endpoint(http: aiohttp.ClientSession, issuer: str) -> str:
    """The token endpoint from discovery; the document must name `issuer` exactly."""
    for well_known in (
        "/.well-known/openid-configuration",
        "/.well-known/oauth-authorization-server",
    ):
        try:
            async with http.get(issuer + well_known, timeout=TIMEOUT) as response:
                if response.status == 404:
                    continue
                document = await _json(response)
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TokenRefused(f"cannot reach {issuer} ({exc.__class__.__name__})") from None
        if status != 200 or not isinstance(document, dict):
            raise TokenRefused(f"{issuer}{well_known} answered {status}")
        if document.get("issuer") != issuer:
            raise TokenRefused(f"the discovery document names issuer {document.get('issuer')!r}")
        endpoint = document.get("token_endpoint")
        if not isinstance(endpoint, str):
            raise TokenRefused("the discovery document has no token_endpoint")
        return endpoint
    raise TokenRefused(f"{issuer} publishes no discovery document")


async def fetch_token(
    http: aiohttp.ClientSession,
    issuer: str,
    client_id: str,
    client_secret: str,
    scope: str | None = None,
) -> AccessToken:
    endpoint = await token_endpoint(http, issuer)
    form = {"grant_type": "client_credentials"}
    if scope:
        form["scope"] = scope
    try:
        async with http.post(
            endpoint,
            data=form,
            headers={"Authorization": basic_credentials(client_id, client_secret)},
            timeout=TIMEOUT,
        ) as response:
            body = await _json(response)
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TokenRefused(f"cannot reach {endpoint} ({exc.__class__.__name__})") from None
    if not isinstance(body, dict):
        raise TokenRefused(f"the token endpoint answered {status} without a JSON object")
    if status != 200:
        # RFC 6749 §5.2: error, and maybe a description meant for the developer.
        error = body.get("error", "unknown_error")
        description = body.get("error_description")
        raise TokenRefused(f"{status} {error}" + (f": {description}" if description else ""))
    token = body.get("access_token")
    token_type = body.get("token_type")
    if not isinstance(token, str) or not isinstance(token_type, str):
        raise TokenRefused("the token response has no access_token or token_type")
    if token_type.lower() != "bearer":
        raise TokenRefused(f"token type {token_type!r} is not Bearer")
    granted = body.get("scope")
    expires_in = body.get("expires_in")
    return AccessToken(
        value=token,
        # RFC 6749 §5.1: no scope in the answer means exactly the scope asked for.
        scope=granted if isinstance(granted, str) else (scope or ""),
        expires_in=expires_in if isinstance(expires_in, int) else None,
    )


async def call(
    http: aiohttp.ClientSession, api: str, path: str, token: AccessToken
) -> tuple[int, Any]:
    """GET api+path with the token; the status and the JSON body (or the text)."""
    async with http.get(
        api + path, headers={"Authorization": f"Bearer {token.value}"}, timeout=TIMEOUT
    ) as response:
        raw = await response.content.read(MAX_BODY)
        body: Any = raw.decode("utf-8", "replace")
        if response.content_type == "application/json":
            with contextlib.suppress(ValueError):
                body = json.loads(raw)
        challenge = response.headers.get("WWW-Authenticate")
        if challenge:
            body = {"WWW-Authenticate": challenge, "body": body}
        return response.status, body


async def run(
    *,
    issuer: str,
    client_id: str,
    client_secret: str,
    api: str,
    scope: str | None = None,
    paths: Sequence[str] = DEFAULT_PATHS,
    out: TextIO = sys.stdout,
) -> int:
    issuer, api = issuer.rstrip("/"), api.rstrip("/")
    async with aiohttp.ClientSession() as http:
        try:
            token = await fetch_token(http, issuer, client_id, client_secret, scope)
        except TokenRefused as exc:
            print(f"no access token: {exc}", file=out)
            return 2
        lifetime = f", expires in {token.expires_in} s" if token.expires_in is not None else ""
        print(f"access token for {client_id}: scope {token.scope!r}{lifetime}", file=out)
        failed = 0
        for path in paths:
            try:
                status, body = await call(http, api, path, token)
            except (aiohttp.ClientError, TimeoutError) as exc:
                print(f"\nGET {path} -> no answer ({exc.__class__.__name__})", file=out)
                failed += 1
                continue
            print(f"\nGET {path} -> {status}", file=out)
            print(json.dumps(body, indent=2, ensure_ascii=False), file=out)
            failed += not 200 <= status < 300
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="machine_client.py",
        description="Get a token with client credentials and call the API through the gateway.",
    )
    parser.add_argument("--issuer", required=True, help="the authorization server's issuer URL")
    parser.add_argument("--client-id", required=True)
    parser.add_argument(
        "--client-secret",
        default=os.environ.get("MACHINE_CLIENT_SECRET"),
        help="the client's secret (default: the MACHINE_CLIENT_SECRET environment variable)",
    )
    parser.add_argument("--api", required=True, help="base URL of the API (the gateway)")
    parser.add_argument("--scope", help="scopes to ask for (default: all the client may have)")
    parser.add_argument(
        "--path",
        action="append",
        dest="paths",
        help=f"a path to GET, repeatable (default: {' and '.join(DEFAULT_PATHS)})",
    )
    args = parser.parse_args(argv)
    if not args.client_secret:
        parser.error("give --client-secret or set MACHINE_CLIENT_SECRET")
    return asyncio.run(
        run(
            issuer=args.issuer,
            client_id=args.client_id,
            client_secret=args.client_secret,
            api=args.api,
            scope=args.scope,
            paths=args.paths or DEFAULT_PATHS,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
