"""Fixtures for the authorization server: settings from YAML, a server on a real socket, and a
browserless run of the authorization code flow (the login and consent forms posted by hand).

`default_config()` is a plain dict; a test copies it, changes what it needs and passes it (or
YAML text) to the `start_authserver` factory. The issuer, listen address, storage and key
directory are always filled in from `tmp_path` and a free port.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import secrets
import shutil
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote_plus, urlencode, urlsplit

import aiohttp
import jwt
import pytest
import yaml
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from authserver import settings as authserver_settings
from authserver.app import LIVE, Components, build_app
from authserver.keys import KeyRing
from authserver.settings import Settings
from portcullis.tls import RotatingCertificate
from tests.support import bound_socket, reserve_port, start_site

PASSWORD = "wonderland"


def quick_password_hash(password: str) -> str:
    """A hash in the server's stored scrypt format with tiny cost parameters, so that test
    logins are fast; the server reads the parameters from the hash itself."""
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=16, r=1, p=1, dklen=32)
    b64 = lambda data: base64.urlsafe_b64encode(data).rstrip(b"=").decode()  # noqa: E731
    return f"scrypt$4$1$1${b64(salt)}${b64(digest)}"


PASSWORD_HASH = quick_password_hash(PASSWORD)
SECRET = "0123456789abcdef0123456789abcdef"  # the secret of every confidential test client
REDIRECT = "http://127.0.0.1/cb"

# The private_key_jwt client's key pair: the public half goes into the config.
CLIENT_KEY = ec.generate_private_key(ec.SECP256R1())
CLIENT_KID = "client-key-1"


def client_public_jwks(private_key: Any = CLIENT_KEY, kid: str = CLIENT_KID) -> dict[str, Any]:
    jwk = ECAlgorithm.to_jwk(private_key.public_key(), as_dict=True)
    jwk.update({"kid": kid, "alg": "ES256", "use": "sig"})
    return {"keys": [jwk]}


def default_config() -> dict[str, Any]:
    """Scopes, users and a client of each kind; a fresh deep copy every call."""
    return copy.deepcopy(
        {
            "default_audience": "orders-api",
            "scopes": [
                {"name": "orders:read", "description": "Read your orders"},
                {"name": "orders:write", "description": "Change your orders"},
            ],
            "users": [
                {
                    "username": "alice",
                    "password_hash": PASSWORD_HASH,
                    "email": "alice@example.com",
                    "email_verified": True,
                    "name": "Alice Liddell",
                    "given_name": "Alice",
                },
                {
                    "username": "bob",
                    "password_hash": PASSWORD_HASH,
                    "email": "bob@example.com",
                    "name": "Bob",
                },
            ],
            "clients": [
                {
                    "client_id": "machine",
                    "client_secret": SECRET,
                    "grant_types": ["client_credentials"],
                    "scope": "orders:read orders:write",
                    "resources": ["billing-api"],
                },
                {
                    "client_id": "machine-post",
                    "client_secret": SECRET,
                    "token_endpoint_auth_method": "client_secret_post",
                    "grant_types": ["client_credentials"],
                    "scope": "orders:read",
                },
                {
                    "client_id": "machine-jwt",
                    "token_endpoint_auth_method": "private_key_jwt",
                    "jwks": client_public_jwks(),
                    "grant_types": ["client_credentials"],
                    "scope": "orders:read",
                },
                {
                    "client_id": "spa",
                    "client_name": "Single Page App",
                    "token_endpoint_auth_method": "none",
                    "redirect_uris": [REDIRECT],
                    "grant_types": ["authorization_code", "refresh_token"],
                    "scope": "openid profile email offline_access orders:read orders:write",
                },
                {
                    # A desktop or command-line app receiving the redirect on a loopback
                    # port of its own: the only kind of client given any port there.
                    "client_id": "desktop",
                    "client_name": "Desktop App",
                    "application_type": "native",
                    "token_endpoint_auth_method": "none",
                    "redirect_uris": [REDIRECT],
                    "grant_types": ["authorization_code", "refresh_token"],
                    "scope": "openid profile email offline_access orders:read orders:write",
                },
                {
                    "client_id": "web",
                    "client_name": "Web App",
                    "client_secret": SECRET,
                    "redirect_uris": [REDIRECT],
                    "grant_types": ["authorization_code", "refresh_token"],
                    "scope": "openid profile email offline_access orders:read",
                },
                {
                    "client_id": "web-nopkce",
                    "client_secret": SECRET,
                    "redirect_uris": [REDIRECT],
                    "grant_types": ["authorization_code"],
                    "scope": "openid profile email",
                    "require_pkce": False,
                },
                {
                    "client_id": "code-only",
                    "token_endpoint_auth_method": "none",
                    "redirect_uris": [REDIRECT],
                    "grant_types": ["authorization_code"],
                    "scope": "openid orders:read",
                },
                {
                    "client_id": "resource-server",
                    "client_secret": SECRET,
                    "grant_types": ["client_credentials"],
                    "scope": "",
                    "introspection": True,
                },
            ],
        }
    )


def _key_template(root: Path) -> Path:
    """A key directory generated once per test session (RSA generation is slow); servers
    get a copy, so every server signs with the same keys unless a test asks otherwise."""
    template = root / "keys"
    if not template.exists():
        KeyRing(str(template)).load(["ES256", "RS256"])
    return template


# keys.encryption_key of the test servers whose keys live in the storage (PostgreSQL, or
# SQLite without keys.dir): base64 of 32 bytes.
KEY_SECRET = base64.b64encode(bytes(range(32))).decode()


def render_config(config: dict[str, Any] | str, directory: Path, port: int) -> str:
    """The full YAML text: `config` plus the issuer, listen addresses, storage and keys.

    The keys live in `directory/keys`, unless the storage is PostgreSQL (where replicas
    share them through the database) or the test gave `keys.encryption_key` or
    `keys.dir: null`: then in the storage, sealed with KEY_SECRET unless the test gave one."""
    body = yaml.safe_load(config) if isinstance(config, str) else copy.deepcopy(config)
    body = dict(body or {})
    keys = dict(body.pop("keys", None) or {})
    postgres = str(body.get("storage", "")).startswith(("postgresql://", "postgres://"))
    if postgres or "encryption_key" in keys or ("dir" in keys and keys["dir"] is None):
        keys.pop("dir", None)
        keys.setdefault("encryption_key", KEY_SECRET)
    else:
        keys.setdefault("dir", str(directory / "keys"))
    head = {
        "issuer": f"http://127.0.0.1:{port}",
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{reserve_port()}",
        "storage": f"sqlite:///{directory / 'authserver.db'}",
        "keys": keys,
    }
    # A test may give its own issuer (with "{port}" for the server's port), storage or
    # admin listener.
    if "issuer" in body:
        head["issuer"] = str(body["issuer"]).replace("{port}", str(port))
    for given in ("storage", "admin_listen"):
        if given in body:
            head[given] = body[given]
    rest = {k: v for k, v in body.items() if k not in head}
    return yaml.safe_dump({**head, **rest}, sort_keys=False)


def load_settings(config: dict[str, Any] | str, directory: Path, port: int) -> Settings:
    return authserver_settings.load_text(render_config(config, directory, port))


class MovableClock:
    """A clock a test moves instead of sleeping; it starts at the real time, so that tokens
    signed by a server on it are valid for every verifier."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SteppingClock:
    """A clock that moves on by `step` seconds each time it is read: a machine on which
    every step of a piece of work takes that long."""

    def __init__(self, step: float, start: float | None = None) -> None:
        self.step = step
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@dataclass
class RunningAuthServer:
    """An authorization server on 127.0.0.1; `restart()` rebuilds the app on the same files."""

    __test__ = False

    settings: Settings
    url: str
    services: Components  # what the composition root built: store, key ring, minter
    runner: Any = None
    port: int = 0
    clock: Callable[[], float] = time.time

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def restart(self) -> None:
        await self.stop()
        app = build_app(self.settings, clock=self.clock)
        self.runner, self.url = await start_site(app, self.port)
        self.services = started_components(app)

    def subject(self, username: str) -> str:
        """The `sub` the server gives a configured user."""
        user = self.settings.user(username)
        assert user is not None, username
        return self.settings.subject_of(user)

    def endpoint(self, path: str) -> str:
        """An endpoint's URL: the issuer (which may carry a path) and `path`."""
        return self.settings.issuer + path


