"""The device page (RFC 8628 §3.3): a person enters the code their device shows, signs in if
needed, and approves or denies the device.

Steps, each a form posted back with the session's CSRF token:
 1. GET /device: the code field, prefilled from `verification_uri_complete` — the person
    still confirms it (§3.3.1), and a GET never looks a code up;
 2. POST /device: the code is checked. Guesses are throttled per session and per client
    address (below), each charged before its code is looked up and kept when it is wrong;
 3. POST /device/login: the login form, when the session is not signed in, with the
    password checks and throttle of every login form;
 4. POST /device/consent: the client's name, the scopes, and a warning to approve only a
    device the person is holding (§5.4: a code can be phished); approve or deny.
The forms of steps 3 and 4 carry the code with a proof, bound to the session, that it
passed step 2: without the proof they refuse the code without looking it up, so they
cannot be used to guess codes around the throttle. Consent is asked every time, even of a
client that skips it in the code flow: it is the person's confirmation that the device
in front of them is the one asking.

The bound on guessing. A user code is one of 20**8 ≈ 2.56e10 (protocol/user_codes.py) and
lives `lifetimes.device_code` (10 minutes by default). A client address gets at most
`device.max_failures_per_address` (20) wrong codes in any `device.window` (15 minutes: a run
of guesses ends only after a whole window without one, protocol/throttle.py `Cap`), so
within one code's lifetime at most 20 * ceil(10 / 15) = 20 guesses, however many are sent
at once (each is charged before its code is looked up): the chance that they
hit one given code is 20 / 2.56e10 ≈ 7.8e-10, and that they hit any of N codes pending at
once N * 7.8e-10 (7.8e-6 for ten thousand). A session gets at most `device.max_failures`
(5) before that.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from ..protocol import user_codes
from ..protocol.errors import OAuthError
from ..protocol.lifecycle import Device
from ..protocol.throttle import Cap
from ..sessions import Session, Sessions
from ..settings import ClientSettings
from ..store.base import DeviceRecord
from . import signin
from .common import Services, error_page, page, read_form, services

log = logging.getLogger("portcullis.authserver.device")

PROOF = "code_checked"  # the field proving this session passed the code check
BAD_FORMAT = "Enter the 8-letter code shown on your device, like BCDF-GHJK."
UNKNOWN = "That code is not valid or has expired. Check the code on your device."
TOO_MANY = "Too many wrong codes. Please wait a few minutes and try again."
GONE = "This code has expired or was already used. Start again on your device."


def _proof(session: Session, code: str) -> str:
    return Sessions.proof(session, [("device_user_code", code)])


def _proof_valid(session: Session, code: str, value: str | None) -> bool:
    return Sessions.proof_valid(session, [("device_user_code", code)], value)


def _expired_session(request: web.Request) -> web.Response:
    return error_page(
        request,
        403,
        "Your session expired",
        "Please open the device page again and enter the code.",
        "csrf",
    )


def _code_page(
    request: web.Request,
    session: Session,
    *,
    user_code: str = "",
    error: str | None = None,
    status: int = 200,
) -> web.Response:
    svc = services(request)
    response = page(
        request,
        "device.html",
        status=status,
        title="Connect a device",
        action=svc.base_path + "/device",
        csrf_token=Sessions.csrf_token(session),
        user_code=user_code,
        error=error,
    )
    svc.sessions.set_cookie(response, session)
    return response


def _login_page(
    request: web.Request,
    session: Session,
    client: ClientSettings,
    code: str,
    *,
    error: str | None = None,
    status: int = 200,
    username: str | None = None,
) -> web.Response:
    svc = services(request)
    response = page(
        request,
        "login.html",
        status=status,
        title="Sign in",
        action=svc.base_path + "/device/login",
        csrf_token=Sessions.csrf_token(session),
        carried=[("user_code", code), (PROOF, _proof(session, code))],
        client_name=client.client_name,
        error=error,
        username=username,
    )
    svc.sessions.set_cookie(response, session)
    return response


def _consent_page(
    request: web.Request, session: Session, client: ClientSettings, record: DeviceRecord
) -> web.Response:
    svc = services(request)
    user = svc.settings.user_by_subject(session.record.subject)
    shown = user_codes.display(record.user_code)
    response = page(
        request,
        "consent.html",
        title="Allow a device",
        action=svc.base_path + "/device/consent",
        csrf_token=Sessions.csrf_token(session),
        carried=[("user_code", record.user_code), (PROOF, _proof(session, record.user_code))],
        client_name=client.client_name,
        scopes=[
            {"name": s, "description": svc.settings.scope_description(s)}
            for s in record.scope.split()
        ],
        user_name=(user.claims.get("name") or user.username) if user else session.record.subject,
        warning=(
            f"Allow this only if you started signing in on a device you are holding and it "
            f"shows the code {shown}. If someone sent you this code, deny: they would get "
            "access to your account."
        ),
    )
    svc.sessions.set_cookie(response, session)
    return response


def _done_page(request: web.Request, heading: str, message: str) -> web.Response:
    return page(request, "device_done.html", title=heading, heading=heading, message=message)


async def _pending(
    svc: Services, code: str, now: float
) -> tuple[DeviceRecord, ClientSettings] | None:
    record = await svc.store.device_by_user_code(code, now)
    if record is None or record.state != Device.PENDING:
        return None
    client = svc.settings.client(record.client_id)
    if client is None:
        return None  # the client was removed from the configuration
    return record, client


async def _form(request: web.Request) -> dict[str, str] | None:
    try:
        return await read_form(request)
    except OAuthError:
        return None


def _malformed(request: web.Request) -> web.Response:
    return error_page(request, 400, "This request cannot be handled", "The form is malformed.")


# ---------------------------------------------------------------------------- handlers


async def device_page(request: web.Request) -> web.Response:
    """GET /device: the code form, prefilled from `?user_code=` when it is well formed."""
    svc = services(request)
    session = await svc.sessions.ensure(request)
    code = user_codes.normalise(request.query.get("user_code", ""))
    return _code_page(request, session, user_code=user_codes.display(code) if code else "")


async def check_code(request: web.Request) -> web.Response:
    """POST /device: the code the person typed (throttled), then login or consent."""
    svc = services(request)
    settings = svc.settings.device
    form = await _form(request)
    if form is None:
        return _malformed(request)
    session = await svc.sessions.current(request)
    if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
        return _expired_session(request)
    typed = form.get("user_code", "")
    code = user_codes.normalise(typed)
    if code is None:
        # Not a possible code, so not a guess: not counted.
        return _code_page(request, session, user_code=typed, error=BAD_FORMAT, status=400)
    now = time.time()
    window = settings.window.total_seconds()
    limits = (
        Cap(f"device:session:{session.record.session_hash.hex()}", settings.max_failures, window),
        Cap(f"device:ip:{svc.client_address(request)}", settings.max_failures_per_address, window),
    )
    # The guess is charged before the code is looked up, in the same step as the check of
    # the limits: guesses sent at once cannot all be looked up before any is counted.
    refused = await svc.store.reserve_attempt(limits, now)
    if refused is not None:
        log.warning("device code entry throttled", extra={"key_kind": refused.key.split(":")[1]})
        response = _code_page(request, session, user_code=typed, error=TOO_MANY, status=429)
        response.headers["Retry-After"] = str(max(1, int(refused.retry_after)))
        return response
    found = await _pending(svc, code, now)
    if found is None:
        return _code_page(request, session, user_code=typed, error=UNKNOWN, status=400)
    # A right code is not a guess: its charge is given back.
    await svc.store.release_attempt([limit.key for limit in limits], now)
    record, client = found
    if not session.logged_in:
        return _login_page(request, session, client, code)
    return _consent_page(request, session, client, record)


async def login(request: web.Request) -> web.Response:
    """POST /device/login: the password, then the consent page."""
    svc = services(request)
    form = await _form(request)
    if form is None:
        return _malformed(request)
    session = await svc.sessions.current(request)
    if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
        return _expired_session(request)
    code = user_codes.normalise(form.get("user_code", ""))
    if code is None or not _proof_valid(session, code, form.get(PROOF)):
        return error_page(request, 400, "This code was not checked", GONE)
    found = await _pending(svc, code, time.time())
    if found is None:
        return error_page(request, 400, "This code cannot be used", GONE)
    record, client = found
    username = form.get("username", "")
    outcome = await signin.check_password(svc, request, username, form.get("password", ""))
    if isinstance(outcome, signin.Throttled):
        response = _login_page(
            request, session, client, code, error=signin.THROTTLED, status=429, username=username
        )
        response.headers["Retry-After"] = str(outcome.retry_after)
        return response
    if outcome is None:
        return _login_page(
            request, session, client, code, error=signin.WRONG, status=400, username=username
        )
    new_session = await svc.sessions.login(request, svc.settings.subject_of(outcome))
    return _consent_page(request, new_session, client, record)


async def consent(request: web.Request) -> web.Response:
    """POST /device/consent: the person's decision."""
    svc = services(request)
    form = await _form(request)
    if form is None:
        return _malformed(request)
    session = await svc.sessions.current(request)
    if (
        session is None
        or not session.logged_in
        or not Sessions.csrf_valid(session, form.get("csrf_token"))
    ):
        return _expired_session(request)
    code = user_codes.normalise(form.get("user_code", ""))
    if code is None or not _proof_valid(session, code, form.get(PROOF)):
        return error_page(request, 400, "This code was not checked", GONE)
    decision = form.get("decision")
    if decision not in ("approve", "deny"):
        return error_page(request, 400, "No decision", "Choose Allow or Deny.")
    now = time.time()
    found = await _pending(svc, code, now)
    decided = found is not None and await svc.store.decide_device(
        code,
        session.record.subject,
        decision == "approve",
        now,
        auth_time=session.record.auth_time,
    )
    if found is None or not decided:
        return error_page(request, 400, "This code cannot be used", GONE)
    _, client = found
    log.info(
        "device decided",
        extra={"client_id": client.client_id, "decision": decision},
    )
    if decision == "deny":
        return _done_page(
            request,
            "Device denied",
            f"{client.client_name} will not get access. You can close this window.",
        )
    return _done_page(
        request,
        "Device connected",
        f"{client.client_name} now has access. Go back to your device: it will continue on "
        "its own. You can close this window.",
    )
