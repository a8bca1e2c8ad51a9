"""A minimal token issuer for the benchmark: OpenID discovery and a JWKS with one ES256 key.

The key is generated at start. Its private half is written to `--private-key` so that
`mktoken.py` can sign access tokens, and its public half to `--public-key` as PEM for
HAProxy's `jwt_verify`. The server answers only what a resource server needs:

    GET /.well-known/openid-configuration   {"issuer", "jwks_uri"}
    GET /jwks                                {"keys": [the public JWK]}

Usage: issuer.py --port N --kid KID --private-key FILE --public-key FILE
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm


def write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def build_app(url: str, kid: str, key: ec.EllipticCurvePrivateKey) -> web.Application:
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwk.update({"kid": kid, "alg": "ES256", "use": "sig"})
    metadata = {"issuer": url, "jwks_uri": f"{url}/jwks"}
    # The keys never change during a run; a long max-age keeps the gateway from refetching.
    cache = {"Cache-Control": "max-age=3600"}

    async def discovery(_: web.Request) -> web.Response:
        return web.json_response(metadata, headers=cache)

    async def jwks(_: web.Request) -> web.Response:
        return web.json_response({"keys": [jwk]}, headers=cache)

    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", discovery)
    app.router.add_get("/.well-known/oauth-authorization-server", discovery)
    app.router.add_get("/jwks", jwks)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kid", default="bench-es256")
    parser.add_argument("--private-key", required=True)
    parser.add_argument("--public-key", required=True)
    args = parser.parse_args()

    key = ec.generate_private_key(ec.SECP256R1())
    write_private(
        args.private_key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    with open(args.public_key, "wb") as out:
        out.write(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    url = f"http://{args.host}:{args.port}"
    web.run_app(
        build_app(url, args.kid, key),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