def started_components(app: web.Application) -> Components:
    """The Components a started application serves with."""
    components = app[LIVE].components
    assert components is not None, "the application has not started"
    return components


async def run_authserver(
    settings: Settings,
    clock: Callable[[], float] = time.time,
    sock: socket.socket | None = None,
) -> RunningAuthServer:
    """Serve on `sock` (bound to the port the settings name), else on that port; over TLS,
    as `run` serves it, when it has `tls`."""
    app = build_app(settings, clock=clock)
    port = settings.listen.port
    certificate = RotatingCertificate(settings.tls) if settings.tls is not None else None
    runner, url = await start_site(
        app, port, certificate.context if certificate else None, sock=sock
    )
    return RunningAuthServer(
        settings=settings,
        url=url,
        services=started_components(app),
        runner=runner,
        port=port,
        clock=clock,
    )


async def serve_authserver(
    config: dict[str, Any] | str, directory: Path, clock: Callable[[], float] = time.time
) -> RunningAuthServer:
    """A server from `config` on a port the OS chooses: bound first, since the issuer URL
    in its settings names it."""
    sock = bound_socket()
    try:
        settings = load_settings(config, directory, sock.getsockname()[1])
        return await run_authserver(settings, clock, sock)
    except BaseException:
        sock.close()
        raise


