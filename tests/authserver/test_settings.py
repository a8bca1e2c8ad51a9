"""authserver.settings: every key validated, every problem reported as FILE:LINE: message, the
client rules of the Security BCP enforced at load."""

from __future__ import annotations

import hashlib
import ipaddress
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from authserver import settings, users
from authserver.settings import Address, KeySettings, Lifetimes, LoginThrottle
from portcullis.yamlconf import ConfigError
from tests.authserver.conftest import PASSWORD_HASH, client_public_jwks

SECRET = "0123456789abcdef0123456789abcdef"

FULL = f"""\
issuer: "https://auth.example.com"
listen: "127.0.0.1:9100"
storage: "sqlite:///var/lib/portcullis/authserver.db"
keys: {{dir: /var/lib/portcullis/keys, access_token_alg: EdDSA, id_token_alg: ES256}}
default_audience: orders-api
lifetimes:
  authorization_code: 30s
  access_token: 10m
  id_token: 15m
  refresh_token_idle: 1d
  refresh_token_absolute: 30d
  session: 2h
refresh_grace: 2s
login_throttle: {{max_failures: 7, max_failures_per_address: 50, window: 10m}}
log_level: debug
scopes:
  - {{name: "orders:read", description: "Read your orders"}}
  - {{name: "orders:write"}}
users:
  - username: alice
    password_hash: "{PASSWORD_HASH}"
    email: alice@example.com
    email_verified: true
    name: Alice
  - {{username: bob, password: builder, sub: user-bob}}
clients:
  - client_id: webapp
    client_name: Example Web App
    client_secret: "${{WEBAPP_SECRET}}"
    token_endpoint_auth_method: client_secret_basic
    redirect_uris: ["https://app.example.com/callback"]
    post_logout_redirect_uris: ["https://app.example.com/"]
    grant_types: [authorization_code, refresh_token]
    scope: "openid profile email offline_access orders:read"
  - client_id: gateway
    client_secret: "{SECRET}"
    grant_types: [client_credentials]
    scope: ""
    introspection: true
  - client_id: signer
    token_endpoint_auth_method: private_key_jwt
    grant_types: [client_credentials]
    scope: "orders:write"
    resources: [billing-api]
    jwks: {{keys: [{{kty: EC, crv: P-256, x: "X_X", y: "Y_Y", kid: k1}}]}}
  - client_id: cli
    redirect_uris: ["http://127.0.0.1/cb", "http://[::1]/cb"]
    skip_consent: true
    scope: openid
  - client_id: legacy
    client_secret: "{SECRET}"
    redirect_uris: ["https://legacy.example/cb"]
    require_pkce: false
    scope: openid
"""


def full_text() -> str:
    jwk = client_public_jwks()["keys"][0]
    return FULL.replace('x: "X_X"', f'x: "{jwk["x"]}"').replace('y: "Y_Y"', f'y: "{jwk["y"]}"')


ENV = {"WEBAPP_SECRET": "webapp-secret-0123456789abcdef-0123456789"}

BASE = """\
issuer: "http://127.0.0.1:9000"
storage: "sqlite:///authserver.db"
keys: {dir: keys}
"""  # three lines: what a test appends starts on line 4


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "authserver.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def problems(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    path = write(tmp_path, text)
    found = settings.check(path, env or {})
    prefix = path + ":"
    assert all(p.startswith(prefix) for p in found), found
    return [p[len(prefix) :] for p in found]


def one_problem(tmp_path: Path, text: str) -> str:
    found = problems(tmp_path, text)
    assert len(found) == 1, found
    return found[0]


# ---------------------------------------------------------------------------- valid configs


