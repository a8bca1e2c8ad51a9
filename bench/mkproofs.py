"""DPoP (RFC 9449) for the bench: a client key, and proofs signed with it ahead of the run.

wrk's Lua cannot sign ES256, so each proof a request carries is made here beforehand, each
with its own `jti`: the gateway sees a fresh proof on every request, as it would from real
clients, and a proof sent twice would be refused (the run is flagged when any is).

    mkproofs.py key --out KEY.pem                 a P-256 key; prints its RFC 7638 thumbprint
    mkproofs.py proofs --key KEY.pem --token T --url URL --count N --out FILE
                                                  N proofs of GET URL for token T, one a line
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def public_jwk(key: ec.EllipticCurvePrivateKey) -> dict[str, str]:
    numbers = key.public_key().public_numbers()
    return {
        "crv": "P-256",
        "kty": "EC",
        "x": b64url(numbers.x.to_bytes(32, "big")),
        "y": b64url(numbers.y.to_bytes(32, "big")),
    }


def thumbprint(jwk: dict[str, str]) -> str:
    # RFC 7638 §3: the required members, sorted, no whitespace (public_jwk builds them so).
    return b64url(hashlib.sha256(json.dumps(jwk, separators=(",", ":")).encode()).digest())


def load_key(path: str) -> ec.EllipticCurvePrivateKey:
    with open(path, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SystemExit(f"{path}: not an EC private key")
    return key


def make_proofs(key_path: str, token: str, url: str, count: int) -> list[str]:
    key = load_key(key_path)
    header = {"typ": "dpop+jwt", "alg": "ES256", "jwk": public_jwk(key)}
    header_b64 = b64url(json.dumps(header, separators=(",", ":")).encode())
    ath = b64url(hashlib.sha256(token.encode()).digest())
    now = int(time.time())
    proofs = []
    for _ in range(count):
        claims = {"jti": uuid.uuid4().hex, "htm": "GET", "htu": url, "iat": now, "ath": ath}
        signing_input = f"{header_b64}.{b64url(json.dumps(claims, separators=(',', ':')).encode())}"
        r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        proofs.append(f"{signing_input}.{b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}")
    return proofs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    new_key = commands.add_parser("key", help="write a P-256 key, print its thumbprint")
    new_key.add_argument("--out", required=True)
    proofs = commands.add_parser("proofs", help="write proofs, one a line")
    proofs.add_argument("--key", required=True)
    proofs.add_argument("--token", required=True, help="the access token (for ath)")
    proofs.add_argument("--url", required=True, help="htu: the URL the requests go to")
    proofs.add_argument("--count", type=int, default=1)
    proofs.add_argument("--out", required=True)
    proofs.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    if args.command == "key":
        key = ec.generate_private_key(ec.SECP256R1())
        with open(args.out, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        print(thumbprint(public_jwk(key)))
        return

    jobs = max(1, min(args.jobs, args.count // 1000 or 1))
    shares = [args.count // jobs + (1 if i < args.count % jobs else 0) for i in range(jobs)]
    with ProcessPoolExecutor(jobs) as pool, open(args.out, "w") as out:
        for part in pool.map(
            make_proofs, [args.key] * jobs, [args.token] * jobs, [args.url] * jobs, shares
        ):
            out.write("\n".join(part))
            out.write("\n")
    print(f"{args.count} proofs written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
