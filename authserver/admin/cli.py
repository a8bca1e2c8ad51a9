"""`portcullis-authserver clients …` and `users …`: the admin API from the command line.

The commands talk to a running server over HTTP, as any other admin API client: they get an
access token with the client credentials grant (RFC 6749 §4.4) for the resource
`{issuer}/admin/v1` (RFC 8707), then call the API. Where the server is and who calls come
from the environment, never from arguments (which other users of the machine can read):

    PORTCULLIS_ISSUER                   the server's issuer, like https://auth.example.com
    PORTCULLIS_ADMIN_CLIENT_ID          a client registered with admin:read / admin:write
    PORTCULLIS_ADMIN_CLIENT_SECRET      and the audience {issuer}/admin/v1 in its resources
    PORTCULLIS_ADMIN_CA_FILE            optional: the CA (PEM) to trust for the issuer's TLS
                                        certificate, for a private CA (or `--ca-file FILE`)

Tables for people; `--json` prints the API's JSON for scripts. A refusal prints its code,
message and details on stderr, and the command exits 1.
"""

from __future__ import annotations

import argparse
import base64
import getpass
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

ISSUER = "PORTCULLIS_ISSUER"
CLIENT_ID = "PORTCULLIS_ADMIN_CLIENT_ID"
CLIENT_SECRET = "PORTCULLIS_ADMIN_CLIENT_SECRET"  # noqa: S105 - a variable's name
CA_FILE = "PORTCULLIS_ADMIN_CA_FILE"
TIMEOUT = 30.0
PAGE = 200

CLIENT_COLUMNS = ("clientId", "clientName", "tokenEndpointAuthMethod", "grantTypes", "managedBy")
USER_COLUMNS = ("id", "username", "email", "roles", "disabled", "managedBy")


class Refused(Exception):
    """The server, or the environment, said no: what to print."""


def add_commands(commands: Any) -> None:
    """The `clients` and `users` commands, on the program's subparsers."""
    clients = commands.add_parser("clients", help="clients, through the admin API")
    on_clients = clients.add_subparsers(dest="admin_command", required=True)
    _with_json(on_clients.add_parser("list", help="every client"))
    add = _with_json(
        on_clients.add_parser("add", help="register a client (its secret is shown once)")
    )
    add.add_argument("--id", help="the client_id; generated when absent")
    add.add_argument("--name", help="shown to users")
    add.add_argument("--public", action="store_true", help="no secret (browser and native apps)")
    add.add_argument("--redirect-uri", action="append", default=[], help="repeatable")
    add.add_argument("--grant-type", action="append", default=[], help="repeatable")
    add.add_argument("--scope", help="space-separated")
    add.add_argument("--resource", action="append", default=[], help="repeatable (RFC 8707)")
    for name, text in (
        ("show", "one client"),
        ("rotate-secret", "replace its secret (shown once); the old one stops at once"),
        ("delete", "remove it and revoke its tokens"),
    ):
        _with_json(on_clients.add_parser(name, help=text)).add_argument("client_id")

    users = commands.add_parser("users", help="users, through the admin API")
    on_users = users.add_subparsers(dest="admin_command", required=True)
    _with_json(on_users.add_parser("list", help="every user"))
    add = _with_json(on_users.add_parser("add", help="create a user"))
    add.add_argument("username")
    add.add_argument("--email")
    add.add_argument("--name")
    add.add_argument("--role", action="append", default=[], help="repeatable")
    add.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    for name, text in (
        ("set-password", "set a new password"),
        ("disable", "end their sessions and tokens, refuse their sign-in"),
        ("delete", "remove them, their sessions and tokens"),
    ):
        command = _with_json(on_users.add_parser(name, help=text))
        command.add_argument("user", help="the user's id or username")
        if name == "set-password":
            command.add_argument("--password-stdin", action="store_true")


