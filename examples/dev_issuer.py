"""DEVELOPMENT ONLY: a stand-in token issuer for trying the gateway on one machine.

It is not an authorization server. It authenticates nobody and asks for no consent:
anyone who can run `mint` gets any token they ask for. Never point a gateway that guards
real data at it.

    python examples/dev_issuer.py serve --port 9000 --keys DIR
        serves /.well-known/openid-configuration and /jwks for issuer http://127.0.0.1:9000;
        an ES256 signing key is generated into DIR on first start (private key mode 0600)

    python examples/dev_issuer.py mint --keys DIR --issuer http://127.0.0.1:9000 \\
        --sub alice --scope "orders:read" [--aud orders-api] [--lifetime 5m] [--client-id cli]
        prints a signed RFC 9068 access token (typ at+jwt) to stdout
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

KEY_FILE = "dev-issuer-es256.pem"
ALGORITHM = "ES256"
WARNING = "development only: issues any token to anyone who asks; never use it for real data"

# ---------------------------------------------------------------------------- the key


def public_jwk(key: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwk.update({"kid": thumbprint(jwk), "alg": ALGORITHM, "use": "sig"})
    return jwk


def thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638 JWK thumbprint of an EC public key: a kid that names exactly this key."""
    members = {name: jwk[name] for name in ("crv", "kty", "x", "y")}
    canonical = json.dumps(members, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(hashlib.sha256(canonical).digest()).rstrip(b"=").decode()


def load_or_create_key(directory: Path) -> ec.EllipticCurvePrivateKey:
    """The signing key in `directory`, generated on first use.

    The file is written under a temporary name with mode 0600 and then linked into place,
    so a second process starting at the same moment reads a whole key, never half of one,
    and never replaces it.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / KEY_FILE
    if not path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=".key-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            with contextlib.suppress(FileExistsError):  # another process won: use its key
                os.link(temporary, path)
        finally:
            os.unlink(temporary)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        print(
            f"warning: {path} is readable by others (mode {mode:o}); chmod 600 it", file=sys.stderr
        )
    loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(loaded, ec.EllipticCurvePrivateKey) or loaded.curve.name != "secp256r1":
        raise SystemExit(f"{path} does not hold a P-256 private key")
    return loaded


# ---------------------------------------------------------------------------- serve


def create_app(issuer: str, key: ec.EllipticCurvePrivateKey) -> web.Application:
    metadata = {
        "issuer": issuer,
        "jwks_uri": f"{issuer}/jwks",
        "id_token_signing_alg_values_supported": [ALGORITHM],
    }
    key_set = {"keys": [public_jwk(key)]}

    async def discovery(_: web.Request) -> web.Response:
        return web.json_response(metadata, headers={"Cache-Control": "max-age=300"})

    async def jwks(_: web.Request) -> web.Response:
        return web.json_response(key_set, headers={"Cache-Control": "max-age=300"})

    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", discovery)
    app.router.add_get("/jwks", jwks)
    return app


def serve(args: argparse.Namespace) -> int:
    issuer = f"http://{args.host}:{args.port}"
    app = create_app(issuer, load_or_create_key(Path(args.keys)))

    def announce(_: str) -> None:
        print(f"dev issuer {issuer} ({WARNING})", flush=True)

    web.run_app(app, host=args.host, port=args.port, print=announce, access_log=None)
    return 0


# ---------------------------------------------------------------------------- mint

_DURATION = re.compile(r"^(\d+)(s|m|h)$")
_UNIT = {"s": timedelta(seconds=1), "m": timedelta(minutes=1), "h": timedelta(hours=1)}


def lifetime(text: str) -> timedelta:
    match = _DURATION.match(text)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a lifetime like 30s, 5m or 1h")
    return int(match.group(1)) * _UNIT[match.group(2)]


def mint_token(
    key: ec.EllipticCurvePrivateKey,
    *,
    issuer: str,
    subject: str,
    scope: str,
    audiences: list[str],
    client_id: str,
    valid_for: timedelta,
) -> str:
    """An RFC 9068 JWT access token signed with `key`."""
    issued = int(time.time())
    claims = {
        "iss": issuer,
        "sub": subject,
        "aud": audiences[0] if len(audiences) == 1 else audiences,
        "client_id": client_id,
        "scope": " ".join(scope.split()),
        "iat": issued,
        "exp": issued + int(valid_for.total_seconds()),
        "jti": uuid.uuid4().hex,
    }
    header = {"typ": "at+jwt", "kid": public_jwk(key)["kid"]}
    return jwt.encode(claims, key, algorithm=ALGORITHM, headers=header)


def mint(args: argparse.Namespace) -> int:
    token = mint_token(
        load_or_create_key(Path(args.keys)),
        issuer=args.issuer.rstrip("/"),
        subject=args.sub,
        scope=args.scope,
        audiences=args.aud or ["orders-api"],
        client_id=args.client_id,
        valid_for=args.lifetime,
    )
    print(token)
    return 0


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dev_issuer.py",
        description=f"DEVELOPMENT ONLY token issuer for the gateway demo ({WARNING}).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "serve",
        help="serve discovery and the key set (development only)",
        description=f"Serve discovery and the key set; {WARNING}.",
    )
    run.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    run.add_argument("--port", type=int, default=9000, help="port (9000)")
    run.add_argument("--keys", required=True, help="directory holding the signing key")
    run.set_defaults(handler=serve)

    sign = commands.add_parser(
        "mint",
        help="print a signed access token (development only)",
        description=f"Print a signed RFC 9068 access token; {WARNING}.",
    )
    sign.add_argument("--keys", required=True, help="directory holding the signing key")
    sign.add_argument("--issuer", default="http://127.0.0.1:9000", help="the iss claim")
    sign.add_argument("--sub", required=True, help="the subject (user id) of the token")
    sign.add_argument("--scope", default="", help='space-separated scopes, e.g. "orders:read"')
    sign.add_argument(
        "--aud", action="append", help="audience (repeat for several; default orders-api)"
    )
    sign.add_argument(
        "--lifetime",
        type=lifetime,
        default=timedelta(minutes=5),
        help="how long the token is valid: 30s, 5m, 1h (5m)",
    )
    sign.add_argument("--client-id", default="dev-cli", help="the client_id claim (dev-cli)")
    sign.set_defaults(handler=mint)

    args = parser.parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
