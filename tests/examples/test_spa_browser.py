"""The single-page app (examples/spa) in a real browser (Debian's Chromium, driven by
Playwright), against `make demo`'s authorization server and gateway configs.

A browser is what makes CORS real: the page redeems its code and refreshes and revokes its
tokens at the authorization server's own endpoints (another origin), and reads the answers
only because the authorization server allows the origin of the client's redirect URI; before
the page may send its access token to the gateway (a third origin), Chromium asks the gateway
with a preflight, and a page on an origin neither lists never gets to send its token or read
a token answer. The gateway's metrics and the orders API's own record of requests show what
reached whom. Any Content-Security-Policy violation the page
reports fails the test. Playwright never downloads a browser.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from examples.legacy_api.orders import sample_orders
from tests.authserver.conftest import PASSWORD, basic_auth
from tests.examples.conftest import SPA_ACCESS_TOKEN_LIFETIME, SpaStack
from tests.support import scrape

pytestmark = pytest.mark.slow

# config/authserver.yaml's default for the machine client's secret.
MACHINE_SECRET = "demo-machine-secret-not-for-production-use"
EXPIRY_WAIT_MS = (SPA_ACCESS_TOKEN_LIFETIME + 10) * 1000


class TokenCalls:
    """Each token request the page makes and the answer to it; any request to a token
    endpoint that is not the authorization server's fails the test."""

    def __init__(self, tab: Any, endpoint: str) -> None:
        self._endpoint = endpoint
        self._reads: list[asyncio.Task[tuple[str, int, dict[str, Any] | None]]] = []
        self.elsewhere: list[str] = []
        tab.on("requestfinished", self._finished)

    def _finished(self, request: Any) -> None:
        # The body is read at once: after a navigation the browser no longer has it.
        if request.url == self._endpoint:
            self._reads.append(asyncio.ensure_future(self._read(request)))
        elif request.url.endswith("/token"):
            self.elsewhere.append(request.url)

    @staticmethod
    async def _read(request: Any) -> tuple[str, int, dict[str, Any] | None]:
        from playwright.async_api import Error as PlaywrightError

        form = dict(item.split("=", 1) for item in request.post_data.split("&"))
        response = await request.response()
        try:
            answer = await response.json()
        except PlaywrightError:  # the page navigated away first (it signs in again)
            answer = None
        return form["grant_type"], response.status, answer

    async def grants(self) -> list[tuple[str, int]]:
        return [(grant, status) for grant, status, _ in await asyncio.gather(*self._reads)]

    async def last_answer(self) -> dict[str, Any]:
        *_, answer = await self._reads[-1]
        assert answer is not None
        return answer


def preflights(samples: dict[Any, float], status: str) -> float:
    """How many CORS preflights the gateway answered with `status`."""
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "portcullis_gateway_requests_total"
        and ("method", "OPTIONS") in labels
        and ("status", status) in labels
    )


async def sign_in(tab: Any, stack: SpaStack) -> None:
    await tab.click("#sign-in")
    await tab.wait_for_url(stack.auth.endpoint("/authorize") + "*")
    await tab.fill("#username", "alice")
    await tab.fill("#password", PASSWORD)
    await tab.click("button[type=submit]")
    await tab.click("button[value=approve]")
    await tab.wait_for_url(stack.spa_url + "/")
    await tab.locator("#signed-in").wait_for()


async def list_orders(tab: Any) -> None:
    status = tab.locator("#api-status")
    await tab.evaluate("document.getElementById('api-status').textContent = ''")
    await tab.click("#list-orders")
    await status.filter(has_text="GET /orders through the gateway").wait_for()
    assert await status.text_content() == "GET /orders through the gateway: 200"


async def wait_for_expiry(tab: Any) -> None:
    state = tab.locator("#token-state", has_text="expired")
    await state.wait_for(timeout=EXPIRY_WAIT_MS)


