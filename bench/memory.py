"""Memory per entry of each bounded cache of the gateway, and of an idle gateway process.

Each cache is filled in this process through the code that fills it in a running gateway,
with entries shaped like real ones:

  token-cache          JwtVerifier.verify of distinct ES256 access tokens (RFC 9068 claims, a
                       36-character subject each), then what forwarding one request adds to
                       the cached principal: its identity headers and its rate-limit key
  introspection-active Introspector.verify of distinct opaque tokens that an introspection
                       endpoint on 127.0.0.1 calls active (with the same claims), plus the
                       same forwarding memo
  introspection-inactive  the same for tokens it calls inactive
  rate-limit-bucket    MemoryBuckets.take_now for distinct keys of the longest kind
  jwks-key-ec / -rsa   parse_jwks of a key set of P-256 / RSA-2048 keys, per key
  jwks-1mib            parse_jwks of the largest key set a fetch accepts (1 MiB), of the key
                       type that costs the most memory per byte of JWKS
And measured on a real `python -m gateway run` process with a key set loaded:
  idle                 its resident memory once ready
  connection           what each idle keep-alive client connection adds
  supervisor           with `workers: 2`, the resident memory of the supervisor process

Two figures for each: Python's own allocations (tracemalloc, after a full collection) and
the growth of the process's resident memory (VmRSS), which also counts what OpenSSL and the
C library allocate and what the allocators keep aside. The figure to plan with is the
larger. Each measurement runs in a fresh child process, so none reuses memory another freed.

    python bench/memory.py                  # all, as a table (and bench/out/memory.json)
    python bench/memory.py --entries 50000  # more entries per cache (slower, steadier)

The constants `portcullis-gateway check` estimates with sit next to the caches
(verifiers/cache.py, verifiers/introspection.py, ratelimit.py, jwks.py, memory.py); update
them from this script's output, and bench/README.md with it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway import settings  # noqa: E402
from gateway.forward import Forwarder, Upstream  # noqa: E402
from gateway.steps import ratelimit  # noqa: E402
from gateway.transport.capacity import BodiesInFlight, Slots  # noqa: E402
from gateway.verifiers import jwks  # noqa: E402
from gateway.verifiers.base import InvalidToken  # noqa: E402
from gateway.verifiers.cache import TokenCache, token_key  # noqa: E402
from gateway.verifiers.introspection import Introspector  # noqa: E402
from gateway.verifiers.jwt import JwtVerifier, TrustedIssuer  # noqa: E402
from portcullis import yamlconf  # noqa: E402
from portcullis.addresses import ClientAddresses  # noqa: E402

KiB = 1024
MiB = 1024 * 1024
AUDIENCE = "bench-api"
SCOPE = "orders:read orders:write profile"


# ---------------------------------------------------------------------------- measuring


def resident() -> int:
    """This process's resident memory in bytes (VmRSS)."""
    return resident_of(os.getpid())


def resident_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    raise RuntimeError("no VmRSS")


