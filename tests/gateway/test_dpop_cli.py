"""The command line and DPoP: `explain` shows a route's DPoP requirement and the URL proofs
must name, `check` warns when several workers would each keep their own replay cache, and
when the decision listener cannot know the URL proofs name on a route that requires DPoP."""

from __future__ import annotations

from pathlib import Path

from tests.dpop_proofs import DpopKey
from tests.gateway.test_cli import explain_config, gateway_cli, line_of, write
from tests.support import TestIssuer


def dpop_config(issuer_url: str) -> str:
    return explain_config(issuer_url).replace(
        "  - {name: health, path: /healthz, auth: none}\n",
        "  - {name: health, path: /healthz, auth: none}\n"
        '  - {name: payments, path: "/payments/**", dpop: required,\n'
        '     public_url: "https://pay.example.com"}\n',
    )


async def test_explain_shows_a_route_that_requires_dpop_and_where_proofs_point(
    tmp_path: Path,
) -> None:
    text = dpop_config("https://auth.example.com")
    path = write(tmp_path, text)
    result = await gateway_cli("explain", "--config", path, "POST", "/payments/7")
    assert (result.code, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert lines[0] == f"route: payments ({path}:{line_of(text, 'name: payments')})"
    assert (
        "  dpop: required (Authorization: DPoP <token> and a DPoP proof; bearer tokens: 401)"
    ) in lines
    assert "  dpop proofs name (htu): https://pay.example.com<path>" in lines


async def test_check_warns_of_several_workers_with_the_memory_replay_cache(
    tmp_path: Path,
) -> None:
    text = dpop_config("https://auth.example.com") + "workers: 2\n"
    path = write(tmp_path, text)
    result = await gateway_cli("check", "--config", path)
    assert result.code == 0
    assert result.stderr == (
        f"{path}: warning: workers: 2 with the memory replay cache: each worker remembers "
        "only the DPoP proofs it saw, so a proof replayed to another worker is accepted; "
        "set rate_limits.backend to a redis:// URL to share it\n"
    )
    shared = write(
        tmp_path, text + 'rate_limits: {backend: "redis://127.0.0.1:6379/0"}\n', "redis.yaml"
    )
    quiet = await gateway_cli("check", "--config", shared)
    assert (quiet.code, quiet.stderr) == (0, "")


async def test_check_warns_of_several_workers_making_nonces_with_keys_of_their_own(
    tmp_path: Path,
) -> None:
    shared = 'rate_limits: {backend: "redis://127.0.0.1:6379/0"}\nworkers: 2\n'
    text = dpop_config("https://auth.example.com") + shared + "dpop: {nonce: true}\n"
    path = write(tmp_path, text)
    result = await gateway_cli("check", "--config", path)
    assert result.code == 0
    assert result.stderr == (
        f"{path}: warning: workers: 2 with dpop.nonce and no dpop.nonce_key: each worker "
        "makes nonces with its own random key and refuses the others'; set nonce_key (the "
        "same on every replica)\n"
    )
    keyed = write(
        tmp_path, text.replace("{nonce: true}", '{nonce: true, nonce_key: "k"}'), "keyed.yaml"
    )
    quiet = await gateway_cli("check", "--config", keyed)
    assert (quiet.code, quiet.stderr) == (0, "")


EXT_AUTHZ = 'ext_authz: {listen: "127.0.0.1:9902", trusted_callers: ["127.0.0.1/32"]}\n'


def _unlocated(path: str, text: str, route: str) -> str:
    return (
        f"{path}:{line_of(text, f'name: {route}')}: warning: route {route} requires DPoP and "
        "ext_authz is on with no public_url: behind nginx auth_request or Envoy the decision "
        "listener does not see the URL clients call, and refuses their proofs; set public_url "
        "(or the route's)\n"
    )


async def test_check_warns_of_a_route_requiring_dpop_behind_ext_authz_without_public_url(
    tmp_path: Path,
) -> None:
    text = dpop_config("https://auth.example.com").replace(
        ',\n     public_url: "https://pay.example.com"}', "}"
    )
    path = write(tmp_path, text + EXT_AUTHZ)
    result = await gateway_cli("check", "--config", path)
    assert (result.code, result.stderr) == (0, _unlocated(path, text, "payments"))
    # Quiet with a public_url (global or the route's), and without the decision listener.
    for name, changed in {
        "global.yaml": text + EXT_AUTHZ + 'public_url: "https://api.example.com"\n',
        "route.yaml": dpop_config("https://auth.example.com") + EXT_AUTHZ,
        "proxy.yaml": text,
    }.items():
        quiet = await gateway_cli("check", "--config", write(tmp_path, changed, name))
        assert (quiet.code, quiet.stderr) == (0, ""), name


async def test_check_warns_of_routes_taking_an_issuer_that_requires_dpop_behind_ext_authz(
    tmp_path: Path,
) -> None:
    # DPoP merely allowed (the default) gives no warning: it would be given to every
    # forward-auth configuration, those whose proxy describes the URL included.
    text = explain_config("https://auth.example.com") + EXT_AUTHZ
    quiet = await gateway_cli("check", "--config", write(tmp_path, text, "allowed.yaml"))
    assert (quiet.code, quiet.stderr) == (0, "")
    text = text.replace(
        "    algorithms: [ES256]\n", "    algorithms: [ES256]\n    dpop: required\n"
    )
    path = write(tmp_path, text)
    result = await gateway_cli("check", "--config", path)
    assert result.code == 0
    assert result.stderr == _unlocated(path, text, "orders-write") + _unlocated(
        path, text, "orders-read"
    )


async def test_explain_with_a_token_tells_its_binding_and_refuses_bearer_where_dpop_is_required(
    tmp_path: Path, issuer: TestIssuer
) -> None:
    path = write(tmp_path, dpop_config(issuer.url))
    holder = DpopKey("ES256")
    bound = issuer.token("ES256", cnf=holder.cnf, scope="orders:read orders:write")
    told = await gateway_cli("explain", "--config", path, "PUT", "/orders/1", "--token", bound)
    assert (told.code, told.stderr) == (0, "")
    assert told.stdout.splitlines()[-2:] == [
        f"  DPoP-bound to key {holder.jkt}: each request needs a proof of it",
        "decision: forward, with the identity headers of this token",
    ]
    unbound = issuer.token("ES256")
    refused = await gateway_cli(
        "explain", "--config", path, "GET", "/payments/1", "--token", unbound
    )
    assert refused.code == 1
    assert refused.stdout.splitlines()[-1] == (
        "decision: 401 invalid_token — a bearer token where DPoP is required"
    )