StartAuthServer = Callable[..., Awaitable[RunningAuthServer]]


@pytest.fixture(scope="session")
def key_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "authserver-key-template"


@pytest.fixture
async def start_authserver(tmp_path: Path, key_root: Path) -> AsyncIterator[StartAuthServer]:
    """Factory: `await start_authserver(config_dict_or_yaml)`; each call gets its own directory."""
    started: list[RunningAuthServer] = []

    async def start(
        config: dict[str, Any] | str | None = None,
        *,
        fresh_keys: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> RunningAuthServer:
        """`fresh_keys`: let the server generate its own keys on first start; `clock`: the
        time the server sees (a MovableClock to move it)."""
        directory = tmp_path / f"authserver{len(started)}"
        directory.mkdir()
        if not fresh_keys:
            shutil.copytree(_key_template(key_root), directory / "keys")
        server = await serve_authserver(
            default_config() if config is None else config, directory, clock
        )
        started.append(server)
        return server

    # The shared keys exist before the test begins: a MovableClock it makes starts no earlier
    # than the moment they began to sign.
    _key_template(key_root)
    yield start
    for server in started:
        await server.stop()


@pytest.fixture
async def authserver(start_authserver: StartAuthServer) -> RunningAuthServer:
    """A server with `default_config()`."""
    return await start_authserver()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session that keeps cookies for 127.0.0.1 and never follows redirects itself."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


# ---------------------------------------------------------------------------- PKCE, forms


def pkce_pair() -> tuple[str, str]:
    """(verifier, S256 challenge) per RFC 7636 §4.1 and §4.2."""
    verifier = secrets.token_urlsafe(48)
    challenge = (
        base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    )
    return verifier, challenge


def login_page_path() -> str:
    """/authorize?… of the public client `spa` (openid, a fresh S256 challenge): a valid
    request from a browser without a session, which the login page answers."""
    return "/authorize?" + urlencode(
        {
            "response_type": "code",
            "client_id": "spa",
            "redirect_uri": REDIRECT,
            "scope": "openid",
            "state": "s",
            "code_challenge": pkce_pair()[1],
            "code_challenge_method": "S256",
        }
    )


class _FormParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append({"action": a.get("action", ""), "fields": {}})
        elif tag == "input" and self.forms and a.get("type") == "hidden":
            self.forms[-1]["fields"][a.get("name", "")] = a.get("value", "")


def parse_form(html: str) -> tuple[str, dict[str, str]]:
    """The first form of a page: its action and its hidden fields."""
    parser = _FormParser()
    parser.feed(html)
    assert parser.forms, f"no form on the page: {html[:500]}"
    form = parser.forms[0]
    return form["action"], dict(form["fields"])


def query_of(location: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(location).query).items()}


@dataclass
class CodeResult:
    code: str
    verifier: str | None
    redirect_uri: str
    state: str
    nonce: str | None
    location: str
    params: dict[str, str] = field(default_factory=dict)


async def authorize_code(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    *,
    client_id: str = "spa",
    scope: str = "openid profile email offline_access orders:read",
    username: str = "alice",
    password: str = PASSWORD,
    redirect_uri: str = REDIRECT,
    pkce: bool = True,
    nonce: str | None = "n-0S6_WzA2Mj",
    extra: dict[str, str] | None = None,
) -> CodeResult:
    """The code flow as a browser would run it: authorize, login form, consent form, code.

    Login is skipped when the session cookie already signs the user in, consent when it was
    given before; both are handled from what the server answers.
    """
    verifier, challenge = pkce_pair() if pkce else (None, None)
    state = secrets.token_urlsafe(12)
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "scope": scope,
        "state": state,
    }
    if challenge:
        params.update(code_challenge=challenge, code_challenge_method="S256")
    if nonce is not None:
        params["nonce"] = nonce
    params.update(extra or {})
    response = await http.get(
        server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
    )
    for _ in range(3):
        if response.status in (302, 303):
            location = response.headers["Location"]
            query = query_of(location)
            assert "code" in query, f"authorization failed: {location}"
            assert query["state"] == state
            return CodeResult(query["code"], verifier, redirect_uri, state, nonce, location, params)
        text = await response.text()
        assert response.status == 200, f"{response.status}: {text[:500]}"
        action, fields = parse_form(text)
        if action.endswith("/login"):
            fields.update(username=username, password=password)
        else:
            fields["decision"] = "approve"
        response = await http.post(
            server.url + urlsplit(action).path, data=fields, allow_redirects=False
        )
    raise AssertionError("the flow did not end in a redirect")


