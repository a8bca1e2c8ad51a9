"""A command-line client that signs a person in with the device authorization grant (RFC 8628).

    python examples/device_cli.py --issuer http://127.0.0.1:9000 --client-id demo-cli \\
        [--scope "openid profile offline_access orders:read"] [--qr auto|always|never] [--json]

A terminal cannot take a browser redirect, so the client asks the authorization server for a
pair of codes, shows the person a short code and where to enter it (on their phone or
laptop), and polls the token endpoint until they approve or deny:

1. discovery (RFC 8414 / OIDC Discovery): device_authorization_endpoint, token_endpoint,
   jwks_uri; the document must name the issuer exactly;
2. POST device_authorization_endpoint (§3.1): the user code, the verification URI, how long
   the codes live and how often it may poll;
3. prints the URI and the code, and a QR code of `verification_uri_complete` when the
   optional `segno` package is installed (pure Python, no dependencies) and the output is a
   terminal (`--qr always` prints it anyway);
4. polls politely (§3.5): waits `interval` before every poll, adds 5 seconds for good on
   `slow_down`, backs off exponentially when the server cannot be reached, and stops at the
   codes' expiry, on `access_denied` or on `expired_token`;
5. verifies the tokens' signatures against the issuer's JWKS and prints their claims. The
   refresh token is never printed.

A confidential client gives its secret with --client-secret or DEVICE_CLIENT_SECRET (sent
with HTTP Basic); a public one gives only its id. Exit status: 0 signed in, 1 denied,
2 expired, 3 any other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import quote_plus

import aiohttp
import jwt

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
WELL_KNOWN = ("/.well-known/openid-configuration", "/.well-known/oauth-authorization-server")
TIMEOUT = aiohttp.ClientTimeout(total=10)
MAX_BODY = 1024 * 1024
SLOW_DOWN_STEP = 5.0  # seconds (RFC 8628 §3.5)
DEFAULT_INTERVAL = 5.0  # seconds, when the server names none (§3.2)
MAX_BACKOFF = 60.0  # seconds between polls while the server cannot be reached

EXIT_OK, EXIT_DENIED, EXIT_EXPIRED, EXIT_FAILED = 0, 1, 2, 3


class Failed(Exception):
    """The flow cannot go on; the message says why."""


class PollEnded(Exception):
    """Polling stopped without tokens; `status` is the exit status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoints:
    device_authorization: str
    token: str
    jwks_uri: str | None


def basic_credentials(client_id: str, client_secret: str) -> str:
    """RFC 6749 §2.3.1: each part form-url-encoded before the Base64."""
    raw = f"{quote_plus(client_id)}:{quote_plus(client_secret)}".encode()
    return "Basic " + base64.b64encode(raw).decode()


async def _json(response: aiohttp.ClientResponse) -> Any:
    raw = await response.content.read(MAX_BODY)
    try:
        return json.loads(raw)
    except ValueError:
        return None


async def discover(http: aiohttp.ClientSession, issuer: str) -> Endpoints:
    for well_known in WELL_KNOWN:
        try:
            async with http.get(issuer + well_known, timeout=TIMEOUT) as response:
                if response.status == 404:
                    continue
                status, document = response.status, await _json(response)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Failed(f"cannot reach {issuer} ({exc.__class__.__name__})") from None
        if status != 200 or not isinstance(document, dict):
            raise Failed(f"{issuer}{well_known} answered {status}")
        if document.get("issuer") != issuer:
            raise Failed(f"the discovery document names issuer {document.get('issuer')!r}")
        device = document.get("device_authorization_endpoint")
        token = document.get("token_endpoint")
        if not isinstance(device, str) or not isinstance(token, str):
            raise Failed(f"{issuer} does not offer the device authorization grant")
        jwks_uri = document.get("jwks_uri")
        return Endpoints(device, token, jwks_uri if isinstance(jwks_uri, str) else None)
    raise Failed(f"{issuer} publishes no discovery document")


