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

Used by the authorization endpoint's login page, the device page's and the account page's.
Each attempt is an audit event (audit.py): `signin.succeeded`, `signin.failed` (with the
user's subject when the username names one, never the username typed) or
`signin.throttled`. A success or a failure of a known user is also kept in the store for
`SIGN_IN_RETENTION` (the latest few), for their account page.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from aiohttp import web

from portcullis.addresses import ClientAddresses

from .. import audit
from ..audit import Event
from ..clock import Clock
from ..metrics import Metrics
from ..protocol.throttle import Backoff, Cap
from ..registry import User, UserDirectory
from ..store.base import SignInRecord, Store
from ..users import HashingBusy, PasswordHasher, dummy_hash

SIGN_IN_RETENTION = timedelta(days=90)
THROTTLED = "Too many failed attempts. Please wait a few minutes and try again."
# One answer for an unknown user and a wrong password.
WRONG = "The username or password is not correct."


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
    def of(cls, rules: LoginRules, username: str, address: str) -> LoginLimits:
        window = rules.window.total_seconds()
        name = username.lower()
        return cls(
            # An address holds no space, so the first space ends it.
            at_address=Cap(f"login:user-at-ip:{address} {name}", rules.max_failures, window),
            address=Cap(f"login:ip:{address}", rules.max_failures_per_address, window),
            username=Backoff(
                f"login:user:{name}",
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
