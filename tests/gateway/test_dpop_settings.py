"""The DPoP keys of the gateway's configuration: defaults, and what is refused with its line."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gateway import settings
from portcullis.yamlconf import ConfigError

BASE = """\
upstream: {url: "http://127.0.0.1:8081"}
issuers:
  - {issuer: "https://auth.example.com", audiences: [api]}
routes:
  - {name: public, path: "/public/**", auth: none}
  - {name: api, path: "/**"}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        settings.load_text(text, "gw.yaml", {})
    return [str(p) for p in caught.value.problems]


def test_defaults_allow_dpop_everywhere_with_a_minute_of_proof_age():
    loaded = settings.load_text(BASE, "gw.yaml", {})
    assert loaded.dpop.proof_max_age == timedelta(seconds=60)
    assert loaded.dpop.leeway == timedelta(seconds=5)
    assert loaded.dpop.nonce is False
    assert "HS256" not in loaded.dpop.algorithms and "ES256" in loaded.dpop.algorithms
    assert [route.dpop for route in loaded.routes] == ["allowed", "allowed"]
    assert loaded.public_url is None
    assert loaded.issuers[0].dpop == "allowed"


def test_public_url_is_scheme_and_host_alone():
    loaded = settings.load_text(BASE + 'public_url: "https://api.example.com/"\n', "gw.yaml", {})
    assert loaded.public_url == "https://api.example.com"
    for bad in ("https://api.example.com/v1", "https://u@api.example.com", "ftp://x", "x"):
        found = problems(BASE + f'public_url: "{bad}"\n')
        assert len(found) == 1 and found[0].startswith("gw.yaml:7: "), found


def test_dpop_means_nothing_on_a_public_route():
    text = BASE.replace("auth: none}", "auth: none, dpop: required}")
    assert problems(text) == ["gw.yaml:5: route 'public'.dpop: means nothing with auth: none"]


@pytest.mark.parametrize("alg", ["HS256", "none"])
def test_a_symmetric_or_no_proof_algorithm_is_refused(alg):
    found = problems(BASE + f"dpop: {{algorithms: [ES256, {alg}]}}\n")
    assert len(found) == 1 and f"{alg} cannot be used" in found[0], found


def test_proof_max_age_must_be_positive():
    found = problems(BASE + "dpop: {proof_max_age: 0s}\n")
    assert len(found) == 1 and "proof_max_age" in found[0], found
