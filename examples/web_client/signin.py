"""Sign in through the example web app the way a browser would, without a browser.

    python -m examples.web_client.signin --url http://127.0.0.1:8082 \\
        --username alice --password wonderland [--expect-sub alice]

Follows every redirect by hand and fills the authorization server's forms from what its
pages say (their hidden fields, the CSRF token among them): start page, /login, the
authorization server's login form and consent page, /callback, the signed-in page, a call of
the API through the gateway, a token refresh, and RP-initiated logout. Prints one line per
request; exits 1 at the first answer that is not what a working setup gives. The demo's smoke
run uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import TextIO
from urllib.parse import parse_qs, urljoin, urlsplit

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=15)


class Mismatch(Exception):
    """An answer that a working setup would not give."""


@dataclass
class Form:
    action: str
    method: str
    fields: dict[str, str] = field(default_factory=dict)
    buttons: list[tuple[str, str]] = field(default_factory=list)  # (name, value)


class _Page(HTMLParser):
    """Forms (hidden fields and named buttons), the claims table and the API result."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[Form] = []
        self.links: list[str] = []
        self.claims: dict[str, str] = {}
        self.status: str | None = None
        self.notice: str | None = None
        self._cell: str | None = None  # "th", "td", "status" or "notice" while inside one
        self._text: list[str] = []
        self._row_name: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append(Form(a.get("action", ""), a.get("method", "get").lower()))
        elif tag == "input" and self.forms and a.get("type") == "hidden":
            self.forms[-1].fields[a.get("name", "")] = a.get("value", "")
        elif tag == "button" and self.forms and a.get("name"):
            self.forms[-1].buttons.append((a["name"], a.get("value", "")))
        elif tag == "a" and "href" in a:
            self.links.append(a["href"])
        elif tag in ("th", "td"):
            self._start(tag)
        elif tag == "strong" and "status" in a.get("class", "").split():
            self._start("status")
        elif tag == "p" and "notice" in a.get("class", "").split():
            self._start("notice")

    def _start(self, cell: str) -> None:
        self._cell, self._text = cell, []

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        ends = {"th": "th", "td": "td", "strong": "status", "p": "notice"}
        if self._cell is None or ends.get(tag) != self._cell:
            return
        text = "".join(self._text).strip()
        if self._cell == "th":
            self._row_name = text
        elif self._cell == "td" and self._row_name is not None:
            self.claims[self._row_name] = text
            self._row_name = None
        elif self._cell == "status":
            self.status = text
        elif self._cell == "notice":
            self.notice = text
        self._cell = None


def parse_page(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    page.close()
    return page


class Browser:
    """Cookies for every host (the jar keeps them per host, as a browser does), redirects
    followed one at a time so each hop can be shown and checked."""

    def __init__(self, http: aiohttp.ClientSession, out: TextIO) -> None:
        self.http = http
        self.out = out

    async def request(
        self, method: str, url: str, data: dict[str, str] | None = None, note: str = ""
    ) -> tuple[int, str, str]:
        """(status, Location made absolute or "", body text)."""
        async with self.http.request(
            method, url, data=data, allow_redirects=False, timeout=TIMEOUT
        ) as response:
            body = await response.text()
            location = response.headers.get("Location", "")
            status = response.status
        shown = urlsplit(url)
        line = f"  {method:<4} {shown.netloc}{shown.path:<14} {status}  {note}"
        print(line.rstrip(), file=self.out)
        return status, urljoin(url, location) if location else "", body

    async def expect(
        self,
        method: str,
        url: str,
        statuses: tuple[int, ...],
        data: dict[str, str] | None = None,
        note: str = "",
    ) -> tuple[int, str, str]:
        status, location, body = await self.request(method, url, data, note)
        if status not in statuses:
            excerpt = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)).strip()[:300]
            raise Mismatch(f"{method} {url}: expected {statuses}, got {status}: {excerpt}")
        return status, location, body


def _query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def _same_origin(a: str, b: str) -> bool:
    return urlsplit(a).netloc == urlsplit(b).netloc


def _form(page: _Page, action_suffix: str) -> Form:
    for form in page.forms:
        if form.action.endswith(action_suffix):
            return form
    raise Mismatch(f"the page has no form posting to {action_suffix}")