def test_minimal_config_loads_with_the_documented_defaults(tmp_path):
    loaded = settings.load(write(tmp_path, BASE), {})
    assert loaded.issuer == "http://127.0.0.1:9000"
    assert loaded.listen == Address("0.0.0.0", 9000)
    assert loaded.keys == KeySettings(dir="keys", access_token_alg="ES256", id_token_alg="RS256")
    assert loaded.lifetimes == Lifetimes(
        authorization_code=timedelta(seconds=60),
        access_token=timedelta(minutes=5),
        id_token=timedelta(minutes=5),
        refresh_token_idle=timedelta(days=14),
        refresh_token_absolute=timedelta(days=90),
        session=timedelta(hours=12),
    )
    assert loaded.login_throttle == LoginThrottle(
        max_failures=5, max_failures_per_address=20, window=timedelta(minutes=15)
    )
    assert loaded.refresh_grace == timedelta(seconds=5)
    assert loaded.admin_listen == Address("127.0.0.1", 9902)
    assert loaded.client_assertion_max_lifetime == timedelta(hours=1)
    assert (loaded.clients, loaded.users, loaded.scopes) == ((), (), ())
    assert loaded.secure_cookies is False


def test_full_config_loads_every_key(tmp_path):
    loaded = settings.load(write(tmp_path, full_text()), ENV)
    assert loaded.listen == Address("127.0.0.1", 9100)
    assert loaded.keys.access_token_alg == "EdDSA" and loaded.keys.id_token_alg == "ES256"
    assert loaded.lifetimes.authorization_code == timedelta(seconds=30)
    assert loaded.lifetimes.id_token == timedelta(minutes=15)
    assert loaded.refresh_grace == timedelta(seconds=2)
    assert loaded.login_throttle == LoginThrottle(7, 50, timedelta(minutes=10))
    assert loaded.secure_cookies is True
    assert loaded.log_level == "debug"

    webapp = loaded.client("webapp")
    assert webapp is not None
    assert webapp.client_name == "Example Web App"
    assert webapp.client_secret_sha256 == hashlib.sha256(ENV["WEBAPP_SECRET"].encode()).digest()
    assert ENV["WEBAPP_SECRET"] not in repr(loaded)
    assert webapp.redirect_uris == ("https://app.example.com/callback",)
    assert webapp.post_logout_redirect_uris == ("https://app.example.com/",)
    assert webapp.scope == ("openid", "profile", "email", "offline_access", "orders:read")
    assert webapp.require_pkce and not webapp.skip_consent and not webapp.public

    signer = loaded.client("signer")
    assert signer is not None and signer.jwks is not None
    assert signer.token_endpoint_auth_method == "private_key_jwt"
    assert signer.client_secret_sha256 is None
    assert signer.resources == ("billing-api",)

    cli = loaded.client("cli")
    assert cli is not None and cli.public and cli.skip_consent
    assert cli.grant_types == ("authorization_code",)
    assert loaded.client("gateway").introspection is True
    assert loaded.client("legacy").require_pkce is False
    assert loaded.client("nobody") is None

    assert loaded.scope_description("orders:read") == "Read your orders"
    assert loaded.scope_description("orders:write") == "orders:write"
    assert loaded.scope_description("email") == "Know your email address"


def test_users_get_stable_opaque_subjects_and_hashed_passwords(tmp_path):
    loaded = settings.load(write(tmp_path, full_text()), ENV)
    alice, bob = loaded.user("alice"), loaded.user("bob")
    assert alice is not None and bob is not None
    subject = loaded.subject_of(alice)
    assert subject == settings.default_subject("https://auth.example.com", "alice")
    assert "alice" not in subject and "@" not in subject
    again = settings.load(write(tmp_path, full_text()), ENV)
    assert again.subject_of(again.user("alice")) == subject
    assert alice.claims == {"email": "alice@example.com", "email_verified": True, "name": "Alice"}
    assert loaded.user_by_subject(subject) is alice
    assert loaded.subject_of(bob) == "user-bob"
    assert users.is_hash(bob.password_hash)
    assert users.verify_password("builder", bob.password_hash)
    assert not users.verify_password("Builder", bob.password_hash)
    assert "builder" not in repr(loaded)


def test_plain_text_password_is_hashed_with_a_warning(tmp_path, caplog):
    text = BASE + "users: [{username: carol, password: s3cret}]\n"
    with caplog.at_level("WARNING", logger="portcullis.authserver.settings"):
        loaded = settings.load(write(tmp_path, text), {})
    assert "plain-text password" in caplog.text
    assert "s3cret" not in caplog.text
    assert users.verify_password("s3cret", loaded.user("carol").password_hash)


