"""Passkeys (WebAuthn Level 3): creating one for a signed-in user, and checking the assertion
of one at sign-in, as a second factor after the password or alone (passwordless).

The ceremonies' cryptography and the checks of §7.1 and §7.2 that go with it (the type,
challenge and origin of `clientDataJSON`, the RP ID hash, the user present and user
verified flags, the signature over the authenticator data and the client data's hash) are
Yubico's `fido2` library's (`fido2.server.Fido2Server`); this module adds what a relying
party decides itself: which origin and RP ID (protocol/webauthn.py: the issuer's), which
credentials belong to whom, the signature counter, and the challenges.

A challenge is 32 random bytes (WebAuthn §13.4.3 asks for at least 16), issued with the
page that starts the ceremony and carried by the page's form with an expiry and a proof
(Sessions.proof): only the browser session it was issued to can present it, only for the
purpose and the user (and the authorization request) it was issued for, and only until it
expires (`CHALLENGE_LIFETIME`). It is used once: its first presentation records it in the
store's replay cache (Store.use_jti, under `webauthn`) before anything else is checked, so
a replayed assertion, or a second try with one challenge, is refused whatever it holds.

Attestation is `none` (§5.4.7): the server keeps the public key and trusts no
authenticator model more than another. User verification is `preferred` when a passkey is
created and used as a second factor, and `required` for passwordless sign-in (§5.8.6), where
the passkey must be two factors alone.

Why `fido2` and not `webauthn` (Duo Labs): its one dependency is `cryptography`, which this
server already has (`webauthn` brings `cbor2` and `pyOpenSSL` along), it is typed, and it
leaves the origin check to the caller, which this server needs for an http://localhost
issuer in development and tests.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fido2 import cbor
from fido2.cose import CoseKey, UnsupportedKey
from fido2.server import Fido2Server
from fido2.webauthn import (
    Aaguid,
    AttestationConveyancePreference,
    AttestedCredentialData,
    AuthenticationResponse,
    AuthenticatorTransport,
    PublicKeyCredentialDescriptor,
    PublicKeyCredentialRpEntity,
    PublicKeyCredentialType,
    PublicKeyCredentialUserEntity,
    RegistrationResponse,
    ResidentKeyRequirement,
    UserVerificationRequirement,
)

from .clock import Clock
from .protocol import webauthn
from .sessions import Session, Sessions
from .store.base import PasskeyRecord, Store

log = logging.getLogger("portcullis.authserver.passkeys")

CHALLENGE_LIFETIME = timedelta(minutes=5)
MAX_RESPONSE = 64 * 1024  # characters of a posted credential's JSON
# Passkeys one user may have: enough for every device a person holds, and a bound on what
# one account may store and on the credentials every ceremony of theirs lists (§5.4.3
# excludeCredentials, §5.5 allowCredentials).
MAX_PER_USER = 20
REPLAY_CACHE = "webauthn"  # the replay cache's name for used challenges

# The fields of a ceremony on a page's form.
CHALLENGE = "passkey_challenge"
UNTIL = "passkey_until"
PROOF = "passkey_proof"
RESPONSE = "passkey_response"


class Purpose:
    """What a challenge was issued for: the proof binds it to one."""

    CREATE = "create"
    SECOND_STEP = "second_step"
    PASSWORDLESS = "passwordless"


@dataclass(frozen=True)
class Ceremony:
    """A challenge issued to a browser session, as its form carries it."""

    challenge: bytes
    until: int
    proof: str

    def fields(self) -> list[tuple[str, str]]:
        return [
            (CHALLENGE, webauthn.encoded(self.challenge)),
            (UNTIL, str(self.until)),
            (PROOF, self.proof),
        ]


@dataclass(frozen=True)
class Refusal:
    """Why a ceremony was refused: `reason` for the audit trail, `message` for the page."""

    reason: str
    message: str


MALFORMED = Refusal("malformed", "The passkey's answer cannot be read.")
EXPIRED = Refusal(
    "challenge", "This passkey request has expired or was already used. Please try again."
)
UNKNOWN = Refusal("unknown_credential", "This passkey is not registered here.")
# At a second step the page says the same of a passkey registered to nobody and of another
# user's: whether a key belongs to some other account is not the signing-in user's to learn.
_NOT_THEIRS = "This passkey is not one of this account's: use one you added to it."
UNKNOWN_AT_SECOND_STEP = Refusal("unknown_credential", _NOT_THEIRS)
OTHER_USER = Refusal("other_user", _NOT_THEIRS)
NOT_VERIFIED = Refusal(
    "not_verified", "Your passkey did not verify it was you (a PIN or a biometric). Try again."
)
COUNTER = Refusal(
    "sign_count",
    "This passkey cannot be trusted: its counter went back, which a copied passkey does. "
    "Use another way to sign in.",
)
TAKEN = Refusal("already_registered", "This passkey is registered already.")
TOO_MANY = Refusal(
    "too_many",
    f"Your account has {MAX_PER_USER} passkeys, the most it may have: remove one first.",
)
UNSUPPORTED = Refusal("unsupported_key", "This passkey's kind of key is not supported here.")
BACKUP_STATE = Refusal(
    "backup_state",
    "This passkey's answer contradicts itself: it says it is backed up, yet not that it can "
    "be. Use another way to sign in.",
)
BACKUP_ELIGIBILITY = Refusal(
    "backup_eligibility",
    "This passkey now says it can be synced, which it did not when it was added. "
    "Use another way to sign in.",
)


@dataclass(frozen=True)
class Assertion:
    """A passkey that signed a sign-in."""

    record: PasskeyRecord
    user_verified: bool

    def methods(self, first: tuple[str, ...] | None) -> tuple[str, ...]:
        """The sign-in's `amr`: passwordless (`first` None), or after a first step."""
        return webauthn.methods(
            backup_eligible=self.record.backup_eligible,
            user_verified=self.user_verified,
            first=first,
        )