async def post_token(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    data: dict[str, str],
    *,
    auth: tuple[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    """POST /token as a form; `auth` is sent as HTTP Basic with url-encoded id and secret."""
    all_headers = dict(headers or {})
    if auth is not None:
        all_headers["Authorization"] = basic_auth(*auth)
    response = await http.post(server.endpoint("/token"), data=data, headers=all_headers)
    return response.status, await response.json(), response


def basic_auth(client_id: str, secret: str) -> str:
    """RFC 6749 §2.3.1: each part form-url-encoded before the Base64."""
    raw = f"{quote_plus(client_id)}:{quote_plus(secret)}".encode()
    return "Basic " + base64.b64encode(raw).decode()


async def exchange_code(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    result: CodeResult,
    *,
    client_id: str = "spa",
    auth: tuple[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
    }
    if result.verifier:
        data["code_verifier"] = result.verifier
    if auth is None:
        data["client_id"] = client_id
    status, body, _ = await post_token(http, server, data, auth=auth)
    return status, body


async def tokens_for(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    *,
    client_id: str = "spa",
    scope: str = "openid profile email offline_access orders:read",
    auth: tuple[str, str] | None = None,
    username: str = "alice",
) -> dict[str, Any]:
    """Access, refresh and ID token from a full code flow and exchange."""
    result = await authorize_code(http, server, client_id=client_id, scope=scope, username=username)
    status, body = await exchange_code(http, server, result, client_id=client_id, auth=auth)
    assert status == 200, body
    return body


async def client_credentials(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    *,
    client_id: str = "machine",
    secret: str = SECRET,
    **params: str,
) -> tuple[int, dict[str, Any]]:
    status, body, _ = await post_token(
        http, server, {"grant_type": "client_credentials", **params}, auth=(client_id, secret)
    )
    return status, body


async def introspect(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    token: str,
    *,
    auth: tuple[str, str] = ("resource-server", SECRET),
    **params: str,
) -> dict[str, Any]:
    response = await http.post(
        server.endpoint("/introspect"),
        data={"token": token, **params},
        headers={"Authorization": basic_auth(*auth)},
    )
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def fetch_jwks(http: aiohttp.ClientSession, server: RunningAuthServer) -> dict[str, Any]:
    async with http.get(server.endpoint("/jwks")) as response:
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def verify_jwt(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    token: str,
    *,
    audience: str | None = None,
    typ: str | None = None,
) -> dict[str, Any]:
    """Verify a token the server signed against its published JWKS; return the claims."""
    header = jwt.get_unverified_header(token)
    if typ is not None:
        assert header.get("typ") == typ, header
    jwks = await fetch_jwks(http, server)
    matching = [k for k in jwks["keys"] if k["kid"] == header["kid"]]
    assert len(matching) == 1, (header, jwks)
    key = jwt.PyJWK(matching[0])
    claims: dict[str, Any] = jwt.decode(
        token,
        key.key,
        algorithms=[matching[0]["alg"]],
        audience=audience,
        issuer=server.settings.issuer,
        options={
            "verify_aud": audience is not None,
            # PyJWT reads the real time only; a test may have moved the server's clock
            # either way, and the token is judged at the time of the server that signed it.
            "verify_exp": False,
            "verify_iat": False,
            "verify_nbf": False,
        },
    )
    now = server.clock()
    if "exp" in claims and claims["exp"] <= now:
        raise jwt.ExpiredSignatureError(f"expired at {claims['exp']}, the server's time {now}")
    if max(claims.get("iat", 0), claims.get("nbf", 0)) > now:
        raise jwt.ImmatureSignatureError(f"not valid yet at the server's time {now}")
    return claims


def client_assertion(
    audience: str,
    *,
    client_id: str = "machine-jwt",
    key: Any = CLIENT_KEY,
    kid: str = CLIENT_KID,
    lifetime: float = 60,
    now: float | None = None,
    **overrides: Any,
) -> str:
    """An RFC 7523 client assertion signed with the client's key; `overrides` replace claims
    (a None value drops the claim)."""
    issued = time.time() if now is None else now
    claims: dict[str, Any] = {
        "iss": client_id,
        "sub": client_id,
        "aud": audience,
        "jti": uuid.uuid4().hex,
        "iat": int(issued),
        "exp": int(issued + lifetime),
    }
    claims.update(overrides)
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, key, algorithm="ES256", headers={"kid": kid})


JWT_BEARER = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