def settle() -> None:
    """Free what is garbage and give free heap pages back, so what stays is what is held."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


async def per_entry(
    fill: Callable[[], Awaitable[Any]], clear: Callable[[], None], entries: int
) -> dict[str, float]:
    """Bytes per entry: `fill()` adds `entries` entries and returns what holds them."""
    settle()
    before = resident()
    held = await fill()
    settle()
    rss = (resident() - before) / entries
    clear()
    del held
    settle()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    held = await fill()
    settle()
    python = (tracemalloc.get_traced_memory()[0] - start) / entries
    tracemalloc.stop()
    del held
    return {"entries": entries, "python_bytes": python, "rss_bytes": rss}


# ---------------------------------------------------------------------------- peers


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Issuer:
    """Discovery, a JWKS of one ES256 key and an introspection endpoint on 127.0.0.1."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.active: dict[str, dict[str, Any]] = {}
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        jwk = ECAlgorithm.to_jwk(self.key.public_key(), as_dict=True)
        jwk.update({"kid": "bench", "alg": "ES256", "use": "sig"})
        metadata = {"issuer": self.url, "jwks_uri": f"{self.url}/jwks"}

        async def discovery(_: web.Request) -> web.Response:
            return web.json_response(metadata)

        async def keys(_: web.Request) -> web.Response:
            return web.json_response({"keys": [jwk]}, headers={"Cache-Control": "max-age=3600"})

        async def introspect(request: web.Request) -> web.Response:
            token = str((await request.post()).get("token", ""))
            return web.json_response(self.active.get(token, {"active": False}))

        async def public(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", discovery)
        app.router.add_get("/jwks", keys)
        app.router.add_post("/introspect", introspect)
        app.router.add_get("/public/{tail:.*}", public)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def claims(self) -> dict[str, Any]:
        now = int(time.time())
        return {
            "iss": self.url,
            "sub": str(uuid.uuid4()),
            "aud": AUDIENCE,
            "client_id": "orders-web",
            "scope": SCOPE,
            "iat": now,
            "exp": now + 3600,
            "jti": uuid.uuid4().hex,
        }

    def token(self) -> str:
        header = b64url(b'{"alg":"ES256","typ":"at+jwt","kid":"bench"}')
        payload = b64url(json.dumps(self.claims(), separators=(",", ":")).encode())
        signing_input = f"{header}.{payload}"
        der = self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256()))
        r, s = decode_dss_signature(der)
        return f"{signing_input}.{b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def config(issuer: str, entries: int) -> settings.Settings:
    """The gateway settings of the measurements: an issuer of JWTs, the same issuer asked by
    introspection, and a rate limit per subject (the memo a forwarded request adds)."""
    text = f"""
upstream: {{url: "http://127.0.0.1:9"}}
issuers:
  - issuer: "{issuer}"
    audiences: [{AUDIENCE}]
    algorithms: [ES256]
    jwks_uri: "{issuer}/jwks"
    mode: auto
    introspection:
      url: "{issuer}/introspect"
      client_id: gateway
      client_secret: bench-secret
      cache_size: {entries}
      cache_ttl: 1h
      inactive_cache_ttl: 1h
token_cache_size: {entries}
rate_limits: {{default: {{rate: 100/s, burst: 200, key: subject}}, max_keys: {entries}}}
routes:
  - {{name: all, path: "/**"}}
"""
    return settings.load_text(text, "bench.yaml", {})


class Forwarding:
    """What forwarding one request adds to a principal: its identity headers and its
    rate-limit key, both remembered on it."""

    def __init__(self, config: settings.Settings, upstream: Upstream) -> None:
        self.forwarder = Forwarder(config, upstream, BodiesInFlight(0))
        self.identities: list[bytes] = []
        assert config.rate_limits.default is not None
        self.policy = ratelimit.Policy(
            "default", config.rate_limits.default, ClientAddresses(config.trusted_proxies)
        )

    def add_memo(self, principal: Any) -> None:
        # The forwarder keeps a principal's identity headers in a cache of its own (the
        # principal is read-only): held here, one per entry, they count as that cache would.
        self.identities.append(self.forwarder.identity_fields(principal))
        self.policy.key(principal, {}, "127.0.0.1")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the caches


async def measure_token_cache(entries: int) -> dict[str, float]:
    issuer = Issuer()
    await issuer.start()
    conf = config(issuer.url, entries)
    tokens = [issuer.token() for _ in range(entries)]
    async with aiohttp.ClientSession() as session:
        keyset = jwks.KeySet(conf.issuers[0], conf.jwks, session)
        assert await keyset.refresh(), keyset.last_error
        trusted = TrustedIssuer(conf.issuers[0], keyset, frozenset({"ES256"}), 30.0)
        upstream = Upstream(session, session, Slots(1))
        forwarding = Forwarding(conf, upstream)
        cache = TokenCache(entries)
        verifier = JwtVerifier({issuer.url: trusted}, cache)

        async def fill() -> TokenCache:
            for token in tokens:
                forwarding.add_memo(await verifier.verify(token))
            assert len(cache) == entries
            return cache

        def clear() -> None:
            cache.retain(lambda _: False)

        result = await per_entry(fill, clear, entries)
        await upstream.upgrades.close()
    await issuer.stop()
    return result


