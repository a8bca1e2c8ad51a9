"""Passkeys at sign-in and on the account page (authserver/passkeys.py does the ceremonies).

 POST /login/passkey            an assertion for the authorization request the form
                                carries: passwordless (a discoverable passkey, its user
                                handle naming the user, user verification required), or,
                                with a pending sign-in's fields, the second step after the
                                password (one of that user's passkeys);
 POST /account/login/passkey    the same for the account page's own sign-in;
 POST /device/login/passkey     the same for the device page's sign-in, for the user code
                                the form carries with its proof (endpoints/device.py):
                                passwordless, or the second step after the password or an
                                upstream provider;
 POST /account/passkeys         a new passkey for the signed-in user, named by them; from
                                the page that leads a user to set up a second factor, with
                                the authorization request carried, which goes on at its
                                second step, where the new passkey is used;
 POST /account/passkeys/remove  one of their passkeys removed.
Each page that offers a ceremony issues its challenge (`offer_*`): the page's script
(static/passkeys.js) runs the browser's side and posts the form; without JavaScript the
passkey forms stay hidden and everything else works. Every form carries the session's CSRF
token and the challenge's proof; a failed assertion is charged to the throttle codes have
(endpoints/signin.py), under the user (second step) or the address (passwordless), before
it is checked. Creating a passkey needs a recent sign-in, as setting up an authenticator app
does (factors.ENROLMENT_NEEDS_SIGN_IN_WITHIN); removing one needs that or the current
password, as removing the app does (AccountPages.recent_or_password). Every outcome is an
audit event: the `factor.*` events of authenticator apps, with `reason` naming the
passkey's check that failed, and `factor.sign_count_regressed` (a warning) for a counter
that went back.
"""

from __future__ import annotations

from aiohttp import web

from portcullis.addresses import ClientAddresses

from .. import audit
from ..audit import Event
from ..clock import Clock
from ..factors import ENROLMENT_NEEDS_SIGN_IN_WITHIN, SecondFactors
from ..metrics import Metrics
from ..passkeys import (
    COUNTER,
    EXPIRED,
    MAX_PER_USER,
    RESPONSE,
    TOO_MANY,
    Assertion,
    Passkeys,
    Purpose,
    Refusal,
)
from ..protocol import webauthn
from ..protocol.errors import OAuthError
from ..protocol.throttle import Refuse
from ..registry import UserDirectory
from ..sessions import Session, Sessions
from ..store.base import PasskeyRecord, SignInRecord, Store
from . import signin
from .account import AccountPages
from .authorize import CARRIED, AuthorizationEndpoint, PageError, Parameters, RedirectError
from .device import GONE as DEVICE_GONE
from .device import DevicePages, bound_to, code_checked
from .forms import form_items, read_form
from .pages import Pages
from .passkey_offers import ACCOUNT_BOUND, subject_bound

FACTOR = "passkey"
THROTTLED = "Too many failed passkey attempts. Please wait a few minutes and try again."
NAME_PROBLEM = "Give the passkey a name of 1 to 64 characters, to tell it from others."
RECENT = ENROLMENT_NEEDS_SIGN_IN_WITHIN