# ---------------------------------------------------------------------------- the top level


def test_required_keys_are_reported_at_the_top(tmp_path):
    found = problems(tmp_path, "log_level: info\n")
    assert found == [
        "1: config: issuer is required",
        "1: config: storage is required",
        "1: config: keys is required",
    ]


def test_unknown_keys_are_reported_with_their_line_at_every_level(tmp_path):
    text = BASE.replace("keys: {dir: keys}", "keys: {dir: keys, algo: ES256}") + textwrap.dedent(
        """\
        isuer: "http://127.0.0.1:9000"
        lifetimes:
          acess_token: 5m
        login_throttle: {max_failure: 3}
        scopes:
          - {name: "orders:read", desc: "Read"}
        users:
          - username: alice
            password_hash: "PH"
            pasword: x
        clients:
          - client_id: app
            token_endpoint_auth_method: none
            redirect_uri: "http://127.0.0.1/cb"
            redirect_uris: ["http://127.0.0.1/cb"]
        """
    ).replace("PH", PASSWORD_HASH)
    found = problems(tmp_path, text)
    expected = [
        (3, "keys: unknown key 'algo'"),
        (4, "config: unknown key 'isuer'"),
        (6, "lifetimes: unknown key 'acess_token'"),
        (7, "login_throttle: unknown key 'max_failure'"),
        (9, "scopes[0]: unknown key 'desc'"),
        (13, "users[0]: unknown key 'pasword'"),
        (17, "client 'app': unknown key 'redirect_uri'"),
    ]
    assert len(found) == len(expected), found
    for problem, (line, message) in zip(found, expected, strict=True):
        assert problem.startswith(f"{line}: {message}; known keys: "), problem


def test_every_problem_is_reported_at_once_in_line_order(tmp_path):
    text = textwrap.dedent(
        """\
        issuer: "http://auth.example.com"
        storage: "mysql://db"
        keys: {dir: keys, access_token_alg: HS256}
        listen: "nowhere"
        lifetimes: {access_token: 5}
        """
    )
    found = problems(tmp_path, text)
    assert [p.split(":")[0] for p in found] == ["1", "2", "3", "4", "5"]
    assert "must be https" in found[0]
    assert "sqlite:///PATH or postgresql://" in found[1]
    assert "'HS256' is not one of ES256, RS256, EdDSA" in found[2]
    assert "'nowhere' is not host:port" in found[3]
    assert "5 is not a duration" in found[4]


@pytest.mark.parametrize(
    ("issuer", "message"),
    [
        ("http://auth.example.com", "must be https"),
        ("https://auth.example.com/", "trailing slash"),
        ("https://auth.example.com?x=1", "no query"),
        ("https://auth.example.com#top", "no query, fragment"),
        ("auth.example.com", "is not an https URL"),
    ],
)
def test_issuer_must_be_an_https_url_without_query_fragment_or_trailing_slash(
    tmp_path, issuer, message
):
    problem = one_problem(tmp_path, BASE.replace("http://127.0.0.1:9000", issuer))
    assert problem.startswith("1: config.issuer: ")
    assert message in problem


