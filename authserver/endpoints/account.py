"""The account page (`/account`): what a signed-in user granted and where they are signed in,
and their password.

- Connected apps: each client the user consented to, with its name (and the host of its
  metadata document, for such a client), the scopes, when consent was first given and when
  a grant of it was last used. Revoke withdraws the consent and revokes the grants in force
  in one store call (`Store.withdraw_consent`), which records the revocation event of their
  access tokens as an admin revocation does, so gateways following the event stream refuse
  them; the next authorization asks for consent again.
- Sessions: this browser's and the others', by when and from which address they signed
  in; ending one, or every other.
- Recent sign-ins: the latest successes and failures (a wrong password) of the user, when,
  from which address and to which application (signin.py keeps them).
- Password: the current one is checked as a sign-in is (the same throttle), the new one held
  to the admin API's rule; the other sessions end. Only for users kept in the store: one
  defined in the configuration file changes there.
- Security: the authenticator app, when it was set up and how many recovery codes are left;
  new recovery codes (shown once; the earlier ones stop working in the same store call), or
  the app removed. Either needs what setting an app up needs, a sign-in within
  factors.ENROLMENT_NEEDS_SIGN_IN_WITHIN, or else the current password (checked as the
  password change checks it): a session cookie left on a shared computer must not be enough
  to strip a second factor or read new recovery codes. Removing a passkey needs the same
  (endpoints/passkeys.py). Where the operator requires a second factor of the user
  (`second_factors`) and the app or a passkey is their only one, it is not removed: the
  page says why, and that an administrator can remove it (the user then sets a new one up
  at their next sign-in), rather than leave an account that no longer meets the rule.

Signed out, the page is a sign-in form of its own: the password (then the second step, for
a user who has a second factor), a passkey, or a button per upstream identity provider
(`identity_providers`; federation.py brings such a sign-in back here).

With `password_sign_in: false` the page has no password anywhere: its sign-in offers the
providers and passkeys only, the Password section is gone, POST /account/login and POST
/account/password refuse (403) before reading the form, and a change that needs a recent
sign-in asks for a new sign-in rather than the current password. Every form carries
the session's CSRF token; each change answers 303 back to the page (POST, redirect, GET),
with a notice named in the query. Every change is an audit event (audit.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from aiohttp import web

from .. import audit
from ..audit import Event
from ..factors import (
    ENROLMENT_NEEDS_SIGN_IN_WITHIN,
    Method,
    methods_of,
)
from ..protocol.client_ids import document_url
from ..sessions import Session, Sessions
from ..store.base import MANAGED_BY_API, MANAGED_BY_METADATA_DOCUMENT, SessionRecord
from ..users import PasswordHasher, password_problems
from . import signin
from .forms import read_form
from .passkey_offers import ACCOUNT_BOUND, has_second_factor

NOTICES = {
    "revoked": "Access was revoked. The application will have to ask again.",
    "signed-out": "Those sessions were signed out.",
    "password": "Your password was changed. Your other sessions were signed out.",
    "factor-removed": "Your authenticator app was removed.",
    "passkey-added": "Your passkey was added. You can sign in with it now.",
    "passkey-removed": "That passkey was removed.",
}
WRONG_CURRENT = "The current password is not correct."
CHANGED_MEANWHILE = "Your account changed meanwhile: please try again."
CONFIG_MANAGED = "This account is defined in the server's configuration: ask its operator."
NO_FACTOR = "Your account has no authenticator app."
SIGN_IN_AGAIN = (
    "This change needs a recent sign-in: sign out, sign in again, then come back to this page."
)
ONLY_FACTOR = (
    "Your account must sign in with a second factor, and this app is its only one, so it "
    "cannot be removed here: add a passkey first. On a new phone, sign in with a recovery "
    "code and renew them, or ask an administrator to remove the app: you will set a new "
    "one up at your next sign-in."
)


def shown_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def session_handle(record: SessionRecord) -> str:
    """What the page names a session by: derived from the stored hash of its cookie, so it
    shows nothing that could be used as the cookie."""
    return hashlib.sha256(b"account-handle\x00" + record.session_hash).hexdigest()[:24]


# What a pending sign-in to this page is bound to: no authorization request, this page.
_PENDING_BOUND = ACCOUNT_BOUND
# What a sign-in at an upstream provider started here carries (federation.py `_ForAccount`).
PROVIDER_CARRIED = [("account", "1")]
EXPIRED_SIGN_IN = "This sign-in has expired. Please sign in again."


class AccountPages(signin.SignInPage):
    def __init__(self, services: signin.SignInServices, *, hasher: PasswordHasher) -> None:
        super().__init__(services)
        self.hasher = hasher

    @property
    def page_path(self) -> str:
        return self.base_path + "/account"

    # ------------------------------------------------------------------------- handlers

    async def show(self, request: web.Request) -> web.Response:
        """GET /account: the page, or its sign-in form."""
        session = await self.sessions.current(request)
        if session is None or not session.logged_in:
            return await self.sign_in_page(request)
        notice = NOTICES.get(request.query.get("done", ""))
        return await self._page(session, notice=notice)

    async def login(self, request: web.Request) -> web.StreamResponse:
        """POST /account/login."""
        if not self.password_sign_in:
            return signin.password_refused(self.pages)
        form = await read_form(request)
        session = await self.sessions.current(request)
        if not Sessions.csrf_valid(session, form.get("csrf_token")):
            return self._expired()
        username = form.get("username", "")
        outcome = await self.passwords.check(request, username, form.get("password", ""), None)
        if isinstance(outcome, signin.Throttled):
            response = await self.sign_in_page(
                request, error=signin.THROTTLED, status=429, username=username
            )
            response.headers["Retry-After"] = str(outcome.retry_after)
            return response
        if outcome is None:
            return await self.sign_in_page(
                request, error=signin.WRONG, status=400, username=username
            )
        if await has_second_factor(self.factors, self.passkeys, outcome.subject):
            # As at the authorization endpoint: a user with an app types its code before
            # anything is signed in (the pending sign-in is bound to this page).
            assert session is not None
            return await self.code_page(session, outcome.subject)
        new_session = await self.sessions.login(
            request, outcome.subject, methods_of(Method.PASSWORD)
        )
        response = self._back()
        self.sessions.set_cookie(response, new_session)
        return response

    async def login_code(self, request: web.Request) -> web.StreamResponse:
        """POST /account/login/code: the second step of a pending sign-in to this page."""
        form = await read_form(request)
        session = await self.sessions.current(request)
        if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
            return self._expired()
        pending = signin.PendingSignIn.verified(session, form, _PENDING_BOUND, self.clock())
        if pending is None:
            # Forged, expired, or used already (signing in ended the session it was bound
            # to): the password step again.
            return await self.sign_in_page(request, error=EXPIRED_SIGN_IN, status=403)
        until = float(form[signin.PENDING_UNTIL])

        def again(error: str, status: int) -> Awaitable[web.Response]:
            return self.code_page(
                session,
                pending.subject,
                until=until,
                error=error,
                status=status,
                first=pending.first,
            )

        signed_in = await self.codes.second_step(request, pending, form, self.sessions, again)
        if isinstance(signed_in, web.Response):
            return signed_in
        response = self._back()
        self.sessions.set_cookie(response, signed_in)
        return response

    async def code_page(
        self,
        session: Session,
        subject: str,
        *,
        until: float | None = None,
        error: str | None = None,
        status: int = 200,
        first: signin.FirstStep = signin.PASSWORD_STEP,
    ) -> web.Response:
        """The second step of a sign-in to this page, after `first` (the password, or an
        upstream provider): the code of the user's app, or one of their passkeys."""
        expires = self.clock() + signin.PENDING.total_seconds() if until is None else until
        pending = signin.PendingSignIn.fields(session, subject, expires, _PENDING_BOUND, first)
        passkey = None
        if self.passkeys is not None:
            passkey = await self.passkeys.offer_second_step(
                session, subject, [], pending, account=True
            )
        response = self.pages.render(
            "second_step.html",
            status=status,
            title="Enter your code",
            action=self.page_path + "/login/code",
            csrf_token=Sessions.csrf_token(session),
            carried=pending,
            client_name="your account",
            error=error,
            passkey=passkey,
            app=await self.factors.enrolled(subject),
        )
        self.sessions.set_cookie(response, session)
        return response

    async def revoke(self, request: web.Request) -> web.StreamResponse:
        """POST /account/apps/revoke: withdraw consent to `client_id`, revoke its grants."""
        form, session = await self._signed_in_form(request)
        if session is None:
            return self._expired()
        client_id = form.get("client_id", "")
        subject = session.record.subject
        consents = {c.client_id for c in await self.store.consents_of(subject)}
        if client_id not in consents:
            return self.pages.error(
                400, "Nothing to revoke", "This application has no access to your account."
            )
        revoked = await self.store.withdraw_consent(subject, client_id, self.clock())
        audit.record(Event.CONSENT_WITHDRAWN, audit.USER, client_id=client_id, subject=subject)
        for grant_id in revoked:
            audit.record(
                Event.GRANT_REVOKED,
                audit.USER,
                client_id=client_id,
                subject=subject,
                grant_id=grant_id,
                reason="consent_withdrawn",
            )
        return self._back("revoked")

    async def end_sessions(self, request: web.Request) -> web.StreamResponse:
        """POST /account/sessions/end: the session named `session`, or every other one."""
        form, session = await self._signed_in_form(request)
        if session is None:
            return self._expired()
        subject = session.record.subject
        this = session.record.session_hash
        handle = form.get("session")
        if handle is None:
            ended = await self.store.delete_other_sessions(subject, this)
        else:
            found = [
                s
                for s in await self.store.sessions_of(subject, self.clock())
                if session_handle(s) == handle and s.session_hash != this
            ]
            for record in found:
                await self.store.delete_session(record.session_hash)
            ended = len(found)
        audit.record(Event.SESSIONS_ENDED, audit.USER, subject=subject, sessions=ended)
        return self._back("signed-out")

    async def change_password(self, request: web.Request) -> web.StreamResponse:
        """POST /account/password: `current`, `new` and `confirm`."""
        if not self.password_sign_in:
            return self.pages.error(
                403,
                "Passwords are not used here",
                "This server signs nobody in with a password, so there is none to change "
                "here: your company's sign-in keeps yours.",
                "password_sign_in_disabled",
            )
        form, session = await self._signed_in_form(request)
        if session is None:
            return self._expired()
        subject = session.record.subject
        record = await self.store.get_user(subject)
        user = await self.users.by_subject(subject)
        if record is None or user is None or record.managed_by != MANAGED_BY_API:
            return await self._page(session, problem=CONFIG_MANAGED, status=400)
        new = form.get("new", "")
        problems = password_problems(new, record.username, "new password")
        if new != form.get("confirm"):
            problems.append(("confirmation", "does not match the new password"))
        if problems:
            text = " ".join(f"The {field} {issue}." for field, issue in problems)
            return await self._page(session, problem=text, status=400)
        outcome = await self.passwords.check(
            request, record.username, form.get("current", ""), None
        )
        if isinstance(outcome, signin.Throttled):
            response = await self._page(session, problem=signin.THROTTLED, status=429)
            response.headers["Retry-After"] = str(outcome.retry_after)
            return response
        if outcome is None:
            return await self._page(session, problem=WRONG_CURRENT, status=400)
        changed = replace(
            record, password_hash=await self.hasher.hash(new), updated_at=self.clock()
        )
        if not await self.store.save_user(changed, record.version):
            return await self._page(
                session,
                problem=CHANGED_MEANWHILE,
                status=409,
            )
        audit.record(Event.USER_PASSWORD_SET, audit.USER, subject=subject)
        ended = await self.store.delete_other_sessions(subject, session.record.session_hash)
        audit.record(Event.SESSIONS_ENDED, audit.USER, subject=subject, sessions=ended)
        return self._back("password")

    async def renew_recovery_codes(self, request: web.Request) -> web.StreamResponse:
        """POST /account/factors/recovery-codes: new recovery codes, shown once."""
        form, session = await self._signed_in_form(request)
        if session is None:
            return self._expired()
        subject = session.record.subject
        refused = await self.recent_or_password(request, session, form)
        if refused is not None:
            return refused
        codes = await self.factors.renew_recovery_codes(subject)
        if codes is None:
            return await self._page(session, factor_problem=NO_FACTOR, status=400)
        audit.record(Event.RECOVERY_CODES_RENEWED, audit.USER, subject=subject)
        return self.pages.render(
            "factor_codes.html",
            title="Your recovery codes",
            codes=codes,
            renewed=True,
            back=self.page_path,
            client_continues=False,
            carried=[],
        )

    async def remove_factor(self, request: web.Request) -> web.StreamResponse:
        """POST /account/factors/totp/remove: the app and its recovery codes."""
        form, session = await self._signed_in_form(request)
        if session is None:
            return self._expired()
        subject = session.record.subject
        if not await self.factors.enrolled(subject):
            return await self._page(session, factor_problem=NO_FACTOR, status=400)
        if await self.last_required_factor(subject):
            return await self._page(session, factor_problem=ONLY_FACTOR, status=409)
        refused = await self.recent_or_password(request, session, form)
        if refused is not None:
            return refused
        if await self.factors.remove(subject):
            audit.record(Event.FACTOR_REMOVED, audit.USER, subject=subject)
        return self._back("factor-removed")

    # ------------------------------------------------------------------------- steps

    def _recent(self, session: Session) -> bool:
        signed_in_for = self.clock() - session.record.auth_time
        return signed_in_for <= ENROLMENT_NEEDS_SIGN_IN_WITHIN.total_seconds()

    async def last_required_factor(self, subject: str) -> bool:
        """Whether the operator requires a second factor of the user and they have one
        left, their authenticator app or one passkey: removing it here would lock them out."""
        user = await self.users.by_subject(subject)
        if user is None or not self.requirement.applies_to(user.roles):
            return False
        app = await self.factors.enrolled(subject)
        # A passkey counts where this issuer can check it (passkeys.Passkeys.usable): one
        # made for another relying party id signs nobody in, and is no factor to fall back on.
        passkeys = len(await self.passkeys.passkeys.usable(subject)) if self.passkeys else 0
        return app + passkeys <= 1

    async def recent_or_password(
        self,
        request: web.Request,
        session: Session,
        form: dict[str, str],
        *,
        section: str = "security",
    ) -> web.Response | None:
        """None when the session signed in recently or the form's `current` password is
        right; the page saying what is missing otherwise, in its `section` (`security`, the
        authenticator app's, or `passkeys`)."""
        if self._recent(session):
            return None

        async def problem(text: str, status: int) -> web.Response:
            if section == "passkeys":
                return await self._page(session, passkey_problem=text, status=status)
            return await self._page(session, factor_problem=text, status=status)

        user = await self.users.by_subject(session.record.subject)
        if user is None or not self._password_of(user.password_hash):
            # Signed in through an upstream provider only, or passwords are off: no
            # password to type here.
            return await problem(SIGN_IN_AGAIN, 403)
        outcome = await self.passwords.check(request, user.username, form.get("current", ""), None)
        if isinstance(outcome, signin.Throttled):
            response = await problem(signin.THROTTLED, 429)
            response.headers["Retry-After"] = str(outcome.retry_after)
            return response
        if outcome is None or outcome.subject != user.subject:
            return await problem(WRONG_CURRENT, 400)
        return None

    def _password_of(self, password_hash: str) -> bool:
        """Whether a user with `password_hash` can prove who they are by a password here."""
        return self.password_sign_in and bool(password_hash)

    def signed_in(self) -> web.Response:
        """After a sign-in to this page elsewhere (at an upstream provider): the page."""
        return self._back()

    async def _signed_in_form(self, request: web.Request) -> tuple[dict[str, str], Session | None]:
        """The form, and the session when it is signed in and the CSRF token is its own."""
        form = await read_form(request)
        session = await self.sessions.current(request)
        if session is None or not session.logged_in:
            return form, None
        if not Sessions.csrf_valid(session, form.get("csrf_token")):
            return form, None
        return form, session

    def _back(self, notice: str | None = None) -> web.Response:
        location = self.page_path + (f"?done={notice}" if notice else "")
        return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})

    def _expired(self) -> web.Response:
        return self.pages.error(
            403,
            "Your session expired",
            "Please open your account page again and retry.",
            "csrf",
        )

    async def sign_in_page(
        self,
        request: web.Request,
        *,
        error: str | None = None,
        status: int = 200,
        username: str | None = None,
    ) -> web.Response:
        session = await self.sessions.ensure(request)
        response = self.pages.render(
            "login.html",
            status=status,
            title="Sign in",
            action=self.page_path + "/login",
            csrf_token=Sessions.csrf_token(session),
            carried=[],
            client_name="your account",
            error=error,
            username=username,
            password_form=self.password_sign_in,
            passkey=(
                self.passkeys.offer_sign_in(session, [], account=True) if self.passkeys else None
            ),
            providers=(self.sign_in_links(session, PROVIDER_CARRIED) if self.sign_in_links else []),
        )
        self.sessions.set_cookie(response, session)
        return response

    async def _page(
        self,
        session: Session,
        *,
        notice: str | None = None,
        problem: str | None = None,
        factor_problem: str | None = None,
        passkey_problem: str | None = None,
        status: int = 200,
    ) -> web.Response:
        subject = session.record.subject
        now = self.clock()
        user = await self.users.by_subject(subject)
        record = await self.store.get_user(subject)
        last_used: dict[str, float] = {}
        for summary in await self.store.list_grants(subject=subject):
            grant = summary.grant
            if grant.revoked_at is None and grant.expires_at > now:
                previous = last_used.get(grant.client_id, 0.0)
                last_used[grant.client_id] = max(previous, summary.last_used_at)
        apps = []
        for consent in await self.store.consents_of(subject):
            client = await self.clients.client(consent.client_id)
            apps.append(
                {
                    "client_id": consent.client_id,
                    "name": client.client_name if client is not None else consent.client_id,
                    "host": (
                        document_url(client.client_id).shown_host
                        if client is not None and client.managed_by == MANAGED_BY_METADATA_DOCUMENT
                        else None
                    ),
                    "scopes": [
                        {"name": s, "description": self.scope_description(s)}
                        for s in consent.scopes
                    ],
                    "granted_at": shown_time(consent.granted_at),
                    "last_used_at": (
                        shown_time(last_used[consent.client_id])
                        if consent.client_id in last_used
                        else None
                    ),
                }
            )
        names = {app["client_id"]: app["name"] for app in apps}
        sign_ins = []
        for sign_in in await self.store.sign_ins_of(subject, now):
            name = None
            if sign_in.client_id is not None:
                name = names.get(sign_in.client_id)
                if name is None:
                    client = await self.clients.client(sign_in.client_id)
                    name = names[sign_in.client_id] = (
                        client.client_name if client is not None else sign_in.client_id
                    )
            sign_ins.append(
                {
                    "at": shown_time(sign_in.at),
                    "succeeded": sign_in.outcome == "succeeded",
                    "address": sign_in.address,
                    "client": name,
                }
            )
        this = session.record.session_hash
        sessions = [
            {
                "handle": session_handle(s),
                "signed_in_at": shown_time(s.auth_time),
                "address": s.address,
                "expires_at": shown_time(s.expires_at),
                "current": s.session_hash == this,
            }
            for s in await self.store.sessions_of(subject, now)
        ]
        return self.pages.render(
            "account.html",
            status=status,
            title="Your account",
            base=self.page_path,
            logout=self.base_path + "/logout",
            csrf_token=Sessions.csrf_token(session),
            user_name=user.display_name if user is not None else subject,
            apps=apps,
            sessions=sessions,
            sign_ins=sign_ins,
            others=sum(1 for s in sessions if not s["current"]),
            username=record.username if record is not None else "",
            password_section=self.password_sign_in,
            password_changeable=record is not None and record.managed_by == MANAGED_BY_API,
            notice=notice,
            problem=problem,
            **await self._security(
                session, user is not None and self._password_of(user.password_hash)
            ),
            factor_problem=factor_problem,
            passkey_problem=passkey_problem,
            passkeys=await self.passkeys.account_section(session) if self.passkeys else None,
        )

    async def _security(self, session: Session, has_password: bool) -> dict[str, Any]:
        """What the Security section shows."""
        subject = session.record.subject
        record = await self.factors.record(subject) if self.factors.available else None
        since = record.confirmed_at if record is not None else None
        enrolled = since is not None
        return {
            "factors_available": self.factors.available,
            "factors_page": self.base_path + "/factors",
            "app_since": shown_time(since) if since is not None else None,
            "recovery_codes_left": record.recovery_codes_left if record else 0,
            "factor_required": enrolled and await self.last_required_factor(subject),
            # A session older than a set-up would need: the password is asked, or, for a
            # user without one, a new sign-in.
            "recheck": None if self._recent(session) else "password" if has_password else "sign-in",
        }
