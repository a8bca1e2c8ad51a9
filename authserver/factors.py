"""Second factors: a user's authenticator app (TOTP, protocol/totp.py) and recovery codes.

Enrolment is two steps, so that a factor exists only once the user has shown their app
holds the secret:
 1. `begin`: a fresh secret, sealed, stored as an enrolment waiting for its code (one that
    waited before is replaced; a confirmed factor is never replaced: it is removed first);
    the page shows it as a QR code and in groups of four;
 2. `confirm`: a code of that secret; in one store call the enrolment becomes the factor,
    the code's time step its last accepted one (the code cannot be used again to sign
    in), and the digests of new recovery codes are stored. The codes themselves are
    returned once, to be shown once.
At sign-in, `verify` accepts a code of a later time step than the last accepted (the store
records it under a compare-and-set: two requests with one code cannot both pass), or an
unused recovery code (marked used in one statement).
Later, signed in again, the user may renew the recovery codes (`renew_recovery_codes`: new
ones, shown once, replacing every earlier one in one store call) or remove the app
(`remove`; the account page decides when that is allowed). Guessing is bounded by the caller,
which charges the sign-in throttle before calling (endpoints/signin.py).

The secret is sealed as the signing keys kept in the store are (stored_keys.KeyCipher,
AES-256-GCM, a fresh nonce), with the subject as associated data: a sealed secret copied
onto another user's row does not open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from .clock import Clock
from .metrics import Metrics
from .protocol import assurance, totp, webauthn
from .store.base import Store, TotpRecord
from .stored_keys import KeyCipher

log = logging.getLogger("portcullis.authserver.factors")

# Setting an app up needs a sign-in this recent: a session cookie stolen from a user without
# an app must not be enough to give their account a second factor the thief holds.
ENROLMENT_NEEDS_SIGN_IN_WITHIN = timedelta(minutes=15)


class Method(StrEnum):
    """RFC 8176 §2 values of the methods a sign-in may use."""

    PASSWORD = "pwd"  # noqa: S105 - the name of a method, not a password
    OTP = "otp"  # a code of the authenticator app, or a recovery code: both one-time codes
    DEVICE_KEY = webauthn.DEVICE_BOUND  # a passkey bound to its device (passkeys.py)
    SYNCED_KEY = webauthn.SYNCED  # a passkey that may be synced to other devices
    PRESENCE = webauthn.PRESENCE  # the user presence test of a passkey's ceremony
    MULTIPLE = "mfa"
    EXTERNAL = assurance.EXTERNAL  # at an upstream provider that named no method


def methods_of(*used: Method) -> tuple[str, ...]:
    """The `amr` of a sign-in that used these methods: `mfa` added for two or more."""
    names = [m.value for m in dict.fromkeys(used)]
    return (*names, Method.MULTIPLE.value) if len(names) >= 2 else tuple(names)


def with_code(first: tuple[str, ...]) -> tuple[str, ...]:
    """The `amr` of a sign-in whose first step used `first` (a password here, or whatever an
    upstream provider named) and then a code of this server: those methods, `otp` and
    `mfa`. The code is a factor of its own whatever the first step was (an `otp` at the
    provider included), so the sign-in is always a multi-factor one."""
    kept = [m for m in first if m not in (Method.OTP.value, Method.MULTIPLE.value)]
    return (*dict.fromkeys(kept), Method.OTP.value, Method.MULTIPLE.value)


def multi_factor(amr: tuple[str, ...]) -> bool:
    return Method.MULTIPLE.value in amr


@dataclass(frozen=True)
class Requirement:
    """Who the operator requires to sign in with a second factor (`second_factors`)."""

    everyone: bool = False
    roles: frozenset[str] = frozenset()

    def applies_to(self, roles: tuple[str, ...]) -> bool:
        return self.everyone or not self.roles.isdisjoint(roles)


class Used(StrEnum):
    """What a verified second step was."""

    APP_CODE = "app_code"
    RECOVERY_CODE = "recovery_code"


# The factors' names and the outcomes of a second step, as the metrics count them
# (metrics.FACTORS, metrics.FACTOR_OUTCOMES).
TOTP = "totp"
RECOVERY_CODE = "recovery_code"
SUCCEEDED, FAILED, REPLAYED, THROTTLED = "succeeded", "failed", "replayed", "throttled"


def factor_of(typed: str) -> str:
    """Which factor a typed second step is meant for: six digits are a code of the app, a
    recovery code looks like one; anything else is counted as a wrong code of the app."""
    if totp.normalised_code(typed) is None and totp.normalised_recovery_code(typed) is not None:
        return RECOVERY_CODE
    return TOTP


@dataclass(frozen=True)
class Verdict:
    """What a second step typed was meant for (`factor`), how it went (`outcome`), and what
    passed, when it did."""

    factor: str
    outcome: str
    used: Used | None = None


def _associated(subject: str) -> bytes:
    return b"totp\x00" + subject.encode()


@dataclass(frozen=True)
class Enrolment:
    """A secret waiting for its confirming code, as the enrolment page shows it."""

    uri: str  # otpauth://, for the QR code
    grouped: str  # base32 in groups of four, to type


class SecondFactors:
    def __init__(
        self,
        store: Store,
        cipher: KeyCipher | None,
        label: str,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        """`cipher` None: no encryption key is configured, and nobody can set up an app; `label`
        names this server in authenticator apps (the issuer's host)."""
        self.store = store
        self.cipher = cipher
        self.label = label
        self.clock = clock
        self.metrics = metrics

    @property
    def available(self) -> bool:
        return self.cipher is not None

    async def record(self, subject: str) -> TotpRecord | None:
        return await self.store.get_totp(subject)

    async def enrolled(self, subject: str) -> bool:
        record = await self.store.get_totp(subject)
        return record is not None and record.confirmed

    async def begin(self, subject: str, account: str) -> Enrolment | None:
        """A new secret waiting for its code; None when the user has a factor already."""
        cipher = self._cipher()
        secret = totp.new_secret()
        record = TotpRecord(subject, cipher.seal_bytes(_associated(subject), secret), self.clock())
        if not await self.store.begin_totp(record):
            return None
        return self._shown(secret, account)

    async def waiting(self, subject: str, account: str) -> Enrolment | None:
        """The enrolment waiting for its code, shown again (a wrong code typed); None when
        none waits."""
        record = await self.store.get_totp(subject)
        if record is None or record.confirmed:
            return None
        secret = self._open(record)
        return None if secret is None else self._shown(secret, account)

    async def confirm(self, subject: str, typed: str) -> list[str] | None:
        """The recovery codes of the factor the waiting enrolment became, when `typed` is
        a code of its secret; None, with nothing changed, otherwise."""
        code = totp.normalised_code(typed)
        record = await self.store.get_totp(subject)
        if code is None or record is None or record.confirmed:
            return None
        secret = self._open(record)
        if secret is None:
            return None
        step = totp.matching_step(secret, code, self.clock(), None)
        if step is None:
            return None
        codes = totp.new_recovery_codes()
        digests = totp.recovery_digests(subject, codes)
        if not await self.store.confirm_totp(
            subject, record.sealed_secret, step, digests, self.clock()
        ):
            return None  # another enrolment began, or this one was confirmed, meanwhile
        self.metrics.factor_changed(TOTP, "enrolled")
        return codes

    async def verify(self, subject: str, typed: str) -> Verdict:
        """Whether `typed` is a code of the user's app not accepted before, or one of their
        unused recovery codes; either is used up by this call. A code of the app for a time
        step accepted already (or taken by a request at the same time) is `replayed`."""
        record = await self.store.get_totp(subject)
        factor = factor_of(typed)
        if record is None or not record.confirmed:
            return Verdict(factor, FAILED)
        code = totp.normalised_code(typed)
        if code is not None:
            secret = self._open(record)
            if secret is None:
                return Verdict(factor, FAILED)
            step = totp.matching_step(secret, code, self.clock(), None)
            if step is None:
                return Verdict(factor, FAILED)
            if record.last_step is not None and step <= record.last_step:
                return Verdict(factor, REPLAYED)
            if await self.store.use_totp_step(subject, step):
                return Verdict(factor, SUCCEEDED, Used.APP_CODE)
            return Verdict(factor, REPLAYED)  # a request with the same code came first
        recovery = totp.normalised_recovery_code(typed)
        if recovery is not None and await self.store.use_recovery_code(
            subject, totp.recovery_digest(subject, recovery), self.clock()
        ):
            return Verdict(factor, SUCCEEDED, Used.RECOVERY_CODE)
        return Verdict(factor, FAILED)

    async def remove(self, subject: str) -> bool:
        """Remove the user's app and recovery codes; False when there was none."""
        removed = await self.store.delete_totp(subject)
        if removed:
            self.metrics.factor_changed(TOTP, "removed")
        return removed

    async def renew_recovery_codes(self, subject: str) -> list[str] | None:
        """New recovery codes for the user's confirmed app, returned once to be shown once:
        in one store call their digests replace every earlier code, used or not, so none of
        those signs in any more. None, with nothing changed, when the user has no app."""
        codes = totp.new_recovery_codes()
        digests = totp.recovery_digests(subject, codes)
        if not await self.store.replace_recovery_codes(subject, digests):
            return None
        self.metrics.factor_changed(RECOVERY_CODE, "renewed")
        return codes

    def _shown(self, secret: bytes, account: str) -> Enrolment:
        return Enrolment(totp.provisioning_uri(secret, self.label, account), totp.grouped(secret))

    def _cipher(self) -> KeyCipher:
        if self.cipher is None:
            raise RuntimeError("enrolment needs second_factors.encryption_key")
        return self.cipher

    def _open(self, record: TotpRecord) -> bytes | None:
        secret = self._cipher().open_bytes(_associated(record.subject), record.sealed_secret)
        if secret is None:
            # Fails closed: the user cannot pass the step, and the operator is told why.
            log.error(
                "an authenticator secret does not open with the configured encryption key",
                extra={"subject": record.subject},
            )
        return secret