async def test_a_person_signs_in_lists_orders_across_origins_stays_signed_in_and_signs_out(
    page: tuple[Any, list[str]], spa_stack: SpaStack, http: aiohttp.ClientSession
):
    tab, blocked = page
    tokens = TokenCalls(tab, spa_stack.auth.endpoint("/token"))
    await tab.goto(spa_stack.spa_url + "/")
    await tab.locator("#signed-out").wait_for()

    # Sign-in: code flow with PKCE, then the code redeemed by the page itself, across origins
    # at the authorization server's token endpoint, which lets the page read the answer.
    auth_origin = spa_stack.auth.url
    assert auth_origin != spa_stack.spa_url
    async with tab.expect_request(spa_stack.auth.endpoint("/token")) as redeeming:
        await sign_in(tab, spa_stack)
    redeem = await redeeming.value
    assert redeem.method == "POST"
    assert (await redeem.all_headers())["origin"] == spa_stack.spa_url
    answer = await redeem.response()
    assert answer is not None
    assert (await answer.all_headers())["access-control-allow-origin"] == spa_stack.spa_url
    assert await tab.text_content("#signed-in h1") == "Hello, Alice Liddell"
    assert tab.url == spa_stack.spa_url + "/"  # the code is gone from the address bar
    assert await tokens.grants() == [("authorization_code", 200)]
    first = await tokens.last_answer()
    assert first["token_type"] == "Bearer" and first["refresh_token"]
    # Tokens in memory only: nothing in either web storage, not even the finished sign-in.
    stored = await tab.evaluate("[localStorage.length, sessionStorage.length]")
    assert stored == [0, 0]

    # The orders API, on the gateway's origin: the browser asks first (a preflight the
    # gateway answers itself), then sends the token; the API gets the GET alone.
    await list_orders(tab)
    shown = await tab.locator("#orders tbody tr td:first-child").all_text_contents()
    alices = {order.id for order in sample_orders() if order.owner == "alice"}
    assert len(shown) == 10 and set(shown) <= alices  # the first page of alice's orders
    assert preflights(await scrape(spa_stack.gateway.admin_url), "204") >= 1
    assert ("GET", "/orders") in spa_stack.api_requests
    assert all(method != "OPTIONS" for method, _ in spa_stack.api_requests)

    # The access token expires: the next call refreshes it first (a new refresh token too).
    await wait_for_expiry(tab)
    await list_orders(tab)
    assert await tokens.grants() == [("authorization_code", 200), ("refresh_token", 200)]
    refreshed = await tokens.last_answer()
    assert refreshed["access_token"] != first["access_token"]
    assert refreshed["refresh_token"] != first["refresh_token"]

    # The refresh token stops working (revoked elsewhere): at the next expiry the page signs
    # in again, through the authorization server's session, without a password.
    async with http.post(
        spa_stack.auth.endpoint("/revoke"),
        data={"token": refreshed["refresh_token"], "client_id": "demo-spa"},
    ) as response:
        assert response.status == 200
    await wait_for_expiry(tab)
    # The page is on its own address already: wait for the new sign-in's callback to load,
    # lest the old page's elements be taken for the new one's.
    callback = spa_stack.spa_url + "/callback?"
    async with tab.expect_event("framenavigated", lambda frame: frame.url.startswith(callback)):
        await tab.click("#list-orders")
    await tab.locator("#signed-in").wait_for()
    await tab.wait_for_url(spa_stack.spa_url + "/")
    await list_orders(tab)
    assert await tokens.grants() == [
        ("authorization_code", 200),
        ("refresh_token", 200),
        ("refresh_token", 400),
        ("authorization_code", 200),
    ]
    last = await tokens.last_answer()

    # Sign-out: the refresh token is revoked at the authorization server, and its session ends.
    async with tab.expect_request(spa_stack.auth.endpoint("/revoke")) as revoking:
        await tab.click("#sign-out")
    revocation = await (await revoking.value).response()
    assert revocation is not None and revocation.status == 200
    assert (await revocation.all_headers())["access-control-allow-origin"] == spa_stack.spa_url
    await tab.wait_for_url(spa_stack.spa_url + "/")
    notice = tab.locator("#notice")
    await notice.filter(has_text="signed out").wait_for()
    assert await notice.text_content() == (
        "You are signed out of this application and of the authorization server."
    )
    await tab.locator("#signed-out").wait_for()
    assert await tab.evaluate("[localStorage.length, sessionStorage.length]") == [0, 0]
    async with http.post(
        spa_stack.auth.endpoint("/token"),
        data={
            "grant_type": "refresh_token",
            "refresh_token": last["refresh_token"],
            "client_id": "demo-spa",
        },
    ) as response:
        assert response.status == 400
        assert (await response.json())["error"] == "invalid_grant"
    await tab.click("#sign-in")
    await tab.wait_for_url(spa_stack.auth.endpoint("/authorize") + "*")
    assert await tab.locator("#password").count() == 1  # the password is asked again
    assert tokens.elsewhere == []
    assert blocked == []


