"""The device page (RFC 8628 §3.3): a person enters the code their device shows, signs in if
needed, and approves or denies the device.

Steps, each a form posted back with the session's CSRF token:
 1. GET /device: the code field, prefilled from `verification_uri_complete` — the person
    still confirms it (§3.3.1), and a GET never looks a code up;
 2. POST /device: the code is checked. Guesses are throttled per session and per client
    address (below), each charged before its code is looked up and kept when it is wrong;
 3. POST /device/login: the login form, when the session is not signed in, with the
    password checks and throttle of every login form; for a user with a second factor,
    then the second step, as on the authorization endpoint's sign-in (the pending sign-in
    of endpoints/signin.py): POST /device/login/code, the code of their authenticator app,
    or POST /device/login/passkey, one of their passkeys (endpoints/passkeys.py; its
    challenge bound to the user code as the pending sign-in is). The form also offers a
    passkey instead of the password, as the login page does (POST /device/login/passkey
    without a pending sign-in: any discoverable passkey, user verification required, its
    challenge bound to the user code), and a button per
    upstream identity provider (`identity_providers`), as the authorization endpoint's
    does: the sign-in there carries the user code, bound to this session by the link's
    proof (federation.py), and comes back to step 4 for it, or to the second step first.
    With `password_sign_in: false` the form has no password and POST /device/login
    refuses before reading the form;
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
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timedelta

from aiohttp import web

from portcullis.addresses import ClientAddresses

from .. import audit
from ..audit import Event
from ..factors import Method, methods_of, multi_factor
from ..protocol import user_codes
from ..protocol.errors import OAuthError
from ..protocol.lifecycle import DEVICE, Device, decide
from ..protocol.resources import Audiences
from ..protocol.throttle import Cap
from ..registry import Client
from ..sessions import Session, Sessions
from ..store.base import DeviceRecord
from . import signin
from .forms import read_form
from .passkey_offers import has_second_factor

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


def code_checked(session: Session, form: dict[str, str]) -> str | None:
    """The user code a form of steps 3 and 4 carries, when its proof says this session
    passed step 2 with it; None otherwise (and then the code is never looked up)."""
    code = user_codes.normalise(form.get("user_code", ""))
    if code is None or not _proof_valid(session, code, form.get(PROOF)):
        return None
    return code


def bound_to(code: str) -> list[tuple[str, str]]:
    """What a pending sign-in, and a passkey's challenge, on the device page is bound to."""
    return [("user_code", code)]


async def _form(request: web.Request) -> dict[str, str] | None:
    try:
        return await read_form(request)
    except OAuthError:
        return None


@dataclass(frozen=True)
class CodeGuesses:
    """How many wrong user codes one browser session, and one client address, may type in
    any `window` of time (`device` in the configuration)."""

    per_session: int
    per_address: int
    window: timedelta


