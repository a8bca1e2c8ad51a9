"""Check one token endpoint answer before the load, so that every server measured does the
same work: it must have issued a Bearer JWT access token signed with the expected algorithm.

    check_token.py --body FILE --jwks URL --alg ES256 --issuer URL --audience bench-api \
        --scope bench:read --client-id bench

FILE is the JSON body of a 200 answer. Checks: `token_type` is Bearer; `access_token` is a
JWS whose header has the expected `alg`, `typ: at+jwt` and a `kid` of the server's JWKS;
the signature verifies with that key; `iss`, `aud`, `client_id` and `scope` are the expected
ones and `exp` lies ahead. Prints one line describing the token; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from typing import Any

import jwt


def fail(message: str) -> None:
    print(f"check_token: {message}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", required=True)
    parser.add_argument("--jwks", required=True)
    parser.add_argument("--alg", required=True)
    parser.add_argument("--issuer", required=True)
    parser.add_argument("--audience", required=True)
    parser.add_argument("--scope", required=True)
    parser.add_argument("--client-id", required=True)
    args = parser.parse_args()

    with open(args.body) as f:
        try:
            answer: dict[str, Any] = json.load(f)
        except ValueError:
            fail("the answer is not JSON")
    if answer.get("token_type") != "Bearer":
        fail(f"token_type is {answer.get('token_type')!r}, not 'Bearer'")
    token = answer.get("access_token")
    if not isinstance(token, str):
        fail("no access_token")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        fail(f"the access token is not a JWT: {exc}")
    if header.get("alg") != args.alg or header.get("typ") != "at+jwt":
        fail(f"header {header}: expected alg {args.alg} and typ at+jwt")
    with urllib.request.urlopen(args.jwks, timeout=5) as response:
        keys = json.load(response)["keys"]
    match = [k for k in keys if k.get("kid") == header.get("kid")]
    if not match:
        fail(f"kid {header.get('kid')!r} is not in {args.jwks}")
    try:
        claims = jwt.decode(
            token,
            jwt.PyJWK(match[0]).key,
            algorithms=[args.alg],
            audience=args.audience,
            issuer=args.issuer,
            options={"require": ["iss", "aud", "exp", "iat", "jti"]},
        )
    except jwt.PyJWTError as exc:
        fail(f"the access token does not verify: {exc}")
    if claims.get("client_id") != args.client_id or claims.get("scope") != args.scope:
        fail(f"claims {claims}: expected client_id {args.client_id} and scope {args.scope}")
    if claims["exp"] <= time.time():
        fail("the access token has expired")
    print(
        f"{header['alg']} {header['typ']} kid={header['kid']} sub={claims.get('sub')} "
        f"aud={claims['aud']} scope={claims['scope']} lifetime={claims['exp'] - claims['iat']}s "
        f"length={len(token)}"
    )


if __name__ == "__main__":
    main()
