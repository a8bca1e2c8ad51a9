"""What the pages offer of passkeys: the forms that start a ceremony, each with its challenge
(authserver/passkeys.py), for the login pages (the authorization endpoint's, the device
page's and the account page's), the second step (of the authorization
endpoint, the device page and the account page), the account page's list and the page that
leads a user to set up a second factor. Apart from the handlers (endpoints/passkeys.py), so
that the pages that show these forms need not import the handlers that receive them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..clock import Clock
from ..factors import ENROLMENT_NEEDS_SIGN_IN_WITHIN, SecondFactors
from ..passkeys import MAX_PER_USER, Passkeys, Purpose
from ..protocol import webauthn
from ..registry import UserDirectory
from ..sessions import Session

# The account page's own sign-in, as its pending sign-in is bound (endpoints/account.py).
ACCOUNT_BOUND = [("\x00account", "1")]
RECENT = ENROLMENT_NEEDS_SIGN_IN_WITHIN


@dataclass(frozen=True)
class Offer:
    """A passkey form on a page: where it posts, the options for the browser
    (`navigator.credentials.get` or `.create`, as `mode` says), the hidden fields (the
    challenge's among them)."""

    action: str
    options: str
    fields: list[tuple[str, str]]
    mode: str  # "get" or "create"


def subject_bound(bound: list[tuple[str, str]], subject: str) -> list[tuple[str, str]]:
    return [*bound, ("\x00passkey_subject", subject)]


def shown(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when))


async def has_second_factor(
    factors: SecondFactors, passkeys: PasskeyOffers | None, subject: str
) -> bool:
    """Whether the user has a second step to take after their first: an authenticator app,
    or a passkey this server can check."""
    if await factors.enrolled(subject):
        return True
    return passkeys is not None and await passkeys.enrolled(subject)


class PasskeyOffers:
    def __init__(
        self, *, passkeys: Passkeys, users: UserDirectory, base_path: str, clock: Clock
    ) -> None:
        self.passkeys = passkeys
        self.users = users
        self.base_path = base_path
        self.clock = clock

    @property
    def account_path(self) -> str:
        return self.base_path + "/account"

    @property
    def available(self) -> bool:
        """Whether browsers can use passkeys with this server (passkeys.Passkeys.available)."""
        return self.passkeys.available

    async def enrolled(self, subject: str) -> bool:
        """Whether the user has a passkey this server can check."""
        return self.passkeys.available and bool(await self.passkeys.usable(subject))

    def offer_sign_in(
        self,
        session: Session,
        bound: list[tuple[str, str]],
        *,
        account: bool = False,
        device: list[tuple[str, str]] | None = None,
    ) -> Offer | None:
        """The login page's "Sign in with a passkey": any discoverable passkey. `bound` the
        authorization request's parameters, carried by the form (the account page's
        sign-in carries none). `device`: the device page's sign-in form, `bound` its user
        code, and these its hidden fields (the code and its proof), posted to
        /device/login/passkey."""
        if not self.passkeys.available:
            return None
        bound = ACCOUNT_BOUND if account else bound
        ceremony = self.passkeys.issue(session, Purpose.PASSWORDLESS, bound)
        if device is not None:
            action, fields = self.base_path + "/device/login/passkey", device
        else:
            action, fields = self._action(account), [] if account else bound
        return Offer(
            action,
            self.passkeys.request_options(ceremony, []),
            [*fields, *ceremony.fields()],
            "get",
        )

    async def offer_second_step(
        self,
        session: Session,
        subject: str,
        bound: list[tuple[str, str]],
        fields: list[tuple[str, str]],
        *,
        account: bool = False,
        device: bool = False,
    ) -> Offer | None:
        """The second step's "Use a passkey", when the user has one: `bound` the request's
        parameters (the device page's: its user code), `fields` the form's hidden fields
        (the pending sign-in's among them). Posted to /login/passkey, or for the account
        page's or the device page's second step to theirs."""
        if not self.passkeys.available:
            return None
        theirs = await self.passkeys.usable(subject)
        if not theirs:
            return None
        bound = subject_bound(ACCOUNT_BOUND if account else bound, subject)
        ceremony = self.passkeys.issue(session, Purpose.SECOND_STEP, bound)
        action = self.base_path + "/device/login/passkey" if device else self._action(account)
        return Offer(
            action,
            self.passkeys.request_options(ceremony, theirs),
            [*fields, *ceremony.fields()],
            "get",
        )

    def _action(self, account: bool) -> str:
        return (self.account_path if account else self.base_path) + "/login/passkey"

    async def offer_creation(
        self, session: Session, carried: list[tuple[str, str]] | None = None
    ) -> Offer | None:
        """The form adding a passkey for the signed-in user, posted to /account/passkeys;
        `carried` an authorization request it brings along (from the page that leads a
        user to set up a second factor), to go on with once the passkey is added."""
        subject = session.record.subject
        user = await self.users.by_subject(subject)
        if not self.passkeys.available or user is None:
            return None
        theirs = await self.passkeys.of(subject)
        if len(theirs) >= MAX_PER_USER:
            return None  # the most one account may have (passkeys.MAX_PER_USER)
        ceremony = self.passkeys.issue(session, Purpose.CREATE, subject_bound([], subject))
        handle = await self.passkeys.user_handle(subject)
        options = self.passkeys.creation_options(
            ceremony, handle, user.username, user.display_name, theirs
        )
        return Offer(
            self.account_path + "/passkeys",
            options,
            [*(carried or []), ("user_handle", webauthn.encoded(handle)), *ceremony.fields()],
            "create",
        )

    async def account_section(self, session: Session) -> dict[str, object]:
        """What the account page's passkeys section shows: the user's passkeys, and the
        form creating another."""
        subject = session.record.subject
        theirs = await self.passkeys.of(subject) if self.passkeys.available else []
        offer = await self.offer_creation(session)
        return {
            "available": self.passkeys.available,
            "offer": offer,
            "full": len(theirs) >= MAX_PER_USER,
            "most": MAX_PER_USER,
            "remove": self.account_path + "/passkeys/remove",
            "recent": self.clock() - session.record.auth_time <= RECENT.total_seconds(),
            "list": [
                {
                    "id": webauthn.encoded(p.credential_id),
                    "name": p.name,
                    "created_at": shown(p.created_at),
                    "last_used_at": None if p.last_used_at is None else shown(p.last_used_at),
                    "synced": p.backup_eligible,
                }
                for p in theirs
            ],
        }
