"""`python -m gateway check|explain` run as a real process, as an operator would run it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

from gateway.steps.ratelimit import BUCKET_BYTES
from gateway.verifiers.cache import ENTRY_BYTES
from gateway.verifiers.introspection import ACTIVE_ENTRY_BYTES, INACTIVE_ENTRY_BYTES
from tests.support import TestIssuer


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTCULLIS_TEST_")}
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


async def gateway_cli(
    *args: str, env: dict[str, str] | None = None, module: str | None = "gateway"
) -> Outcome:
    """Run the CLI without blocking this event loop, so a TestIssuer in it can answer
    (`module=None`: the arguments start with the interpreter's own, such as `-c CODE`)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *(("-m", module) if module else ()),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or child_env(),
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return Outcome(process.returncode, stdout.decode(), stderr.decode())


def write(tmp_path: Path, text: str, name: str = "gateway.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def line_of(text: str, marker: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)


def explain_config(issuer_url: str) -> str:
    return f"""\
upstream: {{url: "http://127.0.0.1:9"}}
issuers:
  - issuer: "{issuer_url}"
    audiences: [orders-api]
    algorithms: [ES256]
jwks: {{fetch_timeout: 2s}}
limits: {{max_body_size: 1MiB}}
routes:
  - {{name: health, path: /healthz, auth: none}}
  - name: orders-write
    path: "/orders/{{id}}"
    methods: [PUT]
    scopes: {{all: ["orders:write", "orders:read"]}}
  - {{name: orders-read, path: "/orders/**", methods: [GET], scopes: {{any: ["orders:read"]}}}}
"""


# ---------------------------------------------------------------------------- version


async def test_version_is_the_installed_distributions() -> None:
    result = await gateway_cli("--version")
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout == f"portcullis-gateway {metadata.version('portcullis')}\n"


# ---------------------------------------------------------------------------- check


async def test_check_of_a_valid_file_exits_zero_and_says_ok(tmp_path: Path) -> None:
    path = write(tmp_path, explain_config("https://auth.example.com"))
    result = await gateway_cli("check", "--config", path)
    assert (result.code, result.stderr) == (0, "")
    ok, memory = result.stdout.splitlines()
    assert ok == f"{path}: OK"
    assert memory.startswith("worst-case memory: about ")


async def test_check_of_a_broken_file_prints_every_problem_as_file_line_message(
    tmp_path: Path,
) -> None:
    text = """\
listen: "0.0.0.0:8080"
admin_listen: "0.0.0.0:8080"
upstream: {url: "${PORTCULLIS_TEST_UPSTREAM:-http://127.0.0.1:8081}", read_timeout: 30}
issuers:
  - issuer: "http://auth.example.com"
    audiences: [api]
    algorithms: [HS256]
routes:
  - {name: all, path: "/**"}
  - {name: orders, path: "/orders/{id}", methods: [get]}
  - {name: bad, path: "/a/**/b", colour: red}
"""
    path = write(tmp_path, text)
    result = await gateway_cli("check", "--config", path)
    assert result.code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [
        f"{path}:2",
        f"{path}:3",
        f"{path}:5",
        f"{path}:7",
        f"{path}:10",
        f"{path}:10",
        f"{path}:11",
        f"{path}:11",
    ]
    assert lines[0] == f"{path}:2: admin_listen must differ from listen"
    assert lines[1].startswith(f"{path}:3: upstream.read_timeout: 30 is not a duration")
    assert "uses plain http" in lines[2]
    assert "HS256 cannot be used" in lines[3]
    assert "'get' is not an HTTP method in upper case" in lines[4]
    assert "route 'orders' is shadowed by route 'all' (line 9)" in lines[5]
    assert "** may only be the last segment" in lines[6]
    assert "unknown key 'colour'" in lines[7]


async def test_check_warns_of_a_public_rule_taking_case_variants_of_a_protected_one(
    tmp_path: Path,
) -> None:
    text = explain_config("https://auth.example.com").replace(
        "  - {name: health, path: /healthz, auth: none}\n",
        "  - {name: health, path: /healthz, auth: none}\n"
        '  - {name: internal, path: "/docs/internal/**"}\n'
        '  - {name: docs, path: "/docs/**", auth: none}\n',
    )
    path = write(tmp_path, text)
    result = await gateway_cli("check", "--config", path)
    assert (result.code, result.stdout.splitlines()[0]) == (0, f"{path}: OK")
    assert result.stderr == (
        f"{path}:{line_of(text, 'name: docs')}: warning: route 'docs' (auth: none) takes "
        "GET /docs/INTERNAL, which differs only in letter case from paths of the protected "
        f"route 'internal' (line {line_of(text, 'name: internal')}); if the upstream ignores "
        "case it serves both as one resource: set upstream.path_case: insensitive\n"
    )
    ignoring = write(tmp_path, text.replace('9"}', '9", path_case: insensitive}'), "ci.yaml")
    quiet = await gateway_cli("check", "--config", ignoring)
    assert (quiet.code, quiet.stdout.splitlines()[0], quiet.stderr) == (0, f"{ignoring}: OK", "")


def worst_case_mib(outcome: Outcome) -> int:
    """The figure of the `worst-case memory: about N MiB (...)` line of a check."""
    assert outcome.code == 0, outcome.stderr
    (line,) = [line for line in outcome.stdout.splitlines() if line.startswith("worst-case")]
    found = re.fullmatch(r"worst-case memory: about (\d+) MiB \((.+)\)", line)
    assert found is not None, line
    return int(found.group(1))


async def test_check_prints_the_worst_case_memory_which_grows_with_the_cache_sizes(
    tmp_path: Path,
) -> None:
    async def check(extra: str, introspection: str = "") -> tuple[int, str]:
        text = explain_config("https://auth.example.com").replace(
            "    algorithms: [ES256]\n", "    algorithms: [ES256]\n" + introspection
        )
        path = write(tmp_path, extra + text)
        outcome = await gateway_cli("check", "--config", path)
        return worst_case_mib(outcome), outcome.stdout

    small = "token_cache_size: 1000\n"
    base, stdout = await check(small)
    assert "token cache 1000 × 2.4 KiB" in stdout
    assert "client connections 10000 × " in stdout  # limits.max_connections, the default
    assert "rate-limit buckets" not in stdout and "introspection" not in stdout

    def grew(by_entries: int, each: int) -> int:
        return round(by_entries * each / (1024 * 1024))

    tokens, stdout = await check("token_cache_size: 201000\n")
    assert "token cache 201000 × 2.4 KiB" in stdout
    assert abs(tokens - base - grew(200_000, ENTRY_BYTES)) <= 1

    limited = small + "rate_limits: {default: {rate: 10/s, burst: 20}, max_keys: 200000}\n"
    buckets, stdout = await check(limited)
    assert "rate-limit buckets 200000 × " in stdout
    assert abs(buckets - base - grew(200_000, BUCKET_BYTES)) <= 1

    asked = (
        "    mode: auto\n    introspection: {client_id: gw, client_secret: s, cache_size: 50000}\n"
    )
    introspected, stdout = await check(small, asked)
    assert "introspection cache 50000 × " in stdout
    grown = grew(50_000, ACTIVE_ENTRY_BYTES + INACTIVE_ENTRY_BYTES)
    assert abs(introspected - base - grown) <= 2

    workers, stdout = await check(small + "workers: 3\n")
    assert "3 workers × " in stdout
    assert workers > 3 * base


async def test_check_reports_an_unset_environment_variable_with_its_line(tmp_path: Path) -> None:
    text = explain_config("${PORTCULLIS_TEST_ISSUER}")
    path = write(tmp_path, text)
    result = await gateway_cli("check", "--config", path)
    assert result.code == 1
    assert result.stderr == (
        f"{path}:3: environment variable PORTCULLIS_TEST_ISSUER is not set "
        "(use ${PORTCULLIS_TEST_ISSUER:-default})\n"
    )
    fixed = await gateway_cli(
        "check",
        "--config",
        path,
        env=child_env(PORTCULLIS_TEST_ISSUER="https://auth.example.com"),
    )
    assert (fixed.code, fixed.stderr) == (0, "")


def introspecting_config(secret: str) -> str:
    """A config whose introspection credentials come from `secret` (YAML text of the key)."""
    return f"""\
upstream: {{url: "http://127.0.0.1:9"}}
issuers:
  - issuer: "https://auth.example.com"
    audiences: [orders-api]
    mode: auto
    introspection:
      client_id: gateway
      {secret}
routes:
  - {{name: all, path: "/**"}}
"""


# The CLI in a Python where `import redis` fails, as where the redis extra is not installed
# (a None in sys.modules stops the import).
WITHOUT_REDIS = (
    "import sys; sys.modules['redis'] = None; "
    "from gateway.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


async def test_check_reports_redis_backends_without_their_driver_as_run_would_meet_them(
    tmp_path: Path,
) -> None:
    redis = "redis://127.0.0.1:9/0"
    text = introspecting_config(f'client_secret: "s"\n      cache: "{redis}"') + (
        f'rate_limits: {{backend: "{redis}"}}\n'
    )
    path = write(tmp_path, text)
    why = "which cannot be imported here (import of redis halted; None in sys.modules)"
    expected = [
        f"{path}:{line_of(text, 'cache:')}: issuers[0].introspection.cache: "
        f"a Redis cache needs redis, {why}: install portcullis[redis]",
        f"{path}:{line_of(text, 'backend:')}: rate_limits.backend: "
        f"a Redis backend needs redis, {why}: install portcullis[redis]",
    ]
    for command in ("check", "run"):
        result = await gateway_cli("-c", WITHOUT_REDIS, command, "--config", path, module=None)
        assert (result.code, result.stderr.splitlines()) == (1, expected), command
    # Explaining a rule without a token serves nothing: it needs no driver.
    explained = await gateway_cli(
        "-c", WITHOUT_REDIS, "explain", "--config", path, "GET", "/x", module=None
    )
    assert (explained.code, explained.stderr) == (0, "")
    # With the driver there, the same file passes (check connects to no Redis).
    installed = await gateway_cli("check", "--config", path)
    assert (installed.code, installed.stderr) == (0, "")


async def test_check_reports_a_missing_secret_file_on_the_line_of_the_value(
    tmp_path: Path,
) -> None:
    absent = tmp_path / "run" / "secrets" / "gateway"
    for secret in (f'client_secret_file: "{absent}"', f'client_secret: "${{file:{absent}}}"'):
        text = introspecting_config(secret)
        path = write(tmp_path, text)
        result = await gateway_cli("check", "--config", path)
        assert result.code == 1
        [problem] = result.stderr.splitlines()
        assert problem.startswith(f"{path}:{line_of(text, 'client_secret')}: ")
        assert problem.endswith(f"cannot read {absent}: No such file or directory")

    absent.parent.mkdir(parents=True)
    absent.write_text("gateway-secret\n")
    fixed = await gateway_cli("check", "--config", path)
    assert (fixed.code, fixed.stderr) == (0, "")


async def test_the_config_file_may_be_named_by_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, explain_config("https://auth.example.com"))
    env = child_env(PORTCULLIS_GATEWAY_CONFIG=path)
    result = await gateway_cli("check", env=env)
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[0] == f"{path}: OK"
    explained = await gateway_cli("explain", "GET", "/healthz", env=env)
    assert explained.code == 0 and "route: health" in explained.stdout

    # --config wins over the variable.
    other = write(tmp_path, "routes: []\n", "other.yaml")
    overridden = await gateway_cli("check", "--config", other, env=env)
    assert overridden.code == 1 and overridden.stderr.startswith(f"{other}:")


async def test_without_config_or_variable_the_cli_says_how_to_name_the_file() -> None:
    env = {k: v for k, v in child_env().items() if k != "PORTCULLIS_GATEWAY_CONFIG"}
    result = await gateway_cli("check", env=env)
    assert result.code == 2
    assert "--config FILE is required (or set PORTCULLIS_GATEWAY_CONFIG)" in result.stderr


async def test_explain_without_a_token_needs_no_secret_and_no_certificate(
    tmp_path: Path,
) -> None:
    text = introspecting_config(f'client_secret_file: "{tmp_path / "absent"}"') + (
        f'tls: {{cert_file: "{tmp_path / "absent.crt"}", key_file: "{tmp_path / "absent.key"}"}}\n'
    )
    path = write(tmp_path, text)
    result = await gateway_cli("explain", "--config", path, "GET", "/x")
    assert (result.code, result.stderr) == (0, "")
    assert (
        result.stdout.splitlines()[-1]
        == "decision without a token: 401 (pass --token to check one)"
    )
    checked = await gateway_cli("check", "--config", path)
    assert checked.code == 1
    assert len(checked.stderr.splitlines()) == 3  # the secret file, the certificate, the key


async def test_explain_says_when_a_route_requires_a_client_certificate(tmp_path: Path) -> None:
    text = introspecting_config('client_secret: "s"').replace(
        '  - {name: all, path: "/**"}',
        '  - {name: machines, path: "/machines/**", auth: none, client_cert: required}',
    ) + (
        f'tls: {{cert_file: "{tmp_path}/c", key_file: "{tmp_path}/k", '
        f'client_ca_file: "{tmp_path}/ca"}}\n'
    )
    result = await gateway_cli("explain", "--config", write(tmp_path, text), "GET", "/machines/1")
    assert (result.code, result.stderr) == (0, "")
    assert (
        "  client certificate: required (verified by the gateway's TLS; else 403)"
        in result.stdout.splitlines()
    )


async def test_check_of_broken_yaml_reports_the_syntax_error_with_a_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'upstream: {url: "http://127.0.0.1:1"}\nissuers:\n  - issuer: [x\n')
    result = await gateway_cli("check", "--config", path)
    assert result.code == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{path}:")
    assert ": YAML syntax: " in line
    assert 3 <= int(line.split(":")[1]) <= 4


async def test_check_of_a_missing_file_fails_naming_it(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.yaml")
    result = await gateway_cli("check", "--config", path)
    assert (result.code, result.stdout) == (1, "")
    assert result.stderr == f"{path}:0: cannot read: No such file or directory\n"


async def test_explain_with_a_broken_config_prints_the_problems_and_fails(tmp_path: Path) -> None:
    path = write(tmp_path, "upstream: {url: http://127.0.0.1:1}\nroutes: []\n")
    result = await gateway_cli("explain", "--config", path, "GET", "/")
    assert result.code == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"{path}:1: config: issuers is required (a list of trusted token issuers)\n"
    )


# ---------------------------------------------------------------------------- explain


@pytest.fixture
def config_path(tmp_path: Path, issuer: TestIssuer) -> str:
    return write(tmp_path, explain_config(issuer.url))


async def test_explain_shows_the_matched_rule_its_params_and_needs(
    config_path: str, issuer: TestIssuer
) -> None:
    text = Path(config_path).read_text()
    result = await gateway_cli("explain", "--config", config_path, "PUT", "/orders/42?x=1")
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [
        f"route: orders-write ({config_path}:{line_of(text, 'orders-write')})",
        "  path: /orders/{id}   methods: PUT",
        "  params: id=42",
        "  auth: required (Authorization: Bearer <token>)",
        f"  accepts tokens from {issuer.url} with aud in: orders-api",
        "  dpop: allowed (bearer tokens, or DPoP-bound tokens with a proof of their key)",
        "  scopes: all of orders:read orders:write",
        "  max body: 1048576 bytes",
        "  mode: enforce",
        "  rate limit: none",
        "  cors: none (preflights are forwarded like any OPTIONS request)",
        "decision without a token: 401 (pass --token to check one)",
    ]
    assert issuer.jwks_fetches == 0  # no token: nothing to verify, nothing fetched


async def test_explain_of_an_unmatched_path_decides_404(config_path: str) -> None:
    result = await gateway_cli("explain", "--config", config_path, "DELETE", "/orders/42")
    assert result.code == 1
    assert result.stdout.splitlines() == [
        "no route matches DELETE /orders/42",
        "decision: 404 not_found (unmatched: deny)",
    ]


async def test_explain_of_a_public_route_forwards_without_a_token(config_path: str) -> None:
    text = Path(config_path).read_text()
    result = await gateway_cli("explain", "--config", config_path, "get", "/healthz")
    assert result.code == 0
    assert result.stdout.splitlines() == [
        f"route: health ({config_path}:{line_of(text, 'name: health')})",
        "  path: /healthz   methods: any",
        "  auth: none (forwarded without a token; identity headers removed)",
        "  max body: 1048576 bytes",
        "  mode: enforce",
        "  rate limit: none",
        "  cors: none (preflights are forwarded like any OPTIONS request)",
        "decision: forward",
    ]


async def test_explain_of_a_path_that_could_be_read_two_ways_decides_400(
    config_path: str,
) -> None:
    result = await gateway_cli("explain", "--config", config_path, "GET", "/orders/%2e%2e/x")
    assert result.code == 1
    assert result.stdout == "decision: 400 — the path is refused: dot segments in the path\n"


async def test_explain_of_a_path_with_parameters_no_route_allows_decides_400(
    config_path: str,
) -> None:
    result = await gateway_cli("explain", "--config", config_path, "GET", "/orders/1;v=2")
    assert result.code == 1
    assert result.stdout == (
        "decision: 400 — the path is refused: path parameters (;) are not accepted on this route\n"
    )


async def test_explain_shows_that_a_get_rule_takes_head(config_path: str) -> None:
    text = Path(config_path).read_text()
    result = await gateway_cli("explain", "--config", config_path, "HEAD", "/orders/7")
    assert result.code == 0
    assert result.stdout.splitlines()[:2] == [
        f"route: orders-read ({config_path}:{line_of(text, 'name: orders-read')})",
        "  path: /orders/**   methods: GET, HEAD (HEAD goes with GET)",
    ]


async def test_explain_shows_case_folding_and_parameters_and_binds_params_as_sent(
    tmp_path: Path, issuer: TestIssuer
) -> None:
    text = (
        explain_config(issuer.url)
        .replace('9"}', '9", path_case: insensitive}')
        .replace("methods: [PUT]", "methods: [PUT]\n    path_params: allow")
    )
    path = write(tmp_path, text)
    result = await gateway_cli("explain", "--config", path, "PUT", "/ORDERS/Ab;v=2")
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[:5] == [
        f"route: orders-write ({path}:{line_of(text, 'orders-write')})",
        "  path: /orders/{id}   methods: PUT",
        "  letter case: ignored (upstream.path_case: insensitive)",
        "  path parameters (;): allowed; rules are matched on the path without them",
        "  params: id=Ab;v=2",
    ]


async def test_explain_with_a_valid_token_verifies_it_against_live_keys_and_forwards(
    config_path: str, issuer: TestIssuer
) -> None:
    token = issuer.token("ES256", scope="orders:read orders:write")
    result = await gateway_cli(
        "explain", "--config", config_path, "PUT", "/orders/42", "--token", token
    )
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[-3:] == [
        f"token: valid — iss {issuer.url}, sub user-123, client webapp, aud orders-api",
        "  scopes: orders:read orders:write",
        "decision: forward, with the identity headers of this token",
    ]
    assert issuer.jwks_fetches == 1


async def test_explain_accepts_the_token_with_its_bearer_prefix(
    config_path: str, issuer: TestIssuer
) -> None:
    token = issuer.token("ES256")
    result = await gateway_cli(
        "explain", "--config", config_path, "GET", "/orders", "--token", f"Bearer {token}"
    )
    assert result.code == 0
    assert result.stdout.splitlines()[-1] == (
        "decision: forward, with the identity headers of this token"
    )


async def test_explain_with_an_expired_token_decides_401_invalid_token(
    config_path: str, issuer: TestIssuer
) -> None:
    token = issuer.token("ES256", lifetime=-120)  # past the 30 s leeway
    result = await gateway_cli(
        "explain", "--config", config_path, "GET", "/orders/1", "--token", token
    )
    assert result.code == 1
    assert result.stdout.splitlines()[-2:] == [
        "token: refused — the token has expired",
        "decision: 401 invalid_token",
    ]


async def test_explain_with_a_token_lacking_a_scope_decides_403_insufficient_scope(
    config_path: str, issuer: TestIssuer
) -> None:
    token = issuer.token("ES256", scope="orders:read")
    result = await gateway_cli(
        "explain", "--config", config_path, "PUT", "/orders/42", "--token", token
    )
    assert result.code == 1
    assert result.stdout.splitlines()[-3:] == [
        f"token: valid — iss {issuer.url}, sub user-123, client webapp, aud orders-api",
        "  scopes: orders:read",
        "decision: 403 insufficient_scope — the token needs all of: orders:read orders:write",
    ]


async def test_explain_with_an_opaque_token_decides_401(config_path: str) -> None:
    result = await gateway_cli(
        "explain", "--config", config_path, "GET", "/orders/1", "--token", "2YotnFZFEjr1zCsi"
    )
    assert result.code == 1
    assert result.stdout.splitlines()[-2:] == ["token: not a JWT", "decision: 401 invalid_token"]


async def test_explain_when_the_issuer_keys_cannot_be_fetched_decides_503(
    config_path: str, issuer: TestIssuer
) -> None:
    issuer.jwks_status = 503
    token = issuer.token("ES256")
    result = await gateway_cli(
        "explain", "--config", config_path, "GET", "/orders/1", "--token", token
    )
    assert result.code == 1
    assert result.stdout.splitlines()[-1] == (
        "decision: 503 (the gateway is not ready for this issuer)"
    )
    assert issuer.jwks_fetches >= 1


# ---------------------------------------------------------------------------- explain --ext-authz


async def test_explain_ext_authz_tells_what_each_front_proxy_makes_of_an_allow(
    config_path: str, issuer: TestIssuer
) -> None:
    token = issuer.token("ES256", scope="orders:read", drop=("client_id",))
    result = await gateway_cli(
        "explain", "--config", config_path, "GET", "/orders/1", "--token", token, "--ext-authz"
    )
    assert (result.code, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    start = lines.index("decision: forward, with the identity headers of this token")
    assert lines[start + 1 :] == [
        "ext_authz (decision listener: not configured):",
        "  answer: 200, empty body, with every identity header (empty without a value):",
        "    X-Auth-Subject: user-123",
        "    X-Auth-Client-Id: ",
        "    X-Auth-Scopes: orders:read",
        f"    X-Auth-Issuer: {issuer.url}",
        "  nginx auth_request: the request goes on; auth_request_set copies the headers",
        "  Traefik forwardAuth: the request goes on with authResponseHeaders",
        "  Caddy forward_auth: the request goes on with copy_headers",
        "  Envoy ext_authz: the request goes on with allowed_upstream_headers",
    ]


@pytest.mark.parametrize(
    ("method", "target", "status", "nginx"),
    [
        ("PUT", "/orders/1", "401", "401 with WWW-Authenticate"),
        ("DELETE", "/orders/1", "404", "500 (the example's error_page restores 404)"),
        ("GET", "/orders/..%2fx", "400", "500 (the example's error_page restores 400)"),
    ],
)
async def test_explain_ext_authz_tells_what_each_front_proxy_makes_of_a_denial(
    tmp_path: Path, method: str, target: str, status: str, nginx: str
) -> None:
    text = explain_config("https://auth.example.com") + (
        'ext_authz: {listen: "127.0.0.1:9001", trusted_callers: ["127.0.0.1/32"]}\n'
    )
    path = write(tmp_path, text)
    result = await gateway_cli("explain", "--config", path, method, target, "--ext-authz")
    lines = result.stdout.splitlines()
    start = lines.index("ext_authz (decision listener: 127.0.0.1:9001):")
    assert lines[start + 1 :] == [
        f"  answer: {status}, as in proxy mode (challenge, Retry-After, error body)",
        f"  nginx auth_request: {nginx}",
        f"  Traefik forwardAuth: {status}, answer returned as is",
        f"  Caddy forward_auth: {status}, answer returned as is",
        f"  Envoy ext_authz: {status} and the body; headers in allowed_client_headers only",
    ]


@pytest.mark.parametrize("command", ["check", "explain"])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path, command: str) -> None:
    """`check | head -1`: the pipe closes under the command; it ends with SIGPIPE's status
    and no traceback (before, two: at the print, and at the interpreter's last flush)."""
    path = write(tmp_path, explain_config("https://auth.example.com"))
    args = ["--config", path] + (["GET", "/orders/1"] if command == "explain" else [])
    reader, writer = os.pipe()
    os.close(reader)  # nobody reads: the first write meets a closed pipe
    result = subprocess.run(
        [sys.executable, "-m", "gateway", command, *args],
        stdout=writer,
        stderr=subprocess.PIPE,
        env=child_env(),
        timeout=60,
        check=False,
    )
    os.close(writer)
    assert "Traceback" not in result.stderr.decode(), result.stderr.decode()
    assert result.returncode == 128 + signal.SIGPIPE