def _error_text(status: int, body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        description = body.get("error_description")
        return f"{status} {body['error']}" + (f": {description}" if description else "")
    return f"{status} without an OAuth error body"


class Client:
    def __init__(
        self, http: aiohttp.ClientSession, client_id: str, client_secret: str | None
    ) -> None:
        self.http = http
        self.client_id = client_id
        self.client_secret = client_secret

    async def post(self, url: str, form: dict[str, str]) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if self.client_secret:
            headers["Authorization"] = basic_credentials(self.client_id, self.client_secret)
        else:
            form = {**form, "client_id": self.client_id}  # a public client (RFC 8628 §3.1)
        async with self.http.post(url, data=form, headers=headers, timeout=TIMEOUT) as response:
            return response.status, await _json(response)


def show_qr(uri: str, out: TextIO) -> bool:
    """A QR code of `uri` drawn with block characters; False when segno is not installed."""
    try:
        import segno
    except ImportError:
        return False
    segno.make(uri, error="l").terminal(out=out, compact=True)
    return True


async def poll(
    client: Client,
    endpoints: Endpoints,
    device_code: str,
    interval: float,
    deadline: float,
    log: TextIO,
) -> dict[str, Any]:
    """Poll until the person decides: the token response, or PollEnded."""
    wait = interval
    while True:
        if time.monotonic() + wait >= deadline:
            raise PollEnded(EXIT_EXPIRED, "the code expired before it was approved")
        await asyncio.sleep(wait)
        try:
            status, body = await client.post(
                endpoints.token, {"grant_type": GRANT_TYPE, "device_code": device_code}
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            # §3.5: back off exponentially while the server cannot be reached.
            wait = min(max(wait, interval) * 2, MAX_BACKOFF)
            print(f"no answer ({exc.__class__.__name__}); next try in {wait:g} s", file=log)
            continue
        wait = interval
        if status == 200 and isinstance(body, dict):
            return body
        error = body.get("error") if isinstance(body, dict) else None
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += SLOW_DOWN_STEP
            wait = interval
            print(f"the server asked to slow down: polling every {interval:g} s", file=log)
            continue
        if error == "access_denied":
            raise PollEnded(EXIT_DENIED, "the request was denied")
        if error == "expired_token":
            raise PollEnded(EXIT_EXPIRED, "the code expired before it was approved")
        raise PollEnded(EXIT_FAILED, f"the token endpoint answered {_error_text(status, body)}")


async def verified_claims(
    http: aiohttp.ClientSession, jwks_uri: str | None, token: str, issuer: str, **checks: Any
) -> dict[str, Any]:
    """The token's claims once its signature checks out against the issuer's published keys."""
    if jwks_uri is None:
        raise Failed("the issuer publishes no jwks_uri: the tokens cannot be verified")
    async with http.get(jwks_uri, timeout=TIMEOUT) as response:
        document = await _json(response)
    header = jwt.get_unverified_header(token)
    keys = [k for k in (document or {}).get("keys", []) if k.get("kid") == header.get("kid")]
    if len(keys) != 1:
        raise Failed(f"the issuer publishes no key {header.get('kid')!r}")
    key = jwt.PyJWK(keys[0])
    claims: dict[str, Any] = jwt.decode(
        token, key.key, algorithms=[keys[0]["alg"]], issuer=issuer, **checks
    )
    return claims


async def run(
    *,
    issuer: str,
    client_id: str,
    client_secret: str | None,
    scope: str,
    qr: str = "auto",
    as_json: bool = False,
    out: TextIO = sys.stdout,
    log: TextIO = sys.stderr,
) -> int:
    issuer = issuer.rstrip("/")
    async with aiohttp.ClientSession() as http:
        client = Client(http, client_id, client_secret)
        try:
            endpoints = await discover(http, issuer)
            try:
                status, started = await client.post(
                    endpoints.device_authorization, {"scope": scope}
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise Failed(f"cannot reach the server ({exc.__class__.__name__})") from None
            if status != 200 or not isinstance(started, dict):
                raise Failed(f"the device authorization failed: {_error_text(status, started)}")
            try:
                device_code = str(started["device_code"])
                user_code = str(started["user_code"])
                uri = str(started["verification_uri"])
                expires_in = float(started["expires_in"])
            except (KeyError, TypeError, ValueError):
                raise Failed("the device authorization response lacks a required member") from None
            complete = started.get("verification_uri_complete")
            interval = float(started.get("interval") or DEFAULT_INTERVAL)
            deadline = time.monotonic() + expires_in

            print(f"To sign in, open {uri}", file=out)
            print(f"and enter the code {user_code}", file=out)
            if isinstance(complete, str):
                print(f"or open {complete}", file=out)
                wanted = qr == "always" or (qr == "auto" and out.isatty())
                if wanted and not show_qr(complete, out):
                    print("(install segno to see a QR code here)", file=log)
            print(
                f"The code expires in {int(expires_in // 60)} min {int(expires_in % 60)} s.",
                file=out,
            )
            out.flush()
            print(f"waiting for approval, polling every {interval:g} s", file=log)

            tokens = await poll(client, endpoints, device_code, interval, deadline, log)
            if not isinstance(tokens.get("access_token"), str):
                raise Failed("the token response has no access_token")
            # The access token is meant for the API; its claims are shown, not relied on.
            access = await verified_claims(
                http,
                endpoints.jwks_uri,
                tokens["access_token"],
                issuer,
                options={"verify_aud": False},
            )
            id_claims = None
            if isinstance(tokens.get("id_token"), str):
                id_claims = await verified_claims(
                    http, endpoints.jwks_uri, tokens["id_token"], issuer, audience=client_id
                )
        except PollEnded as ended:
            print(str(ended), file=log)
            return ended.status
        except (Failed, jwt.PyJWTError) as exc:
            print(f"sign-in failed: {exc}", file=log)
            return EXIT_FAILED

    summary = {
        "scope": tokens.get("scope"),
        "expires_in": tokens.get("expires_in"),
        "refresh_token": "received" if tokens.get("refresh_token") else None,
        "access_token_claims": access,
        "id_token_claims": id_claims,
    }
    if as_json:
        print(json.dumps(summary), file=out)
    else:
        print("Signed in.", file=out)
        print(json.dumps(summary, indent=2, ensure_ascii=False), file=out)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="device_cli.py",
        description="Sign in from a terminal with the device authorization grant (RFC 8628).",
    )
    parser.add_argument("--issuer", required=True, help="the authorization server's issuer URL")
    parser.add_argument("--client-id", required=True)
    parser.add_argument(
        "--client-secret",
        default=os.environ.get("DEVICE_CLIENT_SECRET"),
        help="for a confidential client (default: the DEVICE_CLIENT_SECRET environment variable)",
    )
    parser.add_argument(
        "--scope", default="openid profile offline_access", help="scopes to ask for"
    )
    parser.add_argument(
        "--qr",
        choices=("auto", "always", "never"),
        default="auto",
        help="QR code of the sign-in link (auto: on a terminal, when segno is installed)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    return asyncio.run(
        run(
            issuer=args.issuer,
            client_id=args.client_id,
            client_secret=args.client_secret,
            scope=args.scope,
            qr=args.qr,
            as_json=args.json,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