@pytest.mark.parametrize(
    "issuer", ["http://localhost:9000", "http://[::1]:9000", "https://a.example/tenant"]
)
def test_issuer_may_be_plain_http_on_loopback_and_may_have_a_path(tmp_path, issuer):
    loaded = settings.load(write(tmp_path, BASE.replace("http://127.0.0.1:9000", issuer)), {})
    assert loaded.issuer == issuer


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "lifetimes: {refresh_token_idle: 30d, refresh_token_absolute: 7d}",
            "refresh_token_idle exceeds",
        ),
        ("lifetimes: {session: forever}", "lifetimes.session: 'forever' is not a duration"),
        ("refresh_grace: 1m", "refresh_grace: at most 10s"),
        ("login_throttle: {max_failures: 0}", "login_throttle.max_failures: must be at least 1"),
        (
            "login_throttle: {max_failures_per_address: 0}",
            "max_failures_per_address: must be at least 1",
        ),
        ("login_throttle: {window: 0}", "login_throttle.window: must be more than 0s"),
        ("login_throttle: [3]", "login_throttle must be a mapping"),
        ("login_throttle: {backoff_after: 0}", "login_throttle.backoff_after: must be at least 1"),
        ("login_throttle: {backoff_max: 500ms}", "login_throttle.backoff_max: must be at least 1s"),
        ("trusted_proxies: [10.0.0.0/8, proxy]", "'proxy' is not an IP address or network"),
        ("trusted_proxies: 10.0.0.0/8", "trusted_proxies must be a list"),
        ("log_level: loud", "'loud' is not one of debug, info, warning, error"),
        ("default_audience: ''", "default_audience: must not be empty"),
        ("scopes: {name: x}", "scopes must be a list"),
        ("admin_listen: 9902", "admin_listen: expected a string, got int 9902"),
        ('admin_listen: "127.0.0.1"', "is not host:port"),
        ('admin_listen: "0.0.0.0:9000"', "admin_listen must differ from listen"),
        ("client_assertion_max_lifetime: 0s", "between 1s and 1d"),
        ("client_assertion_max_lifetime: 2d", "between 1s and 1d"),
        ("client_assertion_max_lifetime: soon", "'soon' is not a duration"),
    ],
)
def test_invalid_values_are_reported_on_their_line(tmp_path, section, message):
    problem = one_problem(tmp_path, BASE + section + "\n")
    assert problem.startswith("4: "), problem
    assert message in problem


def test_password_hashing_loads_its_pool_and_queue_with_small_defaults(tmp_path):
    assert settings.load(write(tmp_path, BASE), {}).password_hashing == (
        settings.PasswordHashing(workers=2, max_waiting=16)
    )
    text = BASE + "password_hashing: {workers: 4, max_waiting: 0}\n"
    loaded = settings.load(write(tmp_path, text), {})
    assert loaded.password_hashing == settings.PasswordHashing(workers=4, max_waiting=0)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("password_hashing: {workers: 0}", "password_hashing.workers: must be at least 1"),
        ("password_hashing: {max_waiting: -1}", "password_hashing.max_waiting: must be at least 0"),
        ("password_hashing: {queue: 3}", "password_hashing"),
        ("password_hashing: 4", "password_hashing must be a mapping"),
    ],
)
def test_invalid_password_hashing_is_reported_on_its_line(tmp_path, section, message):
    problem = one_problem(tmp_path, BASE + section + "\n")
    assert problem.startswith("4: "), problem
    assert message in problem


def test_login_backoff_and_trusted_proxies_load_from_their_keys(tmp_path):
    text = BASE + textwrap.dedent(
        """\
        login_throttle: {backoff_after: 30, backoff_max: 5m}
        trusted_proxies: [10.0.0.0/8, "192.0.2.7", "2001:db8::/32"]
        """
    )
    loaded = settings.load(write(tmp_path, text), {})
    assert loaded.login_throttle == LoginThrottle(
        backoff_after=30, backoff_max=timedelta(minutes=5)
    )
    assert loaded.trusted_proxies == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("192.0.2.7/32"),
        ipaddress.ip_network("2001:db8::/32"),
    )
    assert settings.load(write(tmp_path, BASE), {}).trusted_proxies == ()


def test_a_missing_environment_variable_is_reported_on_its_line(tmp_path):
    text = BASE + textwrap.dedent(
        """\
        clients:
          - {client_id: m, client_secret: "${NOT_SET}", grant_types: [client_credentials]}
        """
    )
    found = problems(tmp_path, text)
    assert found == ["5: environment variable NOT_SET is not set (use ${NOT_SET:-default})"]


# ---------------------------------------------------------------------------- scopes and users


def test_scope_names_must_be_scope_tokens_and_unique(tmp_path):
    text = BASE + textwrap.dedent(
        """\
        scopes:
          - {name: "orders read"}
          - {name: "orders:read"}
          - {name: "orders:read"}
        """
    )
    found = problems(tmp_path, text)
    assert found[0].startswith("5: scopes[0].name: 'orders read' is not a scope token")
    assert found[1] == "7: scopes[2]: scope 'orders:read' is listed twice"
    assert len(found) == 2