async def sign_in(
    url: str,
    username: str,
    password: str,
    *,
    expect_sub: str | None = None,
    out: TextIO = sys.stdout,
) -> dict[str, str]:
    """The whole round trip; the claims the signed-in page showed. Mismatch on a failure."""
    url = url.rstrip("/")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        browser = Browser(http, out)
        print(f"signing in through {url}/ as {username}", file=out)

        _, _, body = await browser.expect("GET", url + "/", (200,), note="start page")
        if "/login" not in parse_page(body).links:
            raise Mismatch("the start page has no Sign in link to /login")

        _, location, _ = await browser.expect(
            "GET", url + "/login", (302, 303), note="-> the authorization request"
        )
        asked = _query(location)
        if asked.get("code_challenge_method") != "S256" or not asked.get("code_challenge"):
            raise Mismatch("the authorization request does not use PKCE with S256")
        if not asked.get("state") or not asked.get("nonce"):
            raise Mismatch("the authorization request has no state or no nonce")
        if _same_origin(location, url):
            raise Mismatch("/login did not send the browser to the authorization server")

        # The authorization server's pages: login, then consent (skipped if given before).
        status, next_url, body = await browser.expect(
            "GET", location, (200, 302, 303), note="the authorization server"
        )
        page_url = location
        for _ in range(3):
            if status in (302, 303):
                break
            page = parse_page(body)
            if any(f.action.endswith("/login") for f in page.forms):
                form = _form(page, "/login")
                form.fields.update(username=username, password=password)
                note = "login form, CSRF token included"
            else:
                form = _form(page, "/consent")
                if ("decision", "approve") not in form.buttons:
                    raise Mismatch("the consent page has no approve button")
                form.fields["decision"] = "approve"
                note = "consent: approve"
            page_url = urljoin(page_url, form.action)
            status, next_url, body = await browser.expect(
                "POST", page_url, (200, 302, 303), form.fields, note=note
            )
        else:
            raise Mismatch("the authorization server never redirected back")

        answer = _query(next_url)
        if not next_url.startswith(url + "/callback"):
            raise Mismatch(f"the authorization server redirected to {next_url}, not the callback")
        if "code" not in answer or answer.get("state") != asked["state"]:
            raise Mismatch(f"the callback lacks the code or the state: {next_url}")
        if "iss" not in answer:
            raise Mismatch("the callback has no iss (RFC 9207)")

        _, location, _ = await browser.expect(
            "GET", next_url, (302, 303), note="code exchanged, ID token checked"
        )
        _, _, body = await browser.expect("GET", location, (200,), note="signed in")
        page = parse_page(body)
        claims = page.claims
        if not claims.get("sub"):
            raise Mismatch("the signed-in page shows no claims")
        if expect_sub is not None and claims["sub"] != expect_sub:
            raise Mismatch(f"signed in as {claims['sub']!r}, not {expect_sub!r}")
        shown = ", ".join(f"{k} {claims[k]}" for k in ("sub", "name", "email") if k in claims)
        print(f"    claims: {shown}", file=out)

        async def press(action: str, note: str) -> _Page:
            form = _form(page, action)
            _, location, _ = await browser.expect(
                "POST", url + action, (303,), form.fields, note=note
            )
            _, _, body = await browser.expect("GET", location, (200,))
            return parse_page(body)

        page = await press("/call-api", "call the API with the access token")
        if page.status != "200":
            raise Mismatch(f"the API answered {page.status}, not 200")
        print("    the API answered 200", file=out)

        page = await press("/refresh", "refresh the tokens")
        if not (page.notice or "").startswith("Tokens refreshed"):
            raise Mismatch(f"no refresh: {page.notice}")
        page = await press("/call-api", "call the API with the new access token")
        if page.status != "200":
            raise Mismatch(f"with the refreshed token the API answered {page.status}")

        form = _form(page, "/logout")
        _, location, _ = await browser.expect(
            "POST", url + "/logout", (303,), form.fields, note="sign out"
        )
        if _same_origin(location, url) or "id_token_hint" not in _query(location):
            raise Mismatch("sign-out did not go to the end-session endpoint with id_token_hint")
        _, location, _ = await browser.expect(
            "GET", location, (302, 303), note="the authorization server ends its session"
        )
        _, _, body = await browser.expect("GET", location, (200,), note="back in the app")
        if "and of the authorization server" not in body:
            raise Mismatch("the app did not confirm the sign-out at the authorization server")
        _, _, body = await browser.expect("GET", url + "/", (200,), note="signed out")
        if "/login" not in parse_page(body).links:
            raise Mismatch("after signing out the start page offers no Sign in link")
        return claims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.web_client.signin",
        description="Run the example web app's sign-in, API call, refresh and sign-out "
        "without a browser.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8082", help="the web app")
    parser.add_argument("--username", required=True)
    parser.add_argument("--password", required=True)
    parser.add_argument("--expect-sub", help="fail unless the signed-in user has this sub")
    args = parser.parse_args(argv)
    try:
        asyncio.run(sign_in(args.url, args.username, args.password, expect_sub=args.expect_sub))
    except Mismatch as exc:
        print(f"FAILED: {exc}")
        return 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"FAILED: no answer ({exc.__class__.__name__}: {exc})")
        return 1
    print("sign-in, API call, refresh and sign-out all worked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
