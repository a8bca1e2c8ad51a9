"""The second-factor pages of a signed-in user: setting up an authenticator app.

 GET  /factors               what the user has, and a button to set up an app; where
                             passkeys work (passkeys.Passkeys.available), how many the user
                             has and the form adding one (posted to /account/passkeys,
                             endpoints/passkeys.py), or alone on a server that keeps no
                             apps (no encryption key);
 POST /factors/totp          a new secret (a QR code, and the secret in groups of four to
                             type), waiting for a code of it;
 POST /factors/totp/confirm  the code: the app becomes the user's second factor, and the
                             recovery codes are shown, once.
Every form carries the session's CSRF token; a page for a visitor who is not signed in, a
stale form or a wrong code changes nothing. Setting an app up needs a recent sign-in
(factors.ENROLMENT_NEEDS_SIGN_IN_WITHIN). A user led here by the sign-in (an application
or the operator requires a second factor) brings the authorization request along as hidden
fields: once the app is set up, the page continues it, signed in with both factors.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import segno
from aiohttp import web
from markupsafe import Markup

from .. import audit
from ..audit import Event
from ..clock import Clock
from ..factors import (
    ENROLMENT_NEEDS_SIGN_IN_WITHIN,
    Enrolment,
    Method,
    SecondFactors,
    methods_of,
)
from ..registry import UserDirectory
from ..sessions import Session, Sessions
from . import signin
from .authorize import CARRIED, CONSENT_PROOF
from .pages import Pages
from .passkey_offers import PasskeyOffers

log = logging.getLogger("portcullis.authserver.factors")

WRONG = "That code is not correct. Enter the code your app shows now."
RECENT = ENROLMENT_NEEDS_SIGN_IN_WITHIN


def qr_code(uri: str) -> Markup:
    """The URI as a QR code, an inline SVG image (the pages' policy loads no images from
    elsewhere, and the secret must not be in any URL)."""
    svg = segno.make(uri, error="m").svg_inline(scale=4, light="#fff", title="QR code")
    return Markup(svg)  # noqa: S704 - segno's own markup, the URI escaped by it


class FactorPages:
    def __init__(
        self,
        *,
        factors: SecondFactors,
        users: UserDirectory,
        sessions: Sessions,
        pages: Pages,
        base_path: str,
        clock: Clock,
        passkeys: PasskeyOffers | None = None,
    ) -> None:
        self.passkeys = passkeys  # the status page's passkeys, where browsers can use them
        self.factors = factors
        self.users = users
        self.sessions = sessions
        self.pages = pages
        self.base_path = base_path
        self.clock = clock

    # ------------------------------------------------------------------ pages

    def _not_signed_in(self) -> web.Response:
        return self.pages.error(
            401,
            "Please sign in first",
            "Sign in to an application that uses this server, then come back to this page.",
            "login_required",
        )

    def _unavailable(self) -> web.Response:
        return self.pages.error(
            404,
            "Authenticator apps are not set up here",
            "This server cannot keep second factors: its operator has not configured them.",
            "not_available",
        )

    @property
    def _passkeys(self) -> PasskeyOffers | None:
        """The passkeys this server offers: None where browsers cannot use them."""
        return self.passkeys if self.passkeys is not None and self.passkeys.available else None

    async def status_page(self, session: Session, enrolled: bool, left: int = 0) -> web.Response:
        """What the user has (an authenticator app, passkeys) and what they may add."""
        passkeys = self._passkeys
        subject = session.record.subject
        recent = self.clock() - session.record.auth_time <= RECENT.total_seconds()
        count = len(await passkeys.passkeys.usable(subject)) if passkeys is not None else 0
        # Adding a passkey needs a recent sign-in, as setting up an app does: an older
        # session is told so rather than shown a form that would be refused.
        offer = await passkeys.offer_creation(session) if passkeys is not None and recent else None
        response = self.pages.render(
            "factors.html",
            title="Second factor",
            enrolled=enrolled,
            recovery_codes_left=left,
            reason=None,
            app_available=self.factors.available,
            action=self.base_path + "/factors/totp",
            csrf_token=Sessions.csrf_token(session),
            carried=[],
            passkey=offer,
            passkeys_shown=passkeys is not None,
            passkey_count=count,
            account_page=self.base_path + "/account",
        )
        self.sessions.set_cookie(response, session)
        return response

    def enrol_page(
        self,
        session: Session,
        enrolment: Enrolment,
        carried: list[tuple[str, str]],
        *,
        error: str | None = None,
        status: int = 200,
    ) -> web.Response:
        response = self.pages.render(
            "factor_enrol.html",
            status=status,
            title="Set up an authenticator app",
            qr=qr_code(enrolment.uri),
            secret=enrolment.grouped,
            uri=enrolment.uri,
            action=self.base_path + "/factors/totp/confirm",
            csrf_token=Sessions.csrf_token(session),
            carried=carried,
            error=error,
        )
        self.sessions.set_cookie(response, session)
        return response

    # ------------------------------------------------------------------ handlers

    async def show(self, request: web.Request) -> web.StreamResponse:
        """GET /factors."""
        session = await self.sessions.current(request)
        if session is None or not session.logged_in:
            return self._not_signed_in()
        if not self.factors.available and self._passkeys is None:
            return self.pages.error(
                404,
                "Second factors are not set up here",
                "This server cannot keep second factors: its operator has not configured them.",
                "not_available",
            )
        subject = session.record.subject
        record = await self.factors.record(subject) if self.factors.available else None
        confirmed = record is not None and record.confirmed
        left = record.recovery_codes_left if record else 0
        return await self.status_page(session, confirmed, left)

    async def begin(self, request: web.Request) -> web.StreamResponse:
        """POST /factors/totp: a new secret, waiting for its code."""
        found = await self._signed_in_form(request)
        if isinstance(found, web.Response):
            return found
        session, form = found
        subject = session.record.subject
        user = await self.users.by_subject(subject)
        if user is None:
            return self._not_signed_in()
        enrolment = await self.factors.begin(subject, user.username)
        if enrolment is None:
            return self.pages.error(
                409,
                "An authenticator app is already set up",
                "Your account already has an authenticator app. Use it to sign in.",
                "already_enrolled",
            )
        log.info("second factor enrolment begun", extra={"subject": subject})
        return self.enrol_page(session, enrolment, _carried(form))

    async def confirm(self, request: web.Request) -> web.StreamResponse:
        """POST /factors/totp/confirm: the confirming code, then the recovery codes."""
        found = await self._signed_in_form(request)
        if isinstance(found, web.Response):
            return found
        session, form = found
        subject = session.record.subject
        user = await self.users.by_subject(subject)
        if user is None:
            return self._not_signed_in()
        carried = _carried(form)
        codes = await self.factors.confirm(subject, form.get("code", ""))
        if codes is None:
            waiting = await self.factors.waiting(subject, user.username)
            if waiting is None:
                return self.pages.error(
                    400,
                    "Nothing to confirm",
                    "No authenticator app is waiting to be set up: start again.",
                    "no_enrolment",
                )
            return self.enrol_page(session, waiting, carried, error=WRONG, status=400)
        audit.record(Event.FACTOR_ENROLLED, audit.USER, subject=subject)
        # The code just typed is a second factor: the session now says so.
        signed_in = await self.sessions.login(
            request, subject, methods_of(*_methods(session), Method.OTP)
        )
        # Sessions signed in before the app was set up, without it, end here (as a changed
        # password ends them): from now on the user's sessions have all met the code.
        await self.sessions.store.delete_other_sessions(subject, signed_in.record.session_hash)
        proof = Sessions.proof(signed_in, carried)
        response = self.pages.render(
            "factor_codes.html",
            title="Your recovery codes",
            codes=codes,
            action=self.base_path + "/authorize",
            csrf_token=Sessions.csrf_token(signed_in),
            carried=[*carried, (CONSENT_PROOF, proof)] if carried else [],
            client_continues=bool(carried),
            # The request goes on to the client's redirect URI (validated again there).
            form_targets=[value for name, value in carried if name == "redirect_uri"],
        )
        self.sessions.set_cookie(response, signed_in)
        return response

    async def _signed_in_form(
        self, request: web.Request
    ) -> tuple[Session, dict[str, str]] | web.Response:
        if not self.factors.available:
            return self._unavailable()
        found = await signin.signed_in_form(request, self.sessions, self.pages, self._not_signed_in)
        if isinstance(found, web.Response):
            return found
        session, form = found
        if self.clock() - session.record.auth_time > RECENT.total_seconds():
            return self.pages.error(
                401,
                "Please sign in again",
                "Setting up an authenticator app needs a recent sign-in: sign in to your "
                "application again, then come back to this page.",
                "login_required",
            )
        return session, form


def _carried(form: dict[str, str]) -> list[tuple[str, str]]:
    """The authorization request a form brings along, in the authorization endpoint's
    order; validated again there when it continues."""
    return [(name, form[name]) for name in CARRIED if name in form]


def _methods(session: Session) -> list[Method]:
    return [Method(m) for m in session.amr if m in {x.value for x in Method} and m != "mfa"]


def issuer_label(issuer: str) -> str:
    """How authenticator apps name this server: the issuer's host."""
    return urlsplit(issuer).hostname or issuer