@pytest.mark.parametrize(
    ("user", "line", "message"),
    [
        ("{username: carol}", 5, "users[0]: give password_hash (or password for development)"),
        (
            '{username: carol, password_hash: "md5$abc"}',
            5,
            "users[0].password_hash: not a scrypt hash",
        ),
        (
            '{username: carol, password: x, password_hash: "PH"}',
            5,
            "give password_hash or password, not both",
        ),
        ("{password: x}", 5, "users[0]: username is required"),
    ],
)
def test_user_entries_are_checked(tmp_path, user, line, message):
    problem = one_problem(
        tmp_path, BASE + "users:\n  - " + user.replace("PH", PASSWORD_HASH) + "\n"
    )
    assert problem.startswith(f"{line}: ")
    assert message in problem


def test_a_username_listed_twice_is_reported(tmp_path):
    user = f'{{username: a, password_hash: "{PASSWORD_HASH}"}}'
    text = BASE + f"users:\n  - {user}\n  - {user}\n"
    assert one_problem(tmp_path, text) == "6: users[1]: username 'a' is listed twice"


# ---------------------------------------------------------------------------- clients


def client_problem(tmp_path: Path, *lines: str) -> str:
    """The one problem of a config whose only client is `lines` (line 5 is its first key)."""
    text = BASE + "clients:\n  - " + "\n    ".join(lines) + "\n"
    return one_problem(tmp_path, text)


PUBLIC = (
    "client_id: app",
    "token_endpoint_auth_method: none",
    'redirect_uris: ["http://127.0.0.1/cb"]',
)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            (*PUBLIC, "require_pkce: false"),
            "8: client 'app': public clients always use PKCE",
        ),
        (
            (
                "client_id: app",
                'client_secret: "short-secret"',
                "grant_types: [client_credentials]",
            ),
            "6: client 'app'.client_secret: use at least 32 random characters",
        ),
        (
            (
                "client_id: app",
                f'client_secret: "{SECRET}"',
                'redirect_uris: ["http://app.example.com/cb"]',
            ),
            "7: client 'app'.redirect_uris[0]: 'http://app.example.com/cb': plain http"
            " redirects are for loopback only",
        ),
        (
            (
                "client_id: app",
                f'client_secret: "{SECRET}"',
                'redirect_uris: ["https://app.example.com/cb#x"]',
            ),
            "7: client 'app'.redirect_uris[0]: 'https://app.example.com/cb#x' must not contain"
            " a fragment",
        ),
        (
            ("client_id: app", f'client_secret: "{SECRET}"', 'redirect_uris: ["/cb"]'),
            "7: client 'app'.redirect_uris[0]: '/cb' is not an absolute URI",
        ),
        (
            (*PUBLIC, 'post_logout_redirect_uris: ["http://app.example.com/"]'),
            "8: client 'app'.post_logout_redirect_uris[0]: 'http://app.example.com/': plain http",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: private_key_jwt",
                "grant_types: [client_credentials]",
            ),
            "5: client 'app': private_key_jwt needs jwks",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: private_key_jwt",
                "grant_types: [client_credentials]",
                "jwks: {keys: []}",
            ),
            "8: client 'app'.jwks: must be a JWK Set",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: private_key_jwt",
                "grant_types: [client_credentials]",
                "jwks: {keys: [{kty: EC, crv: P-256, x: AAAA, y: AAAA}]}",
            ),
            "8: client 'app'.jwks: keys[0] is not a usable public key",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: private_key_jwt",
                "grant_types: [client_credentials]",
                "jwks: {keys: [{kty: EC, crv: P-256, x: AAAA, y: AAAA, d: AAAA}]}",
            ),
            "8: client 'app'.jwks: keys[0] holds private key material",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: client_secret_post",
                "grant_types: [client_credentials]",
            ),
            "5: client 'app': client_secret_post needs client_secret",
        ),
        (
            (*PUBLIC, f'client_secret: "{SECRET}"'),
            "8: client 'app': none clients have no secret",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: none",
                "grant_types: [client_credentials]",
            ),
            "7: client 'app': client_credentials needs a confidential client",
        ),
        (
            ("client_id: app", "token_endpoint_auth_method: none"),
            "5: client 'app': authorization_code needs redirect_uris",
        ),
        (
            (*PUBLIC, "grant_types: [implicit]"),
            "8: client 'app'.grant_types[0]: 'implicit' is not one of",
        ),
        (
            (*PUBLIC, "grant_types: [password]"),
            "8: client 'app'.grant_types[0]: 'password' is not one of",
        ),
        (
            (
                "client_id: app",
                "token_endpoint_auth_method: client_secret_jwt",
                f'client_secret: "{SECRET}"',
                "grant_types: [client_credentials]",
            ),
            "6: client 'app'.token_endpoint_auth_method: 'client_secret_jwt' is not one of",
        ),
        (
            (*PUBLIC, "scope: openid orders:delete"),
            "8: client 'app'.scope: 'orders:delete' is not in the scopes list",
        ),
        (
            (*PUBLIC, "application_type: mobile"),
            "8: client 'app'.application_type: 'mobile' is not one of web, native",
        ),
        (
            (*PUBLIC, "skip_consent: yes please"),
            "8: client 'app'.skip_consent: expected true or false",
        ),
        (
            (
                "client_id: 'app one'",
                "token_endpoint_auth_method: none",
                'redirect_uris: ["http://127.0.0.1/cb"]',
            ),
            "5: client 'app one': client_id must be printable ASCII",
        ),
    ],
)
def test_client_rules_are_enforced_with_file_and_line(tmp_path, lines, expected):
    problem = client_problem(tmp_path, *lines)
    assert problem.startswith(expected), problem