async def test_a_page_on_another_origin_cannot_send_a_token_to_the_gateway(
    page: tuple[Any, list[str]], spa_stack: SpaStack, http: aiohttp.ClientSession
):
    # A valid token, so that only CORS stands in the way.
    async with http.post(
        spa_stack.auth.endpoint("/token"),
        data={"grant_type": "client_credentials", "scope": "orders:read"},
        headers={"Authorization": basic_auth("demo-machine", MACHINE_SECRET)},
    ) as response:
        assert response.status == 200
        token = (await response.json())["access_token"]
    async with http.get(
        spa_stack.gateway.url + "/orders", headers={"Authorization": f"Bearer {token}"}
    ) as response:
        assert response.status == 200  # outside a browser the token works
    spa_stack.api_requests.clear()

    # The same page, served from an origin the gateway's CORS policy does not list (localhost
    # is not 127.0.0.1 to a browser). Its Content-Security-Policy lets it try.
    tab, blocked = page
    other_origin = spa_stack.spa_url.replace("127.0.0.1", "localhost")
    await tab.goto(other_origin + "/")
    await tab.locator("#signed-out").wait_for()
    console: list[str] = []
    tab.on("console", lambda message: console.append(message.text))
    before = preflights(await scrape(spa_stack.gateway.admin_url), "403")
    outcome = await tab.evaluate(
        """async ([url, token]) => {
            try {
                const response = await fetch(url, {headers: {Authorization: `Bearer ${token}`}});
                return `answered ${response.status}`;
            } catch (error) {
                return `refused: ${error.message}`;
            }
        }""",
        [spa_stack.gateway.url + "/orders", token],
    )
    assert outcome == "refused: Failed to fetch"
    assert any("blocked by CORS policy" in line for line in console), console
    # The gateway refused the preflight itself; the API saw nothing, the token was never sent.
    assert preflights(await scrape(spa_stack.gateway.admin_url), "403") == before + 1
    assert spa_stack.api_requests == []
    assert blocked == []


async def test_a_page_on_another_origin_cannot_read_the_token_endpoints_answers(
    page: tuple[Any, list[str]], spa_stack: SpaStack
):
    # The same page from an origin that is no registered redirect URI's (localhost is not
    # 127.0.0.1 to a browser). Its Content-Security-Policy lets it reach the authorization
    # server, so only CORS stands in the way; the script tries as the real page does.
    tab, blocked = page
    other_origin = spa_stack.spa_url.replace("127.0.0.1", "localhost")
    await tab.goto(other_origin + "/")
    await tab.locator("#signed-out").wait_for()
    console: list[str] = []
    tab.on("console", lambda message: console.append(message.text))
    async with tab.expect_request(spa_stack.auth.endpoint("/token")) as sending:
        outcome = await tab.evaluate(
            """async (url) => {
                try {
                    const response = await fetch(url, {
                        method: "POST",
                        body: new URLSearchParams({
                            grant_type: "refresh_token",
                            refresh_token: "a-refresh-token",
                            client_id: "demo-spa",
                        }),
                        credentials: "omit",
                    });
                    return `answered ${response.status}`;
                } catch (error) {
                    return `refused: ${error.message}`;
                }
            }""",
            spa_stack.auth.endpoint("/token"),
        )
    # A form POST needs no preflight: the request went, but the page reads nothing back.
    assert (await sending.value).method == "POST"
    assert outcome == "refused: Failed to fetch"
    assert any("blocked by CORS policy" in line for line in console), console
    assert blocked == []