async def measure_introspection(entries: int, active: bool) -> dict[str, float]:
    issuer = Issuer()
    await issuer.start()
    conf = config(issuer.url, entries)
    tokens = [b64url(os.urandom(32)) for _ in range(entries)]
    if active:
        for token in tokens:
            issuer.active[token] = {"active": True, "token_type": "Bearer", **issuer.claims()}
    async with aiohttp.ClientSession() as session:
        settings_of = conf.issuers[0]
        assert settings_of.introspection is not None
        introspector = Introspector(settings_of, settings_of.introspection)
        upstream = Upstream(session, session, Slots(1))
        forwarding = Forwarding(conf, upstream)

        async def fill() -> Introspector:
            for token in tokens:
                with contextlib.suppress(InvalidToken):  # an inactive one
                    forwarding.add_memo(await introspector.verify(token, token_key(token)))
            held = len(introspector.cache) if active else len(introspector.inactive)
            assert held == entries, held
            return introspector

        def clear() -> None:
            introspector.cache.retain(lambda _: False)
            introspector.inactive = type(introspector.inactive)(entries)

        result = await per_entry(fill, clear, entries)
        await introspector.close()
        await upstream.upgrades.close()
    await issuer.stop()
    return result


async def measure_rate_limit_buckets(entries: int) -> dict[str, float]:
    rule = settings.LimitRule(rate=yamlconf.rate("100/s"), burst=200, key="ip")
    policy = ratelimit.Policy("default", rule, ClientAddresses(()))
    # A clock that stands still: no bucket fills up again, so none is swept away.
    buckets = ratelimit.MemoryBuckets(entries, clock=lambda: 0.0)

    async def fill() -> ratelimit.MemoryBuckets:
        for n in range(entries):
            # The longest keys a policy makes, made per request as the gateway does: a value
            # past 64 characters (a long subject, a header) is kept as its hex SHA-256.
            buckets.take_now(policy, f"s:#{hashlib.sha256(b'%d' % n).hexdigest()}")
        assert len(buckets) == entries
        return buckets

    def clear() -> None:
        buckets._buckets.clear()

    return await per_entry(fill, clear, entries)


def _ec_jwk() -> dict[str, Any]:
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(
        ec.generate_private_key(ec.SECP256R1()).public_key(), as_dict=True
    )
    return jwk


def _rsa_jwk() -> dict[str, Any]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk: dict[str, Any] = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    return jwk


def _okp_jwk() -> dict[str, Any]:
    key = ed25519.Ed25519PrivateKey.generate()
    jwk: dict[str, Any] = OKPAlgorithm.to_jwk(key.public_key(), as_dict=True)
    return jwk


async def measure_jwks(kind: str, count: int) -> dict[str, float]:
    """Keys parsed from a key set of `count` keys, each its own (`kid` k0, k1, ...); with
    count 0, as many copies of one key as fit in the largest key set a fetch accepts."""
    make = {"ec": _ec_jwk, "rsa": _rsa_jwk, "okp": _okp_jwk}[kind]
    if count:
        keys = [{**make(), "kid": f"k{n}", "use": "sig"} for n in range(count)]
    else:
        one = make()
        size = len(json.dumps(one, separators=(",", ":"))) + 1
        count = (jwks.MAX_DOCUMENT_BYTES - 10) // size
        keys = [one] * count
    document = {"keys": keys}

    async def fill() -> Any:
        parsed = jwks.parse_jwks(document)
        assert sum(len(found) for found in parsed.values()) == count
        return parsed

    result = await per_entry(fill, lambda: None, count)
    result["document_bytes"] = len(json.dumps(document, separators=(",", ":")))
    return result


# ---------------------------------------------------------------------------- the process