def test_a_confidential_client_may_drop_pkce_for_legacy_openid_connect(tmp_path):
    text = BASE + textwrap.dedent(
        f"""\
        clients:
          - client_id: old
            client_secret: "{SECRET}"
            redirect_uris: ["https://old.example/cb"]
            require_pkce: false
            scope: openid
        """
    )
    loaded = settings.load(write(tmp_path, text), {})
    assert loaded.client("old").require_pkce is False


def test_loopback_redirects_may_be_plain_http(tmp_path):
    uris = '["http://127.0.0.1/cb", "http://[::1]:8000/cb", "http://localhost/cb"]'
    text = BASE + f"clients:\n  - {{client_id: cli, redirect_uris: {uris}}}\n"
    loaded = settings.load(write(tmp_path, text), {})
    assert len(loaded.client("cli").redirect_uris) == 3


def test_application_type_is_web_unless_native_and_only_public_native_apps_get_any_port(
    tmp_path,
):
    uris = '["http://127.0.0.1/cb"]'
    text = BASE + textwrap.dedent(
        f"""\
        clients:
          - {{client_id: site, token_endpoint_auth_method: none, redirect_uris: {uris}}}
          - {{client_id: cli, application_type: native, redirect_uris: {uris}}}
          - client_id: kiosk
            application_type: native
            client_secret: "{SECRET}"
            redirect_uris: {uris}
          - {{client_id: portal, application_type: web, client_secret: "{SECRET}",
              redirect_uris: {uris}}}
        """
    )
    loaded = settings.load(write(tmp_path, text), {})
    kinds = {
        c.client_id: (c.application_type, c.public, c.loopback_any_port) for c in loaded.clients
    }
    assert kinds == {
        "site": ("web", True, False),
        "cli": ("native", True, True),
        # A native app holding a secret is allowed, but its redirects match exactly.
        "kiosk": ("native", False, False),
        "portal": ("web", False, False),
    }


def test_a_client_id_listed_twice_is_reported(tmp_path):
    client = f'{{client_id: m, client_secret: "{SECRET}", grant_types: [client_credentials]}}'
    text = BASE + f"clients:\n  - {client}\n  - {client}\n"
    assert one_problem(tmp_path, text) == "6: client 'm': client_id is listed twice"


# ---------------------------------------------------------------------------- CORS


