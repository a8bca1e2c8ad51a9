"""Sign ES256 access tokens in the RFC 9068 shape with the key `issuer.py` wrote.

Header `{"alg": "ES256", "typ": "at+jwt", "kid"}`; claims `iss`, `sub`, `aud`, `client_id`,
`scope`, `iat`, `exp` (a year ahead) and a unique `jti`, so no two tokens are alike.

    mktoken.py --key FILE --kid KID --issuer URL                  one token on stdout
    mktoken.py ... --tamper                                       same, signature altered
    mktoken.py ... --lifetime -3600 / --audience X / --scope Y    tokens a proxy must refuse
    mktoken.py ... --count 200000 --out FILE                      one token a line
    mktoken.py ... --cnf-jkt THUMBPRINT                           a DPoP-bound token
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

LIFETIME = 365 * 24 * 3600  # seconds: far beyond any run; --lifetime -3600 makes one expired


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def load_key(path: str) -> ec.EllipticCurvePrivateKey:
    with open(path, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SystemExit(f"{path}: not an EC private key")
    return key


def sign(key: ec.EllipticCurvePrivateKey, header_b64: str, claims: dict[str, Any]) -> str:
    payload_b64 = b64url(json.dumps(claims, separators=(",", ":")).encode())
    signing_input = f"{header_b64}.{payload_b64}"
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    # JWS ES256 signatures are r || s, each 32 bytes big-endian (RFC 7518 §3.4).
    return f"{signing_input}.{b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def tamper(token: str) -> str:
    """The same token with one signature character changed (not the last, whose low bits
    may be padding that decoders ignore)."""
    head, _, signature = token.rpartition(".")
    middle = len(signature) // 2
    swapped = "A" if signature[middle] != "A" else "B"
    return f"{head}.{signature[:middle]}{swapped}{signature[middle + 1 :]}"


def make_tokens(options: dict[str, Any], count: int) -> list[str]:
    key = load_key(options["key"])
    header_b64 = b64url(
        json.dumps(
            {"alg": "ES256", "typ": "at+jwt", "kid": options["kid"]}, separators=(",", ":")
        ).encode()
    )
    now = int(time.time())
    tokens = []
    for n in range(count):
        claims = {
            "iss": options["issuer"],
            "sub": f"user-{n % 1000}",
            "aud": options["audience"],
            "client_id": "bench-client",
            "scope": options["scope"],
            "iat": min(now, now + options["lifetime"]),
            "exp": now + options["lifetime"],
            "jti": uuid.uuid4().hex,
        }
        if options["cnf_jkt"]:
            claims["cnf"] = {"jkt": options["cnf_jkt"]}  # RFC 9449 §6.1
        tokens.append(sign(key, header_b64, claims))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True, help="private key PEM written by issuer.py")
    parser.add_argument("--kid", default="bench-es256")
    parser.add_argument("--issuer", required=True)
    parser.add_argument("--audience", default="bench-api")
    parser.add_argument("--scope", default="bench:read")
    parser.add_argument("--lifetime", type=int, default=LIFETIME, help="seconds until exp")
    parser.add_argument("--tamper", action="store_true", help="alter the signature")
    parser.add_argument("--cnf-jkt", help="bind the token to this DPoP key thumbprint")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--out", help="file for --count tokens, one a line")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    names = ("key", "kid", "issuer", "audience", "scope", "lifetime", "cnf_jkt")
    options = {k: getattr(args, k) for k in names}

    if args.out is None:
        if args.count != 1:
            parser.error("--count needs --out")
        token = make_tokens(options, 1)[0]
        print(tamper(token) if args.tamper else token)
        return

    jobs = max(1, min(args.jobs, args.count // 1000 or 1))
    shares = [args.count // jobs + (1 if i < args.count % jobs else 0) for i in range(jobs)]
    with ProcessPoolExecutor(jobs) as pool, open(args.out, "w") as out:
        for part in pool.map(make_tokens, [options] * jobs, shares):
            out.write("\n".join(part))
            out.write("\n")
    print(f"{args.count} tokens written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
