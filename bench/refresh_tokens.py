"""Refresh tokens for the refresh-grant scenarios, each of a family of its own.

    refresh_tokens.py --server URL --client-id ID --secret SECRET --username U --password P
                      --redirect-uri URI --scope SCOPE --count N --out FILE

Runs the authorization code flow with PKCE as a browser and a confidential client would:
GET /authorize, the login form (once: the session cookie serves the rest), the consent form
(once: the consent is remembered), the code exchanged at /token with HTTP Basic. Writes one
refresh token a line. A refresh token rotates on every use, so a run needs tokens no earlier
run used.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import secrets
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import aiohttp


class _Form(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.action = ""
        self.fields: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if tag == "form" and not self.action:
            self.action = values.get("action", "")
        if tag == "input" and values.get("type") == "hidden" and "name" in values:
            self.fields[values["name"]] = values.get("value", "")


async def one_family(session: aiohttp.ClientSession, args: argparse.Namespace) -> str:
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    query = urlencode(
        {
            "response_type": "code",
            "client_id": args.client_id,
            "redirect_uri": args.redirect_uri,
            "scope": args.scope,
            "state": secrets.token_urlsafe(8),
            "code_challenge": challenge.decode(),
            "code_challenge_method": "S256",
        }
    )
    response = await session.get(f"{args.server}/authorize?{query}", allow_redirects=False)
    for _ in range(4):
        if response.status in (302, 303):
            location = response.headers["Location"]
            code = parse_qs(urlsplit(location).query).get("code")
            if not code:
                raise SystemExit(f"the authorization failed: {location}")
            break
        text = await response.text()
        if response.status != 200:
            raise SystemExit(f"/authorize answered {response.status}: {text[:300]}")
        form = _Form()
        form.feed(text)
        fields = dict(form.fields)
        if form.action.endswith("/login"):
            fields.update(username=args.username, password=args.password)
        else:
            fields["decision"] = "approve"
        response = await session.post(
            urljoin(args.server + "/", urlsplit(form.action).path.lstrip("/")),
            data=fields,
            allow_redirects=False,
        )
    else:
        raise SystemExit("the flow did not end in a redirect")
    basic = base64.b64encode(f"{args.client_id}:{args.secret}".encode()).decode()
    async with session.post(
        f"{args.server}/token",
        data={
            "grant_type": "authorization_code",
            "code": code[0],
            "redirect_uri": args.redirect_uri,
            "code_verifier": verifier,
        },
        headers={"Authorization": f"Basic {basic}"},
    ) as exchanged:
        body = await exchanged.json()
        if exchanged.status != 200 or "refresh_token" not in body:
            raise SystemExit(f"the code exchange answered {exchanged.status}: {body}")
        return str(body["refresh_token"])


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("server", "client-id", "secret", "username", "password", "redirect-uri"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--scope", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        tokens = [await one_family(session, args)]  # signs in and consents once
        for start in range(1, args.count, 16):
            batch = range(start, min(args.count, start + 16))
            tokens += await asyncio.gather(*(one_family(session, args) for _ in batch))
    args.out.write_text("".join(token + "\n" for token in tokens))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
