"""The floor for a Python token endpoint: a bare aiohttp handler that signs one ES256 JWT
with PyJWT per request.

    POST /token   reads the body, ignores it, and answers the token response the Portcullis
                  authserver gives for client_credentials: {"access_token", "token_type",
                  "expires_in", "scope"}, the token an RFC 9068 JWT (header alg, typ at+jwt,
                  kid; claims iss, sub, aud, exp, iat, jti, client_id, scope)
    GET /jwks     the public key, so the bench can check the signature

No form parsing, no client authentication, no routing beyond these two paths: what the
authserver does above this is its own cost. Runs on uvloop like the authserver, without an
access log.

Usage: sign_baseline.py --port N
"""

from __future__ import annotations

import argparse
import base64
import os
import time
from typing import Any

import jwt
import orjson
import uvloop
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

KID = "bench-baseline-es256"
LIFETIME = 300  # seconds, as the authserver's default access token lifetime
HEADERS = {"Cache-Control": "no-store", "Pragma": "no-cache"}


def build_app(issuer: str, key: ec.EllipticCurvePrivateKey) -> web.Application:
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwk.update({"kid": KID, "alg": "ES256", "use": "sig"})
    jwks_body = orjson.dumps({"keys": [jwk]})

    async def token(request: web.Request) -> web.Response:
        await request.read()
        iat = int(time.time())
        claims = {
            "iss": issuer,
            "sub": "bench",
            "aud": "bench-api",
            "exp": iat + LIFETIME,
            "iat": iat,
            "jti": base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode(),
            "client_id": "bench",
            "scope": "bench:read",
        }
        signed = jwt.encode(claims, key, algorithm="ES256", headers={"kid": KID, "typ": "at+jwt"})
        body = {
            "access_token": signed,
            "token_type": "Bearer",
            "expires_in": LIFETIME,
            "scope": "bench:read",
        }
        return web.Response(
            body=orjson.dumps(body), content_type="application/json", headers=HEADERS
        )

    async def jwks(_: web.Request) -> web.Response:
        return web.Response(body=jwks_body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/token", token)
    app.router.add_get("/jwks", jwks)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    key = ec.generate_private_key(ec.SECP256R1())
    app = build_app(f"http://{args.host}:{args.port}", key)
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