class DevicePages(signin.SignInPage):
    def __init__(
        self,
        services: signin.SignInServices,
        *,
        guesses: CodeGuesses,
        addresses: ClientAddresses,
        audiences: Audiences,
    ) -> None:
        super().__init__(services)
        self.audiences = audiences
        self.guesses = guesses
        self.addresses = addresses

    # ------------------------------------------------------------------------- pages

    def _expired_session(self) -> web.Response:
        return self.pages.error(
            403,
            "Your session expired",
            "Please open the device page again and enter the code.",
            "csrf",
        )

    def _malformed(self) -> web.Response:
        return self.pages.error(400, "This request cannot be handled", "The form is malformed.")

    def _code_page(
        self,
        session: Session,
        *,
        user_code: str = "",
        error: str | None = None,
        status: int = 200,
    ) -> web.Response:
        response = self.pages.render(
            "device.html",
            status=status,
            title="Connect a device",
            action=self.base_path + "/device",
            csrf_token=Sessions.csrf_token(session),
            user_code=user_code,
            error=error,
        )
        self.sessions.set_cookie(response, session)
        return response

    async def _second_step_page(
        self,
        session: Session,
        client: Client,
        code: str,
        subject: str,
        *,
        until: float | None = None,
        error: str | None = None,
        status: int = 200,
        first: signin.FirstStep = signin.PASSWORD_STEP,
    ) -> web.Response:
        """The code of the user's app, or one of their passkeys (as the authorization
        endpoint's code_page offers them), after the first step `first`."""
        expires = self.clock() + signin.PENDING.total_seconds() if until is None else until
        bound = bound_to(code)
        carried = [
            *bound,
            (PROOF, _proof(session, code)),
            *signin.PendingSignIn.fields(session, subject, expires, bound, first),
        ]
        passkey = None
        if self.passkeys is not None:
            passkey = await self.passkeys.offer_second_step(
                session, subject, bound, carried, device=True
            )
        response = self.pages.render(
            "second_step.html",
            status=status,
            title="Enter your code",
            action=self.base_path + "/device/login/code",
            csrf_token=Sessions.csrf_token(session),
            carried=carried,
            client_name=client.client_name,
            error=error,
            passkey=passkey,
            app=await self.factors.enrolled(subject),
        )
        self.sessions.set_cookie(response, session)
        return response

    def _login_page(
        self,
        session: Session,
        client: Client,
        code: str,
        *,
        error: str | None = None,
        status: int = 200,
        username: str | None = None,
    ) -> web.Response:
        carried = [("user_code", code), (PROOF, _proof(session, code))]
        response = self.pages.render(
            "login.html",
            status=status,
            title="Sign in",
            action=self.base_path + "/device/login",
            csrf_token=Sessions.csrf_token(session),
            carried=carried,
            client_name=client.client_name,
            error=error,
            username=username,
            password_form=self.password_sign_in,
            providers=(
                self.sign_in_links(session, [("user_code", code)]) if self.sign_in_links else []
            ),
            passkey=(
                self.passkeys.offer_sign_in(session, bound_to(code), device=carried)
                if self.passkeys is not None
                else None
            ),
        )
        self.sessions.set_cookie(response, session)
        return response

    async def _second_factor_missing(self, session: Session, client: Client) -> web.Response | None:
        """The refusal when this sign-in needs a second factor it did not use (the client
        or the operator requires one); None when it may go on. The device page asks for
        no level (it has no acr_values) and sets up no factor: the person does that first,
        at /factors (an authenticator app) or on the account page (a passkey), and starts
        again."""
        if multi_factor(session.amr):
            return None
        subject = session.record.subject
        user = await self.users.by_subject(subject)
        required = client.require_mfa or (
            user is not None and self.requirement.applies_to(user.roles)
        )
        if not required:
            return None
        if await has_second_factor(self.factors, self.passkeys, subject):
            message = (
                "This device needs you signed in with your second factor: sign out, then "
                "enter the code of your device again."
            )
        else:
            kinds = []
            if self.factors.available:
                kinds.append("an authenticator app")
            if self.passkeys is not None and self.passkeys.available:
                kinds.append("a passkey")
            how = (
                f"set up {' or '.join(kinds)} at {self.base_path}/factors"
                if kinds
                else "ask the operator to let you set one up"
            )
            message = (
                f"Your account needs a second factor first: {how}, then enter the code of "
                "your device again."
            )
        return self.pages.error(403, "A second factor is required", message, "mfa_required")

    async def _consent_page(
        self, session: Session, client: Client, record: DeviceRecord
    ) -> web.Response:
        refused = await self._second_factor_missing(session, client)
        if refused is not None:
            return refused
        user = await self.users.by_subject(session.record.subject)
        shown = user_codes.display(record.user_code)
        response = self.pages.render(
            "consent.html",
            title="Allow a device",
            action=self.base_path + "/device/consent",
            csrf_token=Sessions.csrf_token(session),
            carried=[("user_code", record.user_code), (PROOF, _proof(session, record.user_code))],
            client_name=client.client_name,
            client_host=None,  # no metadata document client has the device grant
            scopes=[
                {"name": s, "description": self.scope_description(s)} for s in record.scope.split()
            ],
            resource=self.audiences.shown(record.audience),
            user_name=user.display_name if user else session.record.subject,
            warning=(
                f"Allow this only if you started signing in on a device you are holding and it "
                f"shows the code {shown}. If someone sent you this code, deny: they would get "
                "access to your account."
            ),
        )
        self.sessions.set_cookie(response, session)
        return response

    def _done_page(self, heading: str, message: str) -> web.Response:
        return self.pages.render(
            "device_done.html", title=heading, heading=heading, message=message
        )

    async def _pending(self, code: str, now: float) -> tuple[DeviceRecord, Client] | None:
        record = await self.store.device_by_user_code(code, now)
        if record is None or record.state != Device.PENDING:
            return None
        client = await self.clients.client(record.client_id)
        if client is None:
            return None  # the client was removed from the configuration
        return record, client

    # ------------------------------------------------------------------------- handlers

    async def device_page(self, request: web.Request) -> web.Response:
        """GET /device: the code form, prefilled from `?user_code=` when it is well formed."""
        session = await self.sessions.ensure(request)
        code = user_codes.normalise(request.query.get("user_code", ""))
        return self._code_page(session, user_code=user_codes.display(code) if code else "")

    async def check_code(self, request: web.Request) -> web.Response:
        """POST /device: the code the person typed (throttled), then login or consent."""
        guesses = self.guesses
        form = await _form(request)
        if form is None:
            return self._malformed()
        session = await self.sessions.current(request)
        if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
            return self._expired_session()
        typed = form.get("user_code", "")
        code = user_codes.normalise(typed)
        if code is None:
            # Not a possible code, so not a guess: not counted.
            return self._code_page(session, user_code=typed, error=BAD_FORMAT, status=400)
        now = self.clock()
        window = guesses.window.total_seconds()
        address = signin.client_address(self.addresses, request)
        limits = (
            Cap(
                f"device:session:{session.record.session_hash.hex()}",
                guesses.per_session,
                window,
            ),
            Cap(f"device:ip:{address}", guesses.per_address, window),
        )
        # The guess is charged before the code is looked up, in the same step as the check of
        # the limits: guesses sent at once cannot all be looked up before any is counted.
        refused = await self.store.reserve_attempt(limits, now)
        if refused is not None:
            log.warning(
                "device code entry throttled", extra={"key_kind": refused.key.split(":")[1]}
            )
            response = self._code_page(session, user_code=typed, error=TOO_MANY, status=429)
            response.headers["Retry-After"] = str(max(1, int(refused.retry_after)))
            return response
        found = await self._pending(code, now)
        if found is None:
            return self._code_page(session, user_code=typed, error=UNKNOWN, status=400)
        # A right code is not a guess: its charge is given back.
        await self.store.release_attempt([limit.key for limit in limits], now)
        record, client = found
        if not session.logged_in:
            return self._login_page(session, client, code)
        return await self._consent_page(session, client, record)

    async def login(self, request: web.Request) -> web.Response:
        """POST /device/login: the password, then the consent page."""
        if not self.password_sign_in:
            return signin.password_refused(self.pages)
        form = await _form(request)
        if form is None:
            return self._malformed()
        session = await self.sessions.current(request)
        if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
            return self._expired_session()
        code = user_codes.normalise(form.get("user_code", ""))
        if code is None or not _proof_valid(session, code, form.get(PROOF)):
            return self.pages.error(400, "This code was not checked", GONE)
        found = await self._pending(code, self.clock())
        if found is None:
            return self.pages.error(400, "This code cannot be used", GONE)
        record, client = found
        username = form.get("username", "")
        outcome = await self.passwords.check(
            request, username, form.get("password", ""), client.client_id
        )
        if isinstance(outcome, signin.Throttled):
            response = self._login_page(
                session, client, code, error=signin.THROTTLED, status=429, username=username
            )
            response.headers["Retry-After"] = str(outcome.retry_after)
            return response
        if outcome is None:
            return self._login_page(
                session, client, code, error=signin.WRONG, status=400, username=username
            )
        if await has_second_factor(self.factors, self.passkeys, outcome.subject):
            return await self._second_step_page(session, client, code, outcome.subject)
        new_session = await self.sessions.login(
            request, outcome.subject, methods_of(Method.PASSWORD)
        )
        return await self._consent_page(new_session, client, record)

    async def login_code(self, request: web.Request) -> web.Response:
        """POST /device/login/code: the code of the user's app, then the consent page."""
        form = await _form(request)
        if form is None:
            return self._malformed()
        session = await self.sessions.current(request)
        if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
            return self._expired_session()
        code = code_checked(session, form)
        if code is None:
            return self.not_checked()
        now = self.clock()
        pending = signin.PendingSignIn.verified(session, form, bound_to(code), now)
        if pending is None:
            return self.sign_in_expired()
        found = await self._pending(code, now)
        if found is None:
            return self.pages.error(400, "This code cannot be used", GONE)
        record, client = found
        until = float(form[signin.PENDING_UNTIL])

        def again(error: str, status: int) -> Awaitable[web.Response]:
            return self._second_step_page(
                session,
                client,
                code,
                pending.subject,
                until=until,
                error=error,
                status=status,
                first=pending.first,
            )

        signed_in = await self.codes.second_step(request, pending, form, self.sessions, again)
        if isinstance(signed_in, web.Response):
            return signed_in
        return await self._consent_page(signed_in, client, record)

    # ------------------------------------------------- a sign-in through an identity provider

    async def pending_code(self, code: str) -> tuple[DeviceRecord, Client] | None:
        """The device waiting for `code` and its client; None when it no longer waits."""
        return await self._pending(code, self.clock())

    def login_page(
        self, session: Session, client: Client, code: str, *, error: str, status: int
    ) -> web.Response:
        """The sign-in form for `code` again, saying what went wrong at the provider."""
        return self._login_page(session, client, code, error=error, status=status)

    async def second_step_page(
        self,
        session: Session,
        client: Client,
        code: str,
        subject: str,
        first: signin.FirstStep,
        *,
        until: float | None = None,
        error: str | None = None,
        status: int = 200,
    ) -> web.Response:
        """The second step after `first` (the provider, or the password): the code of the
        user's app or one of their passkeys; again, saying what went wrong, with `error`."""
        return await self._second_step_page(
            session, client, code, subject, until=until, error=error, status=status, first=first
        )

    def not_checked(self) -> web.Response:
        """A form of steps 3 and 4 without the proof that its code passed step 2."""
        return self.pages.error(400, "This code was not checked", GONE)

    def sign_in_expired(self) -> web.Response:
        return self.pages.error(
            403,
            "Please sign in again",
            "This sign-in has expired. Enter the code of your device again.",
            "login_expired",
        )

    def expired_session(self) -> web.Response:
        return self._expired_session()

    async def signed_in(
        self, session: Session, client: Client, record: DeviceRecord
    ) -> web.Response:
        """Step 4 for a session just signed in: the device's consent page."""
        return await self._consent_page(session, client, record)

    async def consent(self, request: web.Request) -> web.Response:
        """POST /device/consent: the person's decision."""
        form = await _form(request)
        if form is None:
            return self._malformed()
        session = await self.sessions.current(request)
        if (
            session is None
            or not session.logged_in
            or not Sessions.csrf_valid(session, form.get("csrf_token"))
        ):
            return self._expired_session()
        code = user_codes.normalise(form.get("user_code", ""))
        if code is None or not _proof_valid(session, code, form.get(PROOF)):
            return self.pages.error(400, "This code was not checked", GONE)
        decision = form.get("decision")
        if decision not in ("approve", "deny"):
            return self.pages.error(400, "No decision", "Choose Allow or Deny.")
        now = self.clock()
        found = await self._pending(code, now)
        if found is None:
            return self.pages.error(400, "This code cannot be used", GONE)
        record, client = found
        refused = await self._second_factor_missing(session, client)
        if refused is not None:
            return refused
        move = decide(DEVICE, record.state, decision).move
        decided = await self.store.decide_device(
            code,
            move,
            session.record.subject,
            now,
            auth_time=session.record.auth_time,
            amr=session.amr,
        )
        if not decided:
            return self.pages.error(400, "This code cannot be used", GONE)
        audit.record(
            Event.CONSENT_GIVEN if decision == "approve" else Event.CONSENT_DENIED,
            audit.USER,
            client_id=client.client_id,
            subject=session.record.subject,
            scope=record.scope,
            grant_type="urn:ietf:params:oauth:grant-type:device_code",
        )
        if decision == "deny":
            return self._done_page(
                "Device denied",
                f"{client.client_name} will not get access. You can close this window.",
            )
        return self._done_page(
            "Device connected",
            f"{client.client_name} now has access. Go back to your device: it will continue on "
            "its own. You can close this window.",
        )
