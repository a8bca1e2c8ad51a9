"""Helpers for the device authorization grant's tests: a config with device clients, the
device's requests, and a person going through the device pages over HTTP as a browser
without JavaScript would (every form read from the page the server sent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tests.authserver.conftest import (
    PASSWORD,
    SECRET,
    RunningAuthServer,
    basic_auth,
    default_config,
    post_token,
)

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
TV_SCOPE = "openid profile offline_access orders:read"


def device_config(**changes: Any) -> dict[str, Any]:
    """default_config() with device clients and a one-second polling interval."""
    config = default_config()
    config["clients"] += [
        {
            "client_id": "tv",
            "client_name": "Living Room TV",
            "token_endpoint_auth_method": "none",
            "grant_types": [DEVICE_GRANT, "refresh_token"],
            "scope": TV_SCOPE + " orders:write",
        },
        {
            "client_id": "tv-secret",
            "client_name": "Kiosk",
            "client_secret": SECRET,
            "grant_types": [DEVICE_GRANT],
            "scope": "orders:read",
            # Skips consent in the code flow; the device page asks all the same.
            "skip_consent": True,
        },
    ]
    config["device"] = {"interval": "1s"}
    config.update(changes)
    return config


async def start_device(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    *,
    client_id: str = "tv",
    scope: str | None = TV_SCOPE,
    auth: tuple[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    """POST /device_authorization as the device: public clients by client_id, others Basic."""
    data = dict(extra or {})
    if scope is not None:
        data["scope"] = scope
    headers = {}
    if auth is not None:
        headers["Authorization"] = basic_auth(*auth)
    else:
        data["client_id"] = client_id
    response = await http.post(server.endpoint("/device_authorization"), data=data, headers=headers)
    return response.status, await response.json(), response


async def poll(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    device_code: str,
    *,
    client_id: str = "tv",
    auth: tuple[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    data = {"grant_type": DEVICE_GRANT, "device_code": device_code}
    if auth is None:
        data["client_id"] = client_id
    status, body, response = await post_token(http, server, data, auth=auth)
    assert response.headers["Cache-Control"] == "no-store"
    return status, body


@dataclass
class Form:
    action: str
    inputs: dict[str, str] = field(default_factory=dict)  # every named input, with its value
    hidden: dict[str, str] = field(default_factory=dict)
    buttons: list[tuple[str, str]] = field(default_factory=list)  # (name, value)
    labels: dict[str, str] = field(default_factory=dict)  # input id -> label text


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[Form] = []
        self._label_for: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append(Form(action=a.get("action", "")))
        elif tag == "label":
            self._label_for = a.get("for")
        elif tag == "input" and self.forms and a.get("name"):
            self.forms[-1].inputs[a["name"]] = a.get("value", "")
            if a.get("type") == "hidden":
                self.forms[-1].hidden[a["name"]] = a.get("value", "")
        elif tag == "button" and self.forms and a.get("name"):
            self.forms[-1].buttons.append((a["name"], a.get("value", "")))

    def handle_data(self, data: str) -> None:
        if self._label_for is not None and self.forms and data.strip():
            self.forms[-1].labels[self._label_for] = data.strip()

    def handle_endtag(self, tag: str) -> None:
        if tag == "label":
            self._label_for = None


def forms_of(html: str) -> list[Form]:
    parser = _Parser()
    parser.feed(html)
    return parser.forms


def only_form(html: str) -> Form:
    forms = forms_of(html)
    assert len(forms) == 1, html[:1000]
    return forms[0]


@dataclass
class Step:
    status: int
    text: str
    response: aiohttp.ClientResponse

    @property
    def form(self) -> Form:
        return only_form(self.text)


async def get_page(browser: aiohttp.ClientSession, url: str) -> Step:
    response = await browser.get(url, allow_redirects=False)
    return Step(response.status, await response.text(), response)


async def submit(
    browser: aiohttp.ClientSession,
    server: RunningAuthServer,
    form: Form,
    changes: dict[str, str] | None = None,
    *,
    drop: tuple[str, ...] = (),
) -> Step:
    """Post a form as a browser would: its inputs, then the person's changes."""
    fields = {k: v for k, v in form.inputs.items() if k not in drop}
    fields.update(changes or {})
    response = await browser.post(
        server.url + urlsplit(form.action).path, data=fields, allow_redirects=False
    )
    return Step(response.status, await response.text(), response)


async def approve_on_pages(
    browser: aiohttp.ClientSession,
    server: RunningAuthServer,
    verification_uri_complete: str,
    *,
    decision: str = "approve",
    username: str = "alice",
    password: str = PASSWORD,
) -> Step:
    """A person opens the link the device showed, confirms the prefilled code, signs in
    when asked, and decides. The final page is returned."""
    page = await get_page(browser, verification_uri_complete)
    assert page.status == 200, page.text[:500]
    step = await submit(browser, server, page.form)
    assert step.status == 200, step.text[:500]
    if urlsplit(step.form.action).path.endswith("/device/login"):
        step = await submit(
            browser, server, step.form, {"username": username, "password": password}
        )
        assert step.status == 200, step.text[:500]
    assert urlsplit(step.form.action).path.endswith("/device/consent"), step.text[:500]
    return await submit(browser, server, step.form, {"decision": decision})