class PasskeyCheck:
    """A posted assertion, behind the sign-in throttle, with its audit events."""

    def __init__(
        self,
        passkeys: Passkeys,
        store: Store,
        users: UserDirectory,
        rules: signin.LoginRules,
        addresses: ClientAddresses,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.passkeys = passkeys
        self.store = store
        self.users = users
        self.rules = rules
        self.addresses = addresses
        self.clock = clock
        self.metrics = metrics

    async def check(
        self,
        request: web.Request,
        session: Session,
        form: dict[str, str],
        bound: list[tuple[str, str]],
        subject: str | None,
        client_id: str | None,
    ) -> Assertion | Refusal | signin.Throttled:
        """The passkey of `subject` (a second step) or of anyone (passwordless, None) that
        answered the challenge the form presents."""
        now = self.clock()
        address = signin.client_address(self.addresses, request)
        # A second step counts with the user's codes (one budget whatever the factor); a
        # passwordless attempt names nobody until it verifies: its address counts, for its
        # "user" count too. One name for all of them would be a count anyone could charge to
        # hold back everyone's passwordless sign-in.
        limits = signin.LoginLimits.of(
            self.rules,
            subject or f"passwordless {address}",
            address,
            kind="code" if subject else "passkey",
        )
        refused = await self.store.reserve_attempt(
            (limits.at_address, limits.address, limits.username), now
        )
        if isinstance(refused, Refuse):
            self.metrics.login_throttled()
            self.metrics.count_factor(FACTOR, "throttled")
            audit.record(
                Event.FACTOR_THROTTLED,
                audit.USER,
                subject=subject,
                client_id=client_id,
                address=address,
                reason=refused.key.split(":")[1],
                factor=FACTOR,
            )
            return signin.Throttled(max(1, int(refused.retry_after)))
        purpose = Purpose.SECOND_STEP if subject else Purpose.PASSWORDLESS
        ceremony_bound = subject_bound(bound, subject) if subject else bound
        challenge = await self.passkeys.consume(session, purpose, form, ceremony_bound)
        outcome: Assertion | Refusal
        if challenge is None:
            outcome = EXPIRED
        else:
            outcome = await self.passkeys.authenticate(form.get(RESPONSE, ""), challenge, subject)
        if (
            isinstance(outcome, Assertion)
            and await self.users.by_subject(outcome.record.subject) is None
        ):
            outcome = EXPIRED  # the user was disabled or removed meanwhile
        if isinstance(outcome, Refusal):
            self.metrics.login_failed()
            self.metrics.count_factor(FACTOR, "failed")
            audit.record(
                Event.FACTOR_SIGN_COUNT_REGRESSED if outcome is COUNTER else Event.FACTOR_FAILED,
                audit.USER,
                subject=subject,
                client_id=client_id,
                address=address,
                reason=outcome.reason,
                factor=FACTOR,
            )
            return outcome
        await self.store.clear_failures(limits.at_address.key)
        await self.store.release_attempt((limits.address.key, limits.username.key), now)
        owner = outcome.record.subject
        self.metrics.count_factor(FACTOR, "succeeded")
        audit.record(
            Event.FACTOR_USED,
            audit.USER,
            subject=owner,
            client_id=client_id,
            address=address,
            factor=FACTOR,
        )
        if subject is None:
            # Passwordless: this was the sign-in, as a right password is.
            audit.record(
                Event.SIGNIN_SUCCEEDED,
                audit.USER,
                client_id=client_id,
                subject=owner,
                address=address,
            )
            await self.store.record_sign_in(
                SignInRecord(
                    owner,
                    now,
                    "succeeded",
                    address,
                    client_id,
                    now + signin.SIGN_IN_RETENTION.total_seconds(),
                )
            )
        return outcome


class PasskeyPages:
    def __init__(
        self,
        *,
        passkeys: Passkeys,
        check: PasskeyCheck,
        users: UserDirectory,
        sessions: Sessions,
        pages: Pages,
        authorize: AuthorizationEndpoint,
        account: AccountPages,
        device: DevicePages,
        factors: SecondFactors,
        base_path: str,
        clock: Clock,
    ) -> None:
        self.device = device
        self.passkeys = passkeys
        self.check = check
        self.users = users
        self.sessions = sessions
        self.pages = pages
        self.authorize = authorize
        self.account = account
        self.factors = factors
        self.base_path = base_path
        self.clock = clock

    @property
    def account_path(self) -> str:
        return self.base_path + "/account"

    # ------------------------------------------------------------------ sign-in

    async def sign_in(self, request: web.Request) -> web.StreamResponse:
        """POST /login/passkey: passwordless, or the second step of a pending sign-in."""
        authorize = self.authorize
        try:
            given = Parameters.collect(await form_items(request))
            form = given.values
            auth = await authorize.validate(given)
            session = await self.sessions.current(request)
            if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
                return self._expired()
            bound = auth.carried()
            pending = None
            if signin.PENDING_SUBJECT in form:
                pending = signin.PendingSignIn.verified(session, form, bound, self.clock())
                if pending is None:
                    return self._sign_in_expired()
            subject = pending.subject if pending is not None else None
            outcome = await self.check.check(
                request, session, form, bound, subject, auth.client.client_id
            )
            if not isinstance(outcome, Assertion):
                error, status = _refused(outcome)
                if subject is None:
                    response = await authorize.login_page(request, auth, error=error, status=status)
                else:
                    assert pending is not None
                    response = await authorize.code_page(
                        request,
                        auth,
                        session,
                        subject,
                        until=float(form[signin.PENDING_UNTIL]),
                        error=error,
                        status=status,
                        first=pending.first,  # the provider's methods stay the first step's
                    )
                _retry_after(response, outcome)
                return response
            new_session = await self.sessions.login(request, *_signed_in(outcome, pending))
            return await authorize.proceed(request, auth, new_session, login_done=True)
        except PageError as exc:
            return self.pages.error(400, "This sign-in request cannot be handled", exc.message)
        except RedirectError as exc:
            return authorize.error_redirect(request, exc)
        except OAuthError as exc:
            return self.pages.error(400, "This sign-in request cannot be handled", exc.description)

    async def account_sign_in(self, request: web.Request) -> web.StreamResponse:
        """POST /account/login/passkey: as /login/passkey, for the account page."""
        try:
            form = await read_form(request)
        except OAuthError as exc:
            return self.pages.error(400, "This form cannot be read", exc.description)
        session = await self.sessions.current(request)
        if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
            return self._expired()
        pending = None
        if signin.PENDING_SUBJECT in form:
            pending = signin.PendingSignIn.verified(session, form, ACCOUNT_BOUND, self.clock())
            if pending is None:
                return self._sign_in_expired()
        subject = pending.subject if pending is not None else None
        outcome = await self.check.check(request, session, form, ACCOUNT_BOUND, subject, None)
        if not isinstance(outcome, Assertion):
            error, status = _refused(outcome)
            if subject is None:
                response = await self.account.sign_in_page(request, error=error, status=status)
            else:
                assert pending is not None
                response = await self.account.code_page(
                    session,
                    subject,
                    until=float(form[signin.PENDING_UNTIL]),
                    error=error,
                    status=status,
                    first=pending.first,
                )
            _retry_after(response, outcome)
            return response
        new_session = await self.sessions.login(request, *_signed_in(outcome, pending))
        response = web.Response(
            status=303, headers={"Location": self.account_path, "Cache-Control": "no-store"}
        )
        self.sessions.set_cookie(response, new_session)
        return response

    async def device_sign_in(self, request: web.Request) -> web.StreamResponse:
        """POST /device/login/passkey: passwordless from the device page's sign-in form, or
        the second step of its pending sign-in; then the device's consent page."""
        device = self.device
        try:
            form = await read_form(request)
        except OAuthError as exc:
            return self.pages.error(400, "This form cannot be read", exc.description)
        session = await self.sessions.current(request)
        if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
            return device.expired_session()
        # As at /device/login/code: no code is looked up before its proof holds.
        code = code_checked(session, form)
        if code is None:
            return device.not_checked()
        bound = bound_to(code)
        pending = None
        if signin.PENDING_SUBJECT in form:
            pending = signin.PendingSignIn.verified(session, form, bound, self.clock())
            if pending is None:
                return device.sign_in_expired()
        found = await device.pending_code(code)
        if found is None:
            return self.pages.error(400, "This code cannot be used", DEVICE_GONE)
        record, client = found
        subject = pending.subject if pending is not None else None
        outcome = await self.check.check(request, session, form, bound, subject, client.client_id)
        if not isinstance(outcome, Assertion):
            error, status = _refused(outcome)
            if pending is None:
                response: web.Response = device.login_page(
                    session, client, code, error=error, status=status
                )
                _retry_after(response, outcome)
                return response
            response = await device.second_step_page(
                session,
                client,
                code,
                pending.subject,
                pending.first,
                until=float(form[signin.PENDING_UNTIL]),
                error=error,
                status=status,
            )
            _retry_after(response, outcome)
            return response
        new_session = await self.sessions.login(request, *_signed_in(outcome, pending))
        return await device.signed_in(new_session, client, record)

    # ------------------------------------------------------------------ the account page

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /account/passkeys: `name`, the ceremony's fields and the new credential."""
        found = await self._signed_in_form(request)
        if isinstance(found, web.Response):
            return found
        session, form = found
        subject = session.record.subject
        if self.clock() - session.record.auth_time > RECENT.total_seconds():
            return self.pages.error(
                401,
                "Please sign in again",
                "Adding a passkey needs a recent sign-in: sign out, sign in again, then come "
                "back to your account page.",
                "login_required",
            )
        name = webauthn.passkey_name(form.get("name", ""))
        if name is None:
            return self.pages.error(400, "The passkey needs a name", NAME_PROBLEM, "invalid_name")
        handle = webauthn.base64url(form.get("user_handle", ""), 64)
        challenge = await self.passkeys.consume(
            session, Purpose.CREATE, form, subject_bound([], subject)
        )
        # The handle the page was given must be the user's: theirs, or new when they have none.
        theirs = await self.passkeys.of(subject)
        if handle is None or len(handle) != 32 or (theirs and theirs[0].user_handle != handle):
            challenge = None
        first_factor = not theirs and not await self.factors.enrolled(subject)
        outcome: PasskeyRecord | Refusal
        if challenge is None:
            outcome = EXPIRED
        elif len(theirs) >= MAX_PER_USER:
            outcome = TOO_MANY
        else:
            outcome = await self.passkeys.register(
                subject, handle or b"", name, form.get(RESPONSE, ""), challenge
            )
        if isinstance(outcome, Refusal):
            audit.record(
                Event.FACTOR_FAILED,
                audit.USER,
                subject=subject,
                reason=outcome.reason,
                factor=FACTOR,
            )
            return self.pages.error(
                409 if outcome is TOO_MANY else 400,
                "The passkey was not added",
                outcome.message,
                outcome.reason,
            )
        self.check.metrics.factor_changed(FACTOR, "enrolled")
        audit.record(Event.FACTOR_ENROLLED, audit.USER, subject=subject, factor=FACTOR)
        if first_factor:
            # As when an authenticator app is set up: sessions signed in before the user had
            # a second factor, without one, end here; from now on every session met it.
            this = session.record.session_hash
            ended = await self.sessions.store.delete_other_sessions(subject, this)
            audit.record(Event.SESSIONS_ENDED, audit.USER, subject=subject, sessions=ended)
        carried = [(name, form[name]) for name in CARRIED if name in form]
        if carried:
            return await self._go_on(request, session, carried)
        return self._back("passkey-added")

    async def _go_on(
        self, request: web.Request, session: Session, carried: list[tuple[str, str]]
    ) -> web.StreamResponse:
        """The authorization request a passkey was added for (the page that leads a user
        to set up a second factor brought it), validated again from its first check: its
        second step, with the new passkey."""
        authorize = self.authorize
        try:
            auth = await authorize.validate(Parameters.collect(carried))
            return await authorize.after_enrolment(request, auth, session)
        except PageError as exc:
            return self.pages.error(400, "This sign-in request cannot be handled", exc.message)
        except RedirectError as exc:
            return authorize.error_redirect(request, exc)

    async def remove(self, request: web.Request) -> web.StreamResponse:
        """POST /account/passkeys/remove: `credential`, one of the user's passkeys."""
        found = await self._signed_in_form(request)
        if isinstance(found, web.Response):
            return found
        session, form = found
        subject = session.record.subject
        credential_id = webauthn.base64url(form.get("credential", ""), webauthn.MAX_CREDENTIAL_ID)
        theirs = {p.credential_id for p in await self.passkeys.of(subject)}
        # Whose it is first: another user's credential is no passkey of this account, and
        # answers nothing about that account's factors.
        if credential_id is None or credential_id not in theirs:
            return self._no_such_passkey()
        if await self.account.last_required_factor(subject):
            return self.pages.error(
                409,
                "This passkey cannot be removed",
                "Your account must sign in with a second factor, and this passkey is its "
                "only one: add another passkey or an authenticator app first.",
                "only_factor",
            )
        # As removing the authenticator app: a session cookie left on a shared computer
        # must not be enough to strip a second factor.
        refused = await self.account.recent_or_password(request, session, form, section="passkeys")
        if refused is not None:
            return refused
        if not await self.passkeys.remove(subject, credential_id):
            return self._no_such_passkey()  # removed meanwhile
        self.check.metrics.factor_changed(FACTOR, "removed")
        audit.record(Event.FACTOR_REMOVED, audit.USER, subject=subject, factor=FACTOR)
        return self._back("passkey-removed")

    # ------------------------------------------------------------------ steps

    async def _signed_in_form(
        self, request: web.Request
    ) -> tuple[Session, dict[str, str]] | web.Response:
        if not self.passkeys.available:
            return self.pages.error(
                404,
                "Passkeys are not available here",
                "This server's address cannot hold passkeys: its operator has to serve it "
                "over https.",
                "not_available",
            )
        return await signin.signed_in_form(request, self.sessions, self.pages, self._not_signed_in)

    def _not_signed_in(self) -> web.Response:
        return self.pages.error(
            401, "Please sign in first", "Open your account page and sign in.", "login_required"
        )

    def _no_such_passkey(self) -> web.Response:
        return self.pages.error(
            400, "Nothing to remove", "Your account has no such passkey.", "no_passkey"
        )

    def _back(self, notice: str) -> web.Response:
        return web.Response(
            status=303,
            headers={"Location": f"{self.account_path}?done={notice}", "Cache-Control": "no-store"},
        )

    def _expired(self) -> web.Response:
        return signin.session_expired(self.pages)

    def _sign_in_expired(self) -> web.Response:
        return self.pages.error(
            403,
            "Please sign in again",
            "This sign-in has expired. Go back to the application and try again.",
            "login_expired",
        )


def _signed_in(
    outcome: Assertion, pending: signin.Pending | None
) -> tuple[str, tuple[str, ...], float | None]:
    """The subject, `amr` and sign-in time of the session a passkey signs in: passwordless,
    now; or as the second step, after the first step the pending sign-in proves (whose time
    is kept when an upstream provider gave one)."""
    if pending is None:
        return outcome.record.subject, outcome.methods(None), None
    first = pending.first
    return outcome.record.subject, outcome.methods(first.methods), first.auth_time


def _refused(outcome: Refusal | signin.Throttled) -> tuple[str, int]:
    if isinstance(outcome, signin.Throttled):
        return THROTTLED, 429
    return outcome.message, 400


def _retry_after(response: web.StreamResponse, outcome: Refusal | signin.Throttled) -> None:
    if isinstance(outcome, signin.Throttled):
        response.headers["Retry-After"] = str(outcome.retry_after)
