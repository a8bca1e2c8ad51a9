from tests.support import header_values


async def test_valid_token_is_forwarded_with_identity_headers(gateway, issuer, client):
    token = issuer.token("ES256")
    async with client.get(
        gateway.url + "/orders/7?x=1", headers={"Authorization": f"Bearer {token}"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        seen = await resp.json()
    assert seen["raw_path"] == "/orders/7?x=1"
    assert header_values(seen, "X-Auth-Subject") == ["user-123"]
    assert header_values(seen, "X-Auth-Client-Id") == ["webapp"]
    assert header_values(seen, "X-Auth-Scopes") == ["orders:read"]
    assert header_values(seen, "X-Auth-Issuer") == [issuer.url]
