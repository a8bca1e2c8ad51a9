"""Checking the password typed into a login form, behind the throttle every login form shares.

An attempt is charged before its password is checked, in the one store call that checks
every limit (`Store.reserve_attempt`): passwords sent at once are counted as they arrive,
not after their checks (scrypt, tens of milliseconds each). Three counts (`login_throttle`):
 1. the username at the client address: `max_failures` in any `window` of time, a hard
    limit that only that address runs into, so failures sent from elsewhere never lock a
    user out of their own address;
 2. the client address, whatever the username: `max_failures_per_address` in any `window`;
 3. the username from every address: after `backoff_after` attempts, each one waits after the
    previous a delay that doubles from 1s up to `backoff_max`. A delay, never a lock; the
    count starts over after `window` (or `backoff_max`, if longer) without an attempt.
Over a limit nothing is checked. A wrong password keeps its charge; a right one gives its
charge back to counts 2 and 3 (a success is not a guess to bound) and clears count 1.
(protocol/throttle.py has the rules, `Cap` for 1 and 2 and `Backoff` for 3.)

The bounds, with the defaults: 5 guesses per username and 20 in all per address in any 15
minutes; for one username from any number of addresses, 74 in any hour (10 at once, 6 more
within the next minute, then one a minute).

Used by the authorization endpoint's login page, the device page's and the account page's;
with `password_sign_in: false` none of them shows its form or calls this, and each refuses
a password posted anyway before reading it (`password_refused`).
Each attempt is an audit event (audit.py): `signin.succeeded`, `signin.failed` (with the
user's subject when the username names one, never the username typed) or
`signin.throttled`. A success or a failure of a known user is also kept in the store for
`SIGN_IN_RETENTION` (the latest few), for their account page.

A user with an authenticator app then types a code (`CodeCheck`): the same three counts
under keys of their own (`code:`, the subject in place of the username), charged before the
code is checked. The bounds are those of passwords, for someone who already knows the
password: 5 codes per user at an address and 20 per address in any 15 minutes, and for one
user from anywhere a backoff to one code a minute. With three codes valid at a time (a step
either side), a guesser then has about one chance in 230 of passing in a day of trying.

Between the password and the code, the sign-in is pending (`PendingSignIn`): nothing is
stored, the form carries the subject, an expiry and a proof that this browser session
passed the password check for this very request (Sessions.proof, keyed by the session's
secret). A proof cannot be made without the session's secret, is refused after `PENDING`,
and dies with the session: signing in replaces it, so a used pending sign-in cannot be
replayed, and the code step cannot be reached without the password step before it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from aiohttp import web

from portcullis.addresses import ClientAddresses

from .. import audit
from ..audit import Event
from ..clock import Clock
from ..factors import THROTTLED as CODE_THROTTLED
from ..factors import Requirement, SecondFactors, Used, factor_of, with_code
from ..metrics import Metrics
from ..protocol.errors import OAuthError
from ..protocol.throttle import Backoff, Cap
from ..registry import ClientRegistry, User, UserDirectory
from ..sessions import Session, Sessions
from ..store.base import SignInRecord, Store
from ..users import HashingBusy, PasswordHasher, dummy_hash
from .forms import read_form
from .pages import Pages
from .passkey_offers import PasskeyOffers

SIGN_IN_RETENTION = timedelta(days=90)
THROTTLED = "Too many failed attempts. Please wait a few minutes and try again."
# One answer for an unknown user and a wrong password.
WRONG = "The username or password is not correct."
WRONG_CODE = "That code is not correct, or was already used. Enter the current code of your app."
THROTTLED_CODE = "Too many wrong codes. Please wait a few minutes and try again."
PENDING = timedelta(minutes=5)  # from the password to the code


# The upstream identity providers' buttons for a page: (session, the page's own fields to
# carry through the provider) -> each button's fields.
ProviderButtons = Callable[[Session, list[tuple[str, str]]], list[dict[str, str]]]


@dataclass(frozen=True)
class SignInServices:
    """What every page that signs a user in works with (the authorization, device and
    account pages), built once by the composition root."""

    store: Store
    clients: ClientRegistry
    users: UserDirectory
    sessions: Sessions
    pages: Pages
    passwords: PasswordCheck
    codes: CodeCheck
    factors: SecondFactors
    requirement: Requirement  # who the operator requires a second factor of
    scope_description: Callable[[str], str]
    base_path: str
    clock: Clock
    sign_in_links: ProviderButtons | None = None  # the upstream identity providers' buttons
    passkeys: PasskeyOffers | None = None  # passkey sign-in and the passkey second step
    # False: no password form, a password posted is refused unread, and the account page
    # changes no password (a new sign-in confirms a change instead).
    password_sign_in: bool = True


class SignInPage:
    """The base of the pages that sign a user in: their services, each an attribute."""

    def __init__(self, services: SignInServices) -> None:
        self.store = services.store
        self.clients = services.clients
        self.users = services.users
        self.sessions = services.sessions
        self.pages = services.pages
        self.passwords = services.passwords
        self.codes = services.codes
        self.factors = services.factors
        self.requirement = services.requirement
        self.scope_description = services.scope_description
        self.base_path = services.base_path
        self.clock = services.clock
        self.sign_in_links = services.sign_in_links
        self.passkeys = services.passkeys
        self.password_sign_in = services.password_sign_in


async def signed_in_form(
    request: web.Request,
    sessions: Sessions,
    pages: Pages,
    not_signed_in: Callable[[], web.Response],
) -> tuple[Session, dict[str, str]] | web.Response:
    """The session and the form of a POST by a signed-in user whose CSRF token is the
    session's own; else the page saying why: 400 for a form that cannot be read,
    `not_signed_in()` without a signed-in session, 403 for another token."""
    try:
        form = await read_form(request)
    except OAuthError as exc:
        return pages.error(400, "This form cannot be read", exc.description)
    session = await sessions.current(request)
    if session is None or not session.logged_in:
        return not_signed_in()
    if not Sessions.csrf_valid(session, form.get("csrf_token")):
        return session_expired(pages)
    return session, form


def session_expired(pages: Pages) -> web.Response:
    """A form whose CSRF token is not its session's (an old page, another session's)."""
    return pages.error(403, "Your session expired", "Please go back and try again.", "csrf")


def password_refused(pages: Pages) -> web.Response:
    """The answer to a password posted where the operator turned password sign-in off
    (`password_sign_in: false`): given before the form is read, so the password is never
    looked at, nothing is charged to the throttle and no failed sign-in is recorded."""
    return pages.error(
        403,
        "Passwords are not accepted here",
        "This server signs nobody in with a password. Go back and sign in another way: "
        "with your company's sign-in, or a passkey.",
        "password_sign_in_disabled",
    )


def client_address(addresses: ClientAddresses, request: web.Request) -> str:
    """The address the throttles count a request under: the socket peer, or the client a
    trusted proxy names in X-Forwarded-For."""
    return addresses.client(request.remote, request.headers.getall("X-Forwarded-For", ()))


@dataclass(frozen=True)
class Throttled:
    retry_after: int  # seconds


@dataclass(frozen=True)
class LoginRules:
    """The bounds of the three counts (`login_throttle`): 1 and 2 within `window`, and for
    3 the attempts before the delays, the first delay and the longest."""

    max_failures: int
    max_failures_per_address: int
    window: timedelta
    backoff_after: int
    backoff_first: timedelta
    backoff_max: timedelta


@dataclass(frozen=True)
class LoginLimits:
    """The three counts of one attempt, in the order of the module's description."""

    at_address: Cap
    address: Cap
    username: Backoff

    @classmethod
    def of(cls, rules: LoginRules, username: str, address: str, kind: str = "login") -> LoginLimits:
        """`kind` names what is guessed: `login` (passwords), `code` (second factors)."""
        window = rules.window.total_seconds()
        name = username.lower()
        return cls(
            # An address holds no space, so the first space ends it.
            at_address=Cap(f"{kind}:user-at-ip:{address} {name}", rules.max_failures, window),
            address=Cap(f"{kind}:ip:{address}", rules.max_failures_per_address, window),
            username=Backoff(
                f"{kind}:user:{name}",
                free=rules.backoff_after,
                first_delay=rules.backoff_first.total_seconds(),
                max_delay=rules.backoff_max.total_seconds(),
                # Never shorter than a delay: a wait must not also wipe the count.
                idle=max(window, rules.backoff_max.total_seconds()),
            ),
        )