async def measure_process(connections: int, workers: int = 1) -> dict[str, float]:
    """A real gateway process: resident memory once ready, and what idle connections add;
    with several workers, the supervisor's resident memory."""
    issuer = Issuer()
    await issuer.start()
    listen, admin = free_port(), free_port()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "gateway.yaml"
        path.write_text(
            f'listen: "127.0.0.1:{listen}"\n'
            f'admin_listen: "127.0.0.1:{admin}"\n'
            f'upstream: {{url: "{issuer.url}"}}\n'
            "issuers:\n"
            f'  - {{issuer: "{issuer.url}", audiences: [{AUDIENCE}], algorithms: [ES256]}}\n'
            "log_level: warning\n"
            f"workers: {workers}\n"
            "routes:\n"
            '  - {name: public, path: "/public/**", auth: none}\n'
            '  - {name: api, path: "/**"}\n'
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await _ready(f"http://127.0.0.1:{admin}/readyz", process)
            await asyncio.sleep(2)  # settled: start-up garbage collected
            if workers > 1:
                return {"supervisor_rss_bytes": resident_of(process.pid)}
            idle = resident_of(process.pid)
            before = idle
            opened = []
            for _ in range(connections):
                reader, writer = await asyncio.open_connection("127.0.0.1", listen)
                writer.write(b"GET /public/x HTTP/1.1\r\nHost: gateway\r\n\r\n")
                await reader.readuntil(b"ok")
                opened.append(writer)
            await asyncio.sleep(1)
            per_connection = (resident_of(process.pid) - before) / connections
            for writer in opened:
                writer.close()
        finally:
            process.terminate()
            process.wait(timeout=30)
    await issuer.stop()
    return {"idle_rss_bytes": idle, "connections": connections, "rss_bytes": per_connection}


async def _ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {process.returncode}")
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not become ready")


# ---------------------------------------------------------------------------- main

MEASUREMENTS: dict[str, Callable[[int], Coroutine[Any, Any, dict[str, float]]]] = {
    "token-cache": measure_token_cache,
    "introspection-active": lambda n: measure_introspection(min(n, 10_000), True),
    "introspection-inactive": lambda n: measure_introspection(min(n, 10_000), False),
    "rate-limit-bucket": measure_rate_limit_buckets,
    "jwks-key-ec": lambda n: measure_jwks("ec", 1000),
    "jwks-key-rsa": lambda n: measure_jwks("rsa", 200),
    "jwks-1mib-ec": lambda n: measure_jwks("ec", 0),
    "jwks-1mib-okp": lambda n: measure_jwks("okp", 0),
    "jwks-1mib-rsa": lambda n: measure_jwks("rsa", 0),
    "process": lambda n: measure_process(1000),
    "supervisor": lambda n: measure_process(0, workers=2),
}


def run_one(name: str, entries: int) -> dict[str, float]:
    child = subprocess.run(
        [sys.executable, __file__, "--one", name, "--entries", str(entries)],
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        raise SystemExit(f"{name} failed:\n{child.stderr}")
    result: dict[str, float] = json.loads(child.stdout)
    return result


def report(results: dict[str, dict[str, float]]) -> str:
    lines = [
        "| measurement | entries | Python (tracemalloc) | resident (VmRSS) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, found in results.items():
        if name in ("process", "supervisor"):
            continue
        python = found["python_bytes"]
        total = name.startswith("jwks-1mib")
        scale = found["entries"] if total else 1
        unit = MiB if total else KiB
        suffix = " MiB per key set" if total else " KiB"
        lines.append(
            f"| {name} | {int(found['entries']):,} | {python * scale / unit:.2f}{suffix} "
            f"| {found['rss_bytes'] * scale / unit:.2f}{suffix} |"
        )
    supervisor = results.get("supervisor")
    if supervisor is not None:
        rss = supervisor["supervisor_rss_bytes"] / MiB
        lines.append(f"| supervisor (`workers: 2`) | | | {rss:.1f} MiB |")
    process = results.get("process")
    if process is not None:
        lines.append(f"| idle gateway process | | | {process['idle_rss_bytes'] / MiB:.1f} MiB |")
        lines.append(
            f"| idle client connection | {int(process['connections']):,} | "
            f"| {process['rss_bytes'] / KiB:.2f} KiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20_000, help="entries per cache")
    parser.add_argument("--one", choices=sorted(MEASUREMENTS), help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=sorted(MEASUREMENTS), help="some only")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(MEASUREMENTS[args.one](args.entries))))
        return
    results = {}
    for name in args.only or MEASUREMENTS:
        results[name] = run_one(name, args.entries)
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