def _items(
    purpose: str, challenge: str, until: str, bound: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    return [
        *bound,
        ("\x00passkey_purpose", purpose),
        ("\x00passkey_challenge", challenge),
        ("\x00passkey_until", until),
    ]


def _refusal_of(error: ValueError) -> Refusal:
    """fido2's check that failed, as a refusal (its messages name the check)."""
    text = str(error).lower()
    for needle, reason in (
        ("origin", "origin"),
        ("rp id", "rp_id"),
        ("challenge", "challenge"),
        ("user verif", "not_verified"),
        ("signature", "signature"),
        ("type", "type"),
        ("present", "not_present"),
    ):
        if needle in text:
            if reason == "not_verified":
                return NOT_VERIFIED
            return Refusal(reason, "The passkey's answer is not valid for this server.")
    return Refusal("invalid", "The passkey's answer is not valid for this server.")


class Passkeys:
    def __init__(self, store: Store, issuer: str, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.rp_id = webauthn.rp_id(issuer)
        self.origin = webauthn.origin(issuer)
        self._server = (
            None
            if self.rp_id is None
            else Fido2Server(
                PublicKeyCredentialRpEntity(name=self.rp_id, id=self.rp_id),
                attestation=AttestationConveyancePreference.NONE,
                # WebAuthn §7.1 step 9, §7.2 step 13: the origin is exactly the issuer's.
                verify_origin=lambda given: given == self.origin,
            )
        )

    @property
    def available(self) -> bool:
        """Whether browsers can use passkeys here: the issuer is a domain in a secure
        context (protocol/webauthn.rp_id)."""
        return self._server is not None

    def _fido(self) -> Fido2Server:
        if self._server is None:
            raise RuntimeError("passkeys need an https issuer (or http://localhost)")
        return self._server

    # -- challenges

    def issue(self, session: Session, purpose: str, bound: list[tuple[str, str]]) -> Ceremony:
        """A new challenge for this session, for `purpose` and the parameters `bound`."""
        challenge = os.urandom(32)
        until = int(self.clock() + CHALLENGE_LIFETIME.total_seconds())
        items = _items(purpose, webauthn.encoded(challenge), str(until), bound)
        return Ceremony(challenge, until, Sessions.proof(session, items))

    async def consume(
        self,
        session: Session,
        purpose: str,
        form: dict[str, str],
        bound: list[tuple[str, str]],
    ) -> bytes | None:
        """The challenge the form presents, if this session was issued it for `purpose` and
        `bound`, it has not expired, and it was never presented before; it cannot be
        presented again after this call, whatever follows."""
        text, until = form.get(CHALLENGE, ""), form.get(UNTIL, "")
        challenge = webauthn.base64url(text, 64)
        # ASCII digits only: str.isdigit() also takes digits int() cannot read ("²").
        if challenge is None or len(challenge) != 32 or not (until.isascii() and until.isdigit()):
            return None
        now = self.clock()
        if int(until) <= now:
            return None
        if not Sessions.proof_valid(session, _items(purpose, text, until, bound), form.get(PROOF)):
            return None
        if not await self.store.use_jti(REPLAY_CACHE, text, float(until), now):
            return None
        return challenge

    # -- what a page offers

    async def user_handle(self, subject: str) -> bytes:
        """The `user.id` of the user's passkeys (WebAuthn §5.4.3: random, no personal
        information): the one their passkeys have, or a new one."""
        existing = await self.store.passkeys_of(subject)
        return existing[0].user_handle if existing else os.urandom(32)

    def creation_options(
        self,
        ceremony: Ceremony,
        user_handle: bytes,
        username: str,
        display_name: str,
        existing: list[PasskeyRecord],
    ) -> str:
        """`PublicKeyCredentialCreationOptionsJSON` (WebAuthn §5.1.9)."""
        options, _ = self._fido().register_begin(
            PublicKeyCredentialUserEntity(name=username, id=user_handle, display_name=display_name),
            # §5.4.3 excludeCredentials: an authenticator that holds one already says so.
            [_descriptor(record) for record in existing],
            # Discoverable where the authenticator can (for passwordless sign-in); a
            # security key that cannot still serves as a second factor.
            resident_key_requirement=ResidentKeyRequirement.PREFERRED,
            user_verification=UserVerificationRequirement.PREFERRED,
            challenge=ceremony.challenge,
        )
        return json.dumps(dict(options)["publicKey"], separators=(",", ":"))

    def request_options(self, ceremony: Ceremony, allowed: list[PasskeyRecord]) -> str:
        """`PublicKeyCredentialRequestOptionsJSON` (WebAuthn §5.1.10): for the user's
        passkeys (a second step, `preferred` verification), or for any discoverable one
        (passwordless: empty allowCredentials, verification `required`)."""
        verification = (
            UserVerificationRequirement.PREFERRED
            if allowed
            else UserVerificationRequirement.REQUIRED
        )
        options, _ = self._fido().authenticate_begin(
            [_descriptor(record) for record in allowed] or None,
            user_verification=verification,
            challenge=ceremony.challenge,
        )
        return json.dumps(dict(options)["publicKey"], separators=(",", ":"))

    # -- ceremonies

    async def register(
        self, subject: str, user_handle: bytes, name: str, posted: str, challenge: bytes
    ) -> PasskeyRecord | Refusal:
        """WebAuthn §7.1: the new passkey, stored; or why not, with nothing stored."""
        data = _json(posted)
        if data is None:
            return MALFORMED
        try:
            response = RegistrationResponse.from_dict(data)
        except Exception:  # anything a parser raises means "not a credential"
            return MALFORMED
        if response.response.attestation_object.auth_data.credential_data is None:
            # §7.1: a new credential's authenticator data holds its attested credential
            # data (flag AT); fido2 asserts it rather than refusing, so it is checked first.
            return MALFORMED
        state = {
            "challenge": webauthn.encoded(challenge),
            "user_verification": UserVerificationRequirement.PREFERRED,
        }
        fido = self._fido()
        try:
            auth_data = fido.register_complete(state, response)
        except ValueError as error:
            return _refusal_of(error)
        credential = auth_data.credential_data
        if credential is None:
            return MALFORMED
        if auth_data.is_backed_up() and not auth_data.is_backup_eligible():
            return BACKUP_STATE  # §7.1: with BE not set, BS must not be set either
        if len(credential.credential_id) > webauthn.MAX_CREDENTIAL_ID:
            return MALFORMED  # §7.1 step 25
        if isinstance(credential.public_key, UnsupportedKey):
            return UNSUPPORTED
        offered = {parameters.alg for parameters in fido.allowed_algorithms}
        if credential.public_key.ALGORITHM not in offered:
            # §7.1: the key's "alg" must be one of the options' pubKeyCredParams, which
            # fido2 does not check (it can parse keys, RS1 with SHA-1 among them, that it
            # never offers).
            return UNSUPPORTED
        posted_response = data.get("response")
        transports = webauthn.known_transports(
            posted_response.get("transports") if isinstance(posted_response, dict) else None
        )
        record = PasskeyRecord(
            credential_id=credential.credential_id,
            subject=subject,
            user_handle=user_handle,
            public_key=cbor.encode(dict(credential.public_key)),
            sign_count=auth_data.counter,
            transports=transports,
            backup_eligible=auth_data.is_backup_eligible(),
            backed_up=auth_data.is_backed_up(),
            name=name,
            created_at=self.clock(),
            rp_id=self.rp_id,
        )
        if not await self.store.add_passkey(record):
            return TAKEN  # §7.1 step 26
        return record

    async def authenticate(
        self, posted: str, challenge: bytes, subject: str | None
    ) -> Assertion | Refusal:
        """WebAuthn §7.2: the passkey that signed `challenge`, its counter recorded; or why
        not, with nothing changed. `subject`: the user of the second step, whose passkey it
        must be; None for passwordless sign-in, where its user handle names the user and
        user verification is required."""
        data = _json(posted)
        if data is None:
            return MALFORMED
        try:
            response = AuthenticationResponse.from_dict(data)
        except Exception:  # anything a parser raises means "not a credential"
            return MALFORMED
        record = await self.store.get_passkey(response.raw_id)
        if record is None:
            return UNKNOWN if subject is None else UNKNOWN_AT_SECOND_STEP
        if subject is not None and record.subject != subject:
            return OTHER_USER  # §7.2 step 6: the credential must be the identified user's
        handle = response.response.user_handle
        if subject is None and handle != record.user_handle:
            # §7.2 step 6: without a user identified before, the user handle names them,
            # and it must be the one the credential was created with.
            return UNKNOWN
        if subject is not None and handle is not None and handle != record.user_handle:
            return OTHER_USER
        try:
            key = CoseKey.parse(cbor.decode(record.public_key))  # type: ignore[arg-type]
        except Exception:  # a stored key that does not parse cannot verify
            log.error("a stored passkey's public key does not parse", extra={"subject": subject})
            return MALFORMED
        state = {
            "challenge": webauthn.encoded(challenge),
            "user_verification": (
                UserVerificationRequirement.PREFERRED
                if subject is not None
                else UserVerificationRequirement.REQUIRED
            ),
        }
        stored = AttestedCredentialData.create(Aaguid.NONE, record.credential_id, key)
        try:
            self._fido().authenticate_complete(state, [stored], response)
        except ValueError as error:
            return _refusal_of(error)
        auth_data = response.response.authenticator_data
        if auth_data.is_backed_up() and not auth_data.is_backup_eligible():
            return BACKUP_STATE  # §7.2: with BE not set, BS must not be set either
        if auth_data.is_backup_eligible() != record.backup_eligible:
            # WebAuthn §6.1.3, §7.2 (its check of currentBe): the BE flag is set once, at
            # creation, and the `amr` names the key `hwk` or `swk` by it; a flag that
            # changed is no credential this server knows.
            return BACKUP_ELIGIBILITY
        if not webauthn.counter_moves_on(record.sign_count, auth_data.counter):
            return COUNTER
        if not await self.store.use_passkey(
            record.credential_id, auth_data.counter, auth_data.is_backed_up(), self.clock()
        ):
            return COUNTER  # another sign-in with this counter won the race, or it is gone
        return Assertion(record, auth_data.is_user_verified())

    # -- the user's list

    async def of(self, subject: str) -> list[PasskeyRecord]:
        """Every passkey of the user, those of another relying party id included (listed on
        the account page, where they can be removed)."""
        return await self.store.passkeys_of(subject)

    async def usable(self, subject: str) -> list[PasskeyRecord]:
        """The user's passkeys that can sign here: made for the relying party id in force
        (WebAuthn §5.1.2: a credential is scoped to the id it was created for; one kept
        from before the issuer's host changed signs for nothing here), or before ids were
        recorded. None where passkeys cannot work."""
        if self.rp_id is None:
            return []
        return [p for p in await self.store.passkeys_of(subject) if p.rp_id in (None, self.rp_id)]

    async def remove(self, subject: str, credential_id: bytes) -> bool:
        return await self.store.delete_passkey(subject, credential_id)


def _descriptor(record: PasskeyRecord) -> PublicKeyCredentialDescriptor:
    return PublicKeyCredentialDescriptor(
        type=PublicKeyCredentialType.PUBLIC_KEY,
        id=record.credential_id,
        transports=[AuthenticatorTransport(t) for t in record.transports] or None,
    )


def _json(posted: str) -> dict[str, Any] | None:
    if not posted or len(posted) > MAX_RESPONSE:
        return None
    try:
        data = json.loads(posted)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