class PasswordCheck:
    def __init__(
        self,
        store: Store,
        users: UserDirectory,
        hasher: PasswordHasher,
        rules: LoginRules,
        addresses: ClientAddresses,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.users = users
        self.hasher = hasher
        self.rules = rules
        self.addresses = addresses
        self.clock = clock
        self.metrics = metrics

    async def check(
        self, request: web.Request, username: str, password: str, client_id: str | None
    ) -> User | Throttled | None:
        """The user, Throttled, or None when the username or password is wrong; signing in
        to `client_id` (None: to the account page)."""
        now = self.clock()
        address = client_address(self.addresses, request)
        limits = LoginLimits.of(self.rules, username, address)
        refused = await self.store.reserve_attempt(
            (limits.at_address, limits.address, limits.username), now
        )
        if refused is not None:
            self.metrics.login_throttled()
            audit.record(
                Event.SIGNIN_THROTTLED,
                audit.USER,
                client_id=client_id,
                reason=refused.key.split(":")[1],  # which count: user-at-ip, ip or user
                address=address,
            )
            return Throttled(max(1, int(refused.retry_after)))
        keys = (limits.at_address.key, limits.address.key, limits.username.key)
        user = await self.users.by_username(username)
        # scrypt takes tens of milliseconds: off the event loop, so one login does not stall
        # every other request. A check the hasher had no room for was not a guess: its
        # charge is given back and the person gets the 503 page.
        try:
            ok = await self.hasher.verify(password, user.password_hash if user else dummy_hash())
        except HashingBusy:
            await self.store.release_attempt(keys, now)
            raise
        if user is None or not ok:
            self.metrics.login_failed()
            if user is not None:
                await self._keep(user.subject, now, "failed", address, client_id)
            audit.record(
                Event.SIGNIN_FAILED,
                audit.USER,
                client_id=client_id,
                subject=user.subject if user is not None else None,
                username_known=user is not None,
                address=address,
            )
            return None  # the attempt stays charged: it was a failure
        await self.store.clear_failures(limits.at_address.key)
        await self.store.release_attempt((limits.address.key, limits.username.key), now)
        await self._keep(user.subject, now, "succeeded", address, client_id)
        audit.record(
            Event.SIGNIN_SUCCEEDED,
            audit.USER,
            client_id=client_id,
            subject=user.subject,
            address=address,
        )
        return user

    async def _keep(
        self, subject: str, now: float, outcome: str, address: str, client_id: str | None
    ) -> None:
        expires_at = now + SIGN_IN_RETENTION.total_seconds()
        await self.store.record_sign_in(
            SignInRecord(subject, now, outcome, address, client_id, expires_at)
        )


class CodeCheck:
    """The second step of a sign-in: a code of the user's app or a recovery code, behind
    the throttle passwords have (under `code:` keys)."""

    def __init__(
        self,
        store: Store,
        factors: SecondFactors,
        rules: LoginRules,
        addresses: ClientAddresses,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.factors = factors
        self.rules = rules
        self.addresses = addresses
        self.clock = clock
        self.metrics = metrics

    async def check(
        self, request: web.Request, subject: str, typed: str
    ) -> Used | Throttled | None:
        """What passed, Throttled, or None when the code is wrong or was used."""
        now = self.clock()
        address = client_address(self.addresses, request)
        limits = LoginLimits.of(self.rules, subject, address, kind="code")
        refused = await self.store.reserve_attempt(
            (limits.at_address, limits.address, limits.username), now
        )
        if refused is not None:
            self.metrics.login_throttled()
            self.metrics.count_factor(factor_of(typed), CODE_THROTTLED)
            audit.record(
                Event.FACTOR_THROTTLED,
                audit.USER,
                subject=subject,
                address=address,
                reason=refused.key.split(":")[1],
            )
            return Throttled(max(1, int(refused.retry_after)))
        verdict = await self.factors.verify(subject, typed)
        self.metrics.count_factor(verdict.factor, verdict.outcome)
        used = verdict.used
        if used is None:
            self.metrics.login_failed()
            audit.record(Event.FACTOR_FAILED, audit.USER, subject=subject, address=address)
            return None
        await self.store.clear_failures(limits.at_address.key)
        await self.store.release_attempt((limits.address.key, limits.username.key), now)
        if used is Used.RECOVERY_CODE:
            audit.record(Event.RECOVERY_CODE_USED, audit.USER, subject=subject, address=address)
        return used

    async def second_step(
        self,
        request: web.Request,
        pending: Pending,
        form: Mapping[str, str],
        sessions: Sessions,
        again: Callable[[str, int], Awaitable[web.Response]],
    ) -> Session | web.Response:
        """The code step of a pending sign-in, whichever page it is on: the new session,
        signed in with the first step's methods (the password, or what an upstream provider
        named) and the code, so that an ID token of it tells of both (RFC 8176 §2); or the
        step's page again, `again(error, status)`: 429 with Retry-After when throttled, 400
        when the code is wrong."""
        outcome = await self.check(request, pending.subject, form.get("code", ""))
        if isinstance(outcome, Throttled):
            response = await again(THROTTLED_CODE, 429)
            response.headers["Retry-After"] = str(outcome.retry_after)
            return response
        if outcome is None:
            return await again(WRONG_CODE, 400)
        first = pending.first
        return await sessions.login(
            request, pending.subject, with_code(first.methods), first.auth_time
        )


# The pending sign-in's fields on the code form.
PENDING_SUBJECT = "pending_subject"
PENDING_UNTIL = "pending_until"
PENDING_PROOF = "pending_proof"
PENDING_METHODS = "pending_methods"  # the first step's methods, space-separated
PENDING_AUTH_TIME = "pending_auth_time"  # when the first step happened, if not at the code


@dataclass(frozen=True)
class FirstStep:
    """What the step before the code was: a password here (the default), or a sign-in at an
    upstream provider, with the RFC 8176 methods it named and when it happened there."""

    methods: tuple[str, ...] = ("pwd",)
    auth_time: float | None = None


PASSWORD_STEP = FirstStep()


@dataclass(frozen=True)
class Pending:
    """A pending sign-in whose proof holds: who, and what their first step was."""

    subject: str
    first: FirstStep


class PendingSignIn:
    """A password checked, a code still to come: the fields that carry it on the form."""

    @staticmethod
    def fields(
        session: Session,
        subject: str,
        until: float,
        bound: list[tuple[str, str]],
        first: FirstStep = PASSWORD_STEP,
    ) -> list[tuple[str, str]]:
        """The hidden fields of the code form for `subject`, valid until `until`, for the
        request whose parameters are `bound`, after the first step `first`."""
        until_text = str(int(until))
        methods, auth_time = _first_texts(first)
        proof = Sessions.proof(
            session, _pending_items(subject, until_text, bound, methods, auth_time)
        )
        return [
            (PENDING_SUBJECT, subject),
            (PENDING_UNTIL, until_text),
            (PENDING_METHODS, methods),
            *([(PENDING_AUTH_TIME, auth_time)] if auth_time else []),
            (PENDING_PROOF, proof),
        ]

    @staticmethod
    def subject(
        session: Session | None,
        form: dict[str, str],
        bound: list[tuple[str, str]],
        now: float,
    ) -> str | None:
        """The subject whose password this session checked for this request, if the form
        proves it and the proof has not expired; None otherwise."""
        pending = PendingSignIn.verified(session, form, bound, now)
        return None if pending is None else pending.subject

    @staticmethod
    def verified(
        session: Session | None,
        form: dict[str, str],
        bound: list[tuple[str, str]],
        now: float,
    ) -> Pending | None:
        """The pending sign-in the form carries, if its proof holds for this session and
        request and has not expired; None otherwise. The first step's methods and time are
        under the proof: a form cannot claim a sign-in other than the one that happened."""
        subject, until = form.get(PENDING_SUBJECT), form.get(PENDING_UNTIL)
        # ASCII digits only: str.isdigit() also takes digits int() cannot read ("²").
        if session is None or not subject or not until or not (until.isascii() and until.isdigit()):
            return None
        if int(until) <= now:
            return None
        methods = form.get(PENDING_METHODS, "")
        auth_time = form.get(PENDING_AUTH_TIME, "")
        items = _pending_items(subject, until, bound, methods, auth_time)
        if not Sessions.proof_valid(session, items, form.get(PENDING_PROOF)):
            return None
        first = FirstStep(
            tuple(methods.split()) or PASSWORD_STEP.methods,
            float(auth_time) if auth_time.isdigit() else None,
        )
        return Pending(subject, first)


def _first_texts(first: FirstStep) -> tuple[str, str]:
    auth_time = "" if first.auth_time is None else str(int(first.auth_time))
    return " ".join(first.methods), auth_time


def _pending_items(
    subject: str, until: str, bound: list[tuple[str, str]], methods: str, auth_time: str
) -> list[tuple[str, str]]:
    return [
        *bound,
        ("\x00pending_subject", subject),
        ("\x00pending_until", until),
        ("\x00pending_methods", methods),
        ("\x00pending_auth_time", auth_time),
    ]