def _with_json(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--ca-file",
        help=f"the CA (PEM) to trust for the issuer's certificate (else ${CA_FILE}, else the "
        "system's CAs)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        api = AdminClient.from_environment(getattr(args, "ca_file", None))
        if args.command == "clients":
            _clients(api, args)
        else:
            _users(api, args)
    except Refused as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- HTTP


class AdminClient:
    def __init__(
        self, issuer: str, client_id: str, secret: str, tls: ssl.SSLContext | None = None
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.base = self.issuer + "/admin/v1"
        self.client_id = client_id
        self.secret = secret
        self._tls = tls  # None: the system's CAs
        self._token: str | None = None

    @classmethod
    def from_environment(cls, ca_file: str | None = None) -> AdminClient:
        missing = [v for v in (ISSUER, CLIENT_ID, CLIENT_SECRET) if not os.environ.get(v)]
        if missing:
            raise Refused(f"set {', '.join(missing)} (see portcullis-authserver clients --help)")
        issuer = os.environ[ISSUER]
        if urllib.parse.urlsplit(issuer).scheme not in ("https", "http"):
            raise Refused(f"{ISSUER} must be the server's https:// issuer URL")
        ca_file = ca_file or os.environ.get(CA_FILE) or None
        tls = None
        if ca_file is not None:
            try:
                tls = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise Refused(f"cannot read the CA file {ca_file}: {exc}") from None
        return cls(issuer, os.environ[CLIENT_ID], os.environ[CLIENT_SECRET], tls)

    def token(self) -> str:
        if self._token is None:
            # RFC 6749 §2.3.1: id and secret form-encoded before Basic.
            raw = (
                f"{urllib.parse.quote_plus(self.client_id)}:{urllib.parse.quote_plus(self.secret)}"
            )
            form = urllib.parse.urlencode(
                {"grant_type": "client_credentials", "resource": self.base}
            )
            status, body = self._send(
                urllib.request.Request(  # noqa: S310 - an http(s) URL, checked
                    self.issuer + "/token",
                    data=form.encode(),
                    headers={
                        "Authorization": "Basic " + base64.b64encode(raw.encode()).decode(),
                        "Content-Type": "application/x-www-form-urlencoded",
                    },
                )
            )
            if status != 200:
                raise Refused(
                    f"no admin token: {body.get('error')}: {body.get('error_description', '')}"
                )
            self._token = str(body["access_token"])
        return self._token

    def call(
        self, method: str, path: str, body: Any = None, media: str = "application/json"
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token()}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = media
        status, answer = self._send(
            urllib.request.Request(self.base + path, data=data, headers=headers, method=method)  # noqa: S310
        )
        if status >= 400:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            lines = [f"{error.get('code', status)}: {error.get('message', '')}"]
            lines += [f"  {d['field']}: {d['issue']}" for d in error.get("details", [])]
            raise Refused("\n".join(lines))
        return answer

    def every(self, collection: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        query: dict[str, str] = {"limit": str(PAGE)}
        while True:
            page = self.call("GET", f"/{collection}?" + urllib.parse.urlencode(query))
            items += page["data"]
            cursor = page["pagination"]["nextCursor"]
            if not cursor:
                return items
            query["cursor"] = cursor

    def _send(self, request: urllib.request.Request) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT, context=self._tls) as response:  # noqa: S310 - the issuer's URL
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as error:
            raw, status = error.read(), error.code
        except urllib.error.URLError as error:
            hint = (
                f" (a private CA: --ca-file FILE or {CA_FILE})"
                if isinstance(error.reason, ssl.SSLCertVerificationError)
                else ""
            )
            raise Refused(f"cannot reach {request.full_url}: {error.reason}{hint}") from None
        return status, json.loads(raw) if raw else None


def _item(collection: str, item_id: str) -> str:
    return f"/{collection}/{urllib.parse.quote(item_id, safe='')}"


# ---------------------------------------------------------------------------- commands


def _clients(api: AdminClient, args: argparse.Namespace) -> None:
    command = args.admin_command
    if command == "list":
        _print(args, api.every("clients"), CLIENT_COLUMNS)
        return
    if command == "add":
        body: dict[str, Any] = {}
        for key, value in (
            ("clientId", args.id),
            ("clientName", args.name),
            ("scope", args.scope),
            ("redirectUris", args.redirect_uri),
            ("grantTypes", args.grant_type),
            ("resources", args.resource),
        ):
            if value:
                body[key] = value
        if args.public:
            body["tokenEndpointAuthMethod"] = "none"
        _show(args, api.call("POST", "/clients", body))
        return
    path = _item("clients", args.client_id)
    if command == "show":
        _show(args, api.call("GET", path))
    elif command == "rotate-secret":
        _show(args, api.call("POST", path + "/secret", {}))
    elif command == "delete":
        api.call("DELETE", path)
        _done(args, f"client {args.client_id} deleted")


def _users(api: AdminClient, args: argparse.Namespace) -> None:
    command = args.admin_command
    if command == "list":
        _print(args, api.every("users"), USER_COLUMNS)
        return
    if command == "add":
        body: dict[str, Any] = {"username": args.username, "password": _password(args)}
        for key, value in (("email", args.email), ("name", args.name), ("roles", args.role)):
            if value:
                body[key] = value
        _show(args, api.call("POST", "/users", body))
        return
    path = _item("users", _user_id(api, args.user))
    if command == "set-password":
        api.call("POST", path + "/password", {"password": _password(args)})
        _done(args, f"password of {args.user} set")
    elif command == "disable":
        _show(args, api.call("PATCH", path, {"disabled": True}, "application/merge-patch+json"))
    elif command == "delete":
        api.call("DELETE", path)
        _done(args, f"user {args.user} deleted")


def _user_id(api: AdminClient, user: str) -> str:
    """The id of the user named `user`, or `user` itself taken as an id."""
    found = api.call("GET", "/users?" + urllib.parse.urlencode({"username": user}))["data"]
    return str(found[0]["id"]) if found else user


def _password(args: argparse.Namespace) -> str:
    if args.password_stdin:
        return sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    password = getpass.getpass("Password: ")
    if getpass.getpass("Again: ") != password:
        raise Refused("the passwords differ")
    return password


# ---------------------------------------------------------------------------- output


def _print(args: argparse.Namespace, items: list[dict[str, Any]], columns: Sequence[str]) -> None:
    if args.json:
        print(json.dumps(items, indent=2))
        return
    rows = [[_cell(item.get(c)) for c in columns] for item in items]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    line: Callable[[Sequence[str]], str] = lambda cells: "  ".join(  # noqa: E731
        cell.ljust(width) for cell, width in zip(cells, widths, strict=True)
    ).rstrip()
    print(line(columns))
    for row in rows:
        print(line(row))


def _show(args: argparse.Namespace, item: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(item, indent=2))
        return
    width = max(len(k) for k in item)
    for key, value in item.items():
        print(f"{key.ljust(width)}  {_cell(value)}")
    if "clientSecret" in item:
        print("\nThe client secret is shown this once: keep it now.", file=sys.stderr)


def _done(args: argparse.Namespace, message: str) -> None:
    print(json.dumps({"done": message}) if args.json else message)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