def test_cors_origins_load_as_browsers_send_them(tmp_path):
    text = BASE + textwrap.dedent(
        """\
        cors:
          allow_origins: ["HTTPS://App.Example.com:443", "https://tv.example:8443", "http://[::1]:8083"]
        """
    )
    loaded = settings.load(write(tmp_path, text), {})
    assert loaded.cors.allow_origins == (
        "https://app.example.com",
        "https://tv.example:8443",
        "http://[::1]:8083",
    )
    assert settings.load(write(tmp_path, BASE), {}).cors.allow_origins == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"*"', "'*' is not allowed: the token endpoint never answers every origin"),
        ('"https://app.example.com/"', "is not an origin"),
        ('"https://app.example.com/spa"', "is not an origin"),
        ('"https://user@app.example.com"', "is not an origin"),
        ('"null"', "is not an origin"),
        ('"app.example.com"', "is not an origin"),
        ('"http://app.example.com"', "plain http origins are for loopback only"),
    ],
)
def test_cors_origins_that_are_no_origin_or_would_expose_tokens_are_reported(
    tmp_path, value, message
):
    problem = one_problem(tmp_path, BASE + f"cors:\n  allow_origins:\n    - {value}\n")
    assert problem.startswith("6: cors.allow_origins[0]: "), problem
    assert message in problem


def test_cors_accepts_only_its_documented_key(tmp_path):
    problem = one_problem(tmp_path, BASE + "cors:\n  allow_methods: [GET]\n")
    assert problem.startswith("5: "), problem
    assert "allow_methods" in problem


def test_load_raises_config_error_with_every_problem(tmp_path):
    with pytest.raises(ConfigError) as caught:
        settings.load(write(tmp_path, "issuer: 5\nstorage: x\nkeys: {dir: k}\n"), {})
    assert [p.line for p in caught.value.problems] == [1, 2]
    assert str(caught.value).startswith(str(tmp_path / "authserver.yaml") + ":1: ")


def test_an_unreadable_file_is_reported(tmp_path):
    found = settings.check(str(tmp_path / "missing.yaml"), {})
    assert found == [f"{tmp_path / 'missing.yaml'}:0: cannot read: No such file or directory"]


# ---------------------------------------------------------------------------- identity providers

PROVIDER = """\
identity_providers:
  - name: corp
    issuer: "https://login.corp.example"
    client_id: portcullis
    client_secret: "a-secret-the-provider-gave-this-server"
"""


def test_an_identity_provider_loads_with_its_defaults(tmp_path):
    (provider,) = settings.load(write(tmp_path, BASE + PROVIDER), {}).identity_providers
    assert (provider.name, provider.display_name, provider.issuer) == (
        "corp",
        "corp",
        "https://login.corp.example",
    )
    assert provider.token_endpoint_auth_method == "client_secret_basic"
    assert provider.scopes == ("openid", "email", "profile")
    assert (provider.claims.username, provider.claims.email, provider.claims.name) == (
        "preferred_username",
        "email",
        "name",
    )
    assert provider.link_by_verified_email_domains == ()  # never linked unless the operator says
    assert provider.timeout == timedelta(seconds=5)
    assert "a-secret" not in repr(provider)


def test_an_identity_provider_with_a_key_file_uses_private_key_jwt(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "corp.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tmp_path / "secret").write_text("from-a-file-0123456789abcdef\n")
    text = (
        BASE
        + f"""\
identity_providers:
  - name: corp
    display_name: Corp directory
    issuer: "https://login.corp.example"
    client_id: portcullis
    private_key_file: {tmp_path / "corp.pem"}
    scopes: [openid, email]
    claims: {{username: sub, email: mail, name: displayName}}
    link_by_verified_email_domains: [Example.COM, corp.example.org]
  - name: other
    issuer: "http://127.0.0.1:4000"
    client_id: portcullis
    client_secret_file: {tmp_path / "secret"}
    token_endpoint_auth_method: client_secret_post
"""
    )
    corp, other = settings.load(write(tmp_path, text), {}).identity_providers
    assert corp.token_endpoint_auth_method == "private_key_jwt"
    assert corp.display_name == "Corp directory"
    assert corp.claims.email == "mail"
    assert corp.link_by_verified_email_domains == ("example.com", "corp.example.org")
    assert other.client_secret == "from-a-file-0123456789abcdef"
    assert other.token_endpoint_auth_method == "client_secret_post"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("name: corp|name: Corp", "5: identity provider 'Corp'.name: 'Corp': lower-case"),
        (
            "https://login|http://login",
            "6: identity provider 'corp'.issuer: the issuer must be https",
        ),
        ("    scopes: [email, profile]\n", "identity provider 'corp'.scopes: must include openid"),
        ("    link_by_verified_email_domains: ['*.example.com']\n", "is not a domain name"),
        ("    link_by_verified_email_domains: [alice@example.com]\n", "is not a domain name"),
        (
            'client_secret: "a-secret-the-provider-gave-this-server"'
            "|token_endpoint_auth_method: private_key_jwt",
            "5: identity provider 'corp': private_key_jwt needs private_key_file",
        ),
        (
            "    private_key_file: /nonexistent/key.pem\n"
            "    token_endpoint_auth_method: client_secret_post\n",
            "9: identity provider 'corp': client_secret_post uses client_secret, not a key",
        ),
        ("    timeout: 1m\n", "timeout: must be at most 30s"),
        ("    color: blue\n", "color"),
    ],
)
def test_identity_provider_problems_are_reported_on_their_line(tmp_path, lines, expected):
    """`lines` are appended to the provider, or replace what stands before `|` with what follows."""
    old, _, new = lines.rpartition("|")
    found = problems(tmp_path, BASE + (PROVIDER.replace(old, new) if old else PROVIDER + lines))
    assert len(found) == 1, found
    assert expected in found[0], found


def test_an_identity_provider_needs_a_secret_or_a_readable_key(tmp_path):
    no_secret = BASE + PROVIDER.replace(
        '    client_secret: "a-secret-the-provider-gave-this-server"\n', ""
    )
    assert problems(tmp_path, no_secret) == [
        "5: identity provider 'corp': client_secret_basic needs client_secret"
        " (or client_secret_file)"
    ]
    (tmp_path / "bad.pem").write_text("not a key")
    keyed = no_secret + f"    private_key_file: {tmp_path / 'bad.pem'}\n"
    (problem,) = problems(tmp_path, keyed)
    assert problem.startswith("8: ") and "not an unencrypted PEM private key" in problem
    missing = no_secret + "    private_key_file: /nonexistent/key.pem\n"
    (problem,) = problems(tmp_path, missing)
    assert problem.startswith("8: ") and "cannot read /nonexistent/key.pem" in problem


def test_identity_providers_are_named_once_and_trusted_once(tmp_path):
    text = (
        BASE
        + PROVIDER
        + PROVIDER.replace("identity_providers:\n", "").replace("login.corp", "other.corp")
        + PROVIDER.replace("identity_providers:\n", "").replace("name: corp", "name: second")
    )
    found = problems(tmp_path, text)
    assert found == [
        "9: identity provider 'corp': identity provider 'corp' is listed twice",
        "13: identity provider 'second': issuer 'https://login.corp.example' is listed twice",
    ], found


# ---------------------------------------------------------------------------- password sign-in


def test_password_sign_in_is_on_unless_turned_off(tmp_path):
    assert settings.load(write(tmp_path, BASE), {}).password_sign_in is True
    loaded = settings.load(write(tmp_path, BASE + "password_sign_in: false\n" + PROVIDER), {})
    assert loaded.password_sign_in is False


def test_password_sign_in_off_needs_a_provider_or_passkeys(tmp_path):
    """Without passwords, a provider or passkeys (an issuer browsers run WebAuthn for) is the
    only way in: with neither, nobody could sign in, and loading says what is missing."""
    (found,) = problems(tmp_path, BASE + "password_sign_in: false\n")
    assert found.startswith("4: config.password_sign_in: false leaves nobody a way to sign in")
    assert "identity_providers" in found and "passkeys" in found
    for issuer in ("https://auth.example.com", "http://localhost:9000"):
        text = BASE.replace("http://127.0.0.1:9000", issuer) + "password_sign_in: false\n"
        assert settings.load(write(tmp_path, text), {}).password_sign_in is False
