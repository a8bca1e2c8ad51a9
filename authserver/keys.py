"""The key ring: signing keys per algorithm, their public JWK Set, and their rotation.

Keys live in `keys.dir`: one PEM file per private key (mode 0600) and `keyring.json` with
each key's algorithm, state and dates. On first start a key is generated for every algorithm
the server signs with. A rotation takes a key through

    next     published in the JWKS at once, not signing yet;
    active   signing, from `activate_at` = publication + publish_ahead;
    retired  superseded, still published until every token it signed has expired
             (`remove_after` = when its successor took over + the longest token lifetime);
    removed  gone from the JWKS and the disk.

Which key signs is decided by the clock, not by when a state change is written: the
newest `next` or `active` key whose `activate_at` has passed. So every server process that
shares the directory switches at the same moment, and a late timer never makes an old key
sign a token that would outlive the key's publication.

Several processes may change the directory at once: the servers' timers, and the
`portcullis-authserver keys rotate` command. Every change runs under an exclusive lock on
`keyring.lock` and starts by reading the directory again; readers take the lock shared.
A running server calls `check` every `keys.reload_every` (CHECK_EVERY by default): it
reloads the ring when another process changed `keyring.json`, and writes the transitions
that have come due. A key another process adds is therefore published by every server
within two checks (`RotationPolicy.notice`) of its writing, which a rotation adds to
`publish_ahead` before the key may sign; so a new key is dated from when it is written, not
from when the change began (`date_from_writing`).

The in-memory ring is one immutable snapshot replaced in a single assignment, so `check`
may run in a worker thread while the event loop signs and serves the JWKS.

That is the ring of one machine (`KeyRing`, the default with SQLite storage). Replicas on
one database keep the ring in the store instead (`stored_keys.StoredKeyRing`); both share
the in-memory part (`SigningRing`) and the decisions below (`advance`, `ensure_active`,
`add_successors`), and differ only in how a change is written.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

import jwt
import orjson
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from portcullis.jose import (
    NotAnObject,
    compact_parts,
    decode_checked_alphabet,
    is_low_s,
    json_object,
    low_s,
    verify_signature,
)

from .clock import Clock

METADATA = "keyring.json"
LOCK = "keyring.lock"
CHECK_EVERY = timedelta(seconds=1)
# How soon every running server has published a key another process wrote, with checks
# every CHECK_EVERY (the default of keys.reload_every), each taking a little time. A new key
# waits this long on top of publish_ahead.
NOTICE_WITHIN = 2 * CHECK_EVERY


class KeyState(StrEnum):
    NEXT = "next"
    ACTIVE = "active"
    RETIRED = "retired"


@dataclass(frozen=True)
class KeyInfo:
    kid: str
    alg: str
    state: str  # KeyState value
    created_at: float
    activate_at: float | None = None  # when it starts (or started) signing; None: at creation
    retired_at: float | None = None
    remove_after: float | None = None  # for `retired`: when the last token it signed expires

    @property
    def active_from(self) -> float:
        return self.created_at if self.activate_at is None else self.activate_at


@dataclass(frozen=True)
class RotationPolicy:
    """Seconds: how long a new key is published before it signs, how long a retired key
    stays published, and (optionally) how long a key signs before it is replaced."""

    publish_ahead: float
    retain: float
    rotate_every: float | None = None
    # How often every server reads the ring again; a key another process adds is seen by
    # all of them within `notice` (two checks: one may be running as the key is written).
    check_every: float = CHECK_EVERY.total_seconds()

    @property
    def notice(self) -> float:
        return 2 * self.check_every

    @property
    def lead(self) -> float:
        """How long after its publication a new key may sign at the earliest."""
        return self.publish_ahead + self.notice

    @classmethod
    def of(
        cls,
        *,
        publish_ahead: timedelta,
        rotate_every: timedelta | None,
        check_every: timedelta,
        token_lifetimes: Iterable[timedelta],
    ) -> RotationPolicy:
        """The policy for keys that sign tokens of `token_lifetimes`: any key may sign any
        of them (the algorithms may coincide), so a retired key stays published for the
        longest."""
        return cls(
            publish_ahead=publish_ahead.total_seconds(),
            retain=max(token_lifetimes).total_seconds(),
            rotate_every=rotate_every.total_seconds() if rotate_every else None,
            check_every=check_every.total_seconds(),
        )


@dataclass(frozen=True)
class Event:
    """A change `check` or `rotate` made, for the log."""

    kid: str
    alg: str
    what: str  # published | activated | retired | removed


@dataclass(frozen=True)
class Rotation:
    info: KeyInfo
    created: bool  # False: a rotation was already pending for this algorithm


def _generate(alg: str) -> Any:
    if alg == "ES256":
        return ec.generate_private_key(ec.SECP256R1())
    if alg == "RS256":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if alg == "EdDSA":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(f"unsupported signing algorithm {alg}")


def public_jwk(private_key: Any, kid: str, alg: str) -> dict[str, Any]:
    public = private_key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        jwk = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
    # PyJWT adds key_ops; RFC 7517 §4.3 says not to give it beside `use`, which is the
    # member verifiers read, so `use` alone is published.
    jwk.pop("key_ops", None)
    return {**jwk, "kid": kid, "use": "sig", "alg": alg}


def _write_private(path: Path, key: Any) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())


def _read_private(path: Path) -> Any:
    # The keys are this server's own, written by `_add` into a directory only it can read;
    # the RSA consistency check (over 100 ms a key) would only slow every start.
    return serialization.load_pem_private_key(
        path.read_bytes(), None, unsafe_skip_rsa_key_validation=True
    )


Stamp = tuple[int, int, int]  # inode, mtime in ns, size of keyring.json


@dataclass(frozen=True)
class _Snapshot:
    infos: Mapping[str, KeyInfo]
    private: Mapping[str, Any]
    stamp: Stamp | None
    jwks_body: bytes
    jwks_etag: str
    # Per algorithm, the keys that may sign (active or next), the one to prefer first: the
    # signer at a time is the first whose activation has come (`_signing_key`).
    signers: Mapping[str, tuple[KeyInfo, ...]]
    # The encoded protected header of each (kid, typ) signed with so far: a few per key,
    # gone with the snapshot when the ring changes, so bounded by the keys in the ring.
    headers: dict[tuple[str, str], bytes]


def ring_snapshot(
    infos: Mapping[str, KeyInfo], private: Mapping[str, Any], stamp: Stamp | None
) -> _Snapshot:
    ordered = sorted(infos.values(), key=lambda i: (i.created_at, i.kid))
    body = orjson.dumps({"keys": [public_jwk(private[i.kid], i.kid, i.alg) for i in ordered]})
    etag = '"' + base64.urlsafe_b64encode(hashlib.sha256(body).digest()[:12]).decode() + '"'
    signers: dict[str, list[KeyInfo]] = {}
    for info in infos.values():
        if info.state in (KeyState.ACTIVE, KeyState.NEXT):
            signers.setdefault(info.alg, []).append(info)
    preferred = {
        alg: tuple(sorted(keys, key=lambda i: (i.active_from, i.created_at), reverse=True))
        for alg, keys in signers.items()
    }
    return _Snapshot(dict(infos), dict(private), stamp, body, etag, preferred, {})


def transitions(
    infos: Mapping[str, KeyInfo], now: float, policy: RotationPolicy
) -> tuple[dict[str, KeyInfo], list[Event]]:
    """The ring after the state changes due at `now`: activations (with the retirement of
    the key each one replaces) and removals. Pure: the caller writes the result."""
    result = dict(infos)
    events: list[Event] = []
    due = sorted(
        (i for i in result.values() if i.state == KeyState.NEXT and i.active_from <= now),
        key=lambda i: i.active_from,
    )
    for successor in due:
        for old in list(result.values()):
            if (
                old.alg == successor.alg
                and old.state == KeyState.ACTIVE
                and old.active_from <= successor.active_from
            ):
                # It signed until its successor took over; its last token expires `retain`
                # after that.
                took_over = successor.active_from
                result[old.kid] = replace(
                    old,
                    state=KeyState.RETIRED.value,
                    retired_at=took_over,
                    remove_after=took_over + policy.retain,
                )
                events.append(Event(old.kid, old.alg, "retired"))
        result[successor.kid] = replace(successor, state=KeyState.ACTIVE.value)
        events.append(Event(successor.kid, successor.alg, "activated"))
    for info in list(result.values()):
        if (
            info.state == KeyState.RETIRED
            and info.remove_after is not None
            and info.remove_after <= now
        ):
            del result[info.kid]
            events.append(Event(info.kid, info.alg, "removed"))
    return result, events


def _rotation_due(infos: Mapping[str, KeyInfo], now: float, policy: RotationPolicy) -> list[str]:
    """Algorithms whose active key has signed long enough that its successor must be
    published now to take over `rotate_every` after it started."""
    if policy.rotate_every is None:
        return []
    pending = {i.alg for i in infos.values() if i.state == KeyState.NEXT}
    # One check more: the check that finds it due may come that much late.
    lead = policy.lead + policy.check_every
    return sorted(
        {
            i.alg
            for i in infos.values()
            if i.state == KeyState.ACTIVE
            and i.alg not in pending
            and now >= i.active_from + policy.rotate_every - lead
        }
    )


def new_key_id(alg: str, now: float) -> str:
    return f"{alg.lower()}-{time.strftime('%Y%m%d', time.gmtime(now))}-{secrets.token_hex(4)}"


def _add(
    infos: dict[str, KeyInfo],
    private: dict[str, Any],
    alg: str,
    state: KeyState,
    now: float,
    activate_at: float | None = None,
) -> KeyInfo:
    """A new key generated into `infos` and `private`; the caller writes it."""
    kid = new_key_id(alg, now)
    private[kid] = _generate(alg)
    info = KeyInfo(kid=kid, alg=alg, state=state.value, created_at=now, activate_at=activate_at)
    infos[kid] = info
    return info


def advance(
    infos: dict[str, KeyInfo], private: dict[str, Any], now: float, policy: RotationPolicy | None
) -> list[Event]:
    """Apply the due transitions and the automatic rotation to `infos` in place (new keys'
    private halves into `private`)."""
    if policy is None:
        return []
    changed, events = transitions(infos, now, policy)
    infos.clear()
    infos.update(changed)
    for alg in _rotation_due(infos, now, policy):
        assert policy.rotate_every is not None
        current = max(
            (i for i in infos.values() if i.alg == alg and i.state == KeyState.ACTIVE),
            key=lambda i: i.active_from,
        )
        # Take over exactly `rotate_every` after the current key did, unless that is
        # sooner than a new key can safely be published.
        activate_at = max(now + policy.lead, current.active_from + policy.rotate_every)
        info = _add(infos, private, alg, KeyState.NEXT, now, activate_at)
        events.append(Event(info.kid, alg, "published"))
    return events


def ensure_active(
    infos: dict[str, KeyInfo], private: dict[str, Any], algorithms: Iterable[str], now: float
) -> list[Event]:
    """An active key, signing at once, for each algorithm that has none (a first start)."""
    events = []
    for alg in dict.fromkeys(algorithms):
        if not any(i.alg == alg and i.state == KeyState.ACTIVE for i in infos.values()):
            info = _add(infos, private, alg, KeyState.ACTIVE, now)
            events.append(Event(info.kid, alg, "activated"))
    return events


def add_successors(
    infos: dict[str, KeyInfo],
    private: dict[str, Any],
    algorithms: Iterable[str],
    now: float,
    policy: RotationPolicy,
) -> list[Rotation]:
    """A successor for each algorithm's active key, signing from `policy.lead` on; an
    algorithm that already has one waiting keeps it."""
    result = []
    for alg in dict.fromkeys(algorithms):
        waiting = [i for i in infos.values() if i.alg == alg and i.state == KeyState.NEXT]
        if waiting:
            result.append(Rotation(max(waiting, key=lambda i: i.active_from), False))
            continue
        info = _add(infos, private, alg, KeyState.NEXT, now, now + policy.lead)
        result.append(Rotation(info, True))
    return result


def date_from_writing(
    infos: dict[str, KeyInfo],
    known: Iterable[str],
    writing_at: float,
    policy: RotationPolicy,
) -> None:
    """Date the keys a change adds to `infos` (those not `known`) that wait to sign from
    `writing_at`, when the change is about to be written, instead of from the moment it was
    decided: other servers notice a key within `policy.notice` of its writing, and the time
    between the decision and the write (a lock waited for, the store's round trips, an RSA
    key generated, which takes up to a second on a busy machine) must not come out of that.
    A key planned to sign later than `policy.lead` after the write keeps its time."""
    old = set(known)
    for kid, info in list(infos.items()):
        if kid in old or info.state != KeyState.NEXT or info.activate_at is None:
            continue
        if writing_at > info.created_at:
            infos[kid] = replace(
                info,
                created_at=writing_at,
                activate_at=max(info.activate_at, writing_at + policy.lead),
            )


class SigningRing:
    """The in-memory ring every request reads: which key signs, the public JWK Set, and
    verification of this server's own tokens. Where the ring is kept is a subclass's."""

    where = "the key ring"  # for messages: where the keys are kept

    def __init__(self, policy: RotationPolicy | None = None, clock: Clock = time.time) -> None:
        self.policy = policy
        self.clock = clock  # decides which key signs: see the module's description
        self._snap = ring_snapshot({}, {}, None)

    # ------------------------------------------------------------------ reading

    @property
    def jwks_body(self) -> bytes:
        return self._snap.jwks_body

    @property
    def jwks_etag(self) -> str:
        return self._snap.jwks_etag

    def infos(self) -> list[KeyInfo]:
        return sorted(self._snap.infos.values(), key=lambda i: (i.created_at, i.kid))

    def view(self, now: float) -> list[KeyInfo]:
        """The keys as they are at `now`, transitions due but not yet written included."""
        infos = self._snap.infos
        if self.policy is not None:
            infos, _ = transitions(infos, now, self.policy)
        return sorted(infos.values(), key=lambda i: (i.created_at, i.kid))

    def stale(self, now: float) -> str | None:
        """Why the ring in memory may no longer be trusted to sign, if it may not."""
        return None

    def jwks_cacheable_for(self, now: float) -> float | None:
        """How long a verifier may keep the JWK Set served now, at most; None: as long as
        keys.jwks_max_age says. Nothing (0 or less): the ring may lack a key that signs."""
        return None

    # ------------------------------------------------------------------ lifecycle, async

    async def start(self, algorithms: Iterable[str]) -> list[Event]:
        """Read the ring, generating an active key for any algorithm that has none, and
        writing the transitions that are due."""
        raise NotImplementedError

    async def tick(self, now: float) -> list[Event]:
        """What a running server does every `policy.check_every`: pick up what other
        processes wrote, and write the transitions that have come due."""
        raise NotImplementedError

    async def rotate_keys(self, algorithms: Iterable[str], now: float) -> list[Rotation]:
        """Publish a successor for each algorithm's active key (`add_successors`)."""
        raise NotImplementedError

    async def listing(self, now: float) -> list[KeyInfo] | None:
        """The keys for `keys list`, or None when no server has made any yet."""
        raise NotImplementedError

    # ------------------------------------------------------------------ use

    def active(self, alg: str, now: float | None = None) -> KeyInfo:
        """The key that signs `alg` at `now`: the newest one whose activation has come."""
        return _signing_key(self._snap, alg, self.clock() if now is None else now)

    def sign(
        self, alg: str, claims: Mapping[str, Any], typ: str = "JWT", *, repeatable: bool = True
    ) -> str:
        """A JWS compact serialisation (RFC 7515 §7.1) of `claims`, signed by the key that
        signs for `alg` now. `repeatable`: the same claims signed again give the same token
        (`_ecdsa_sha256`); False for a token that is never signed again, which ES256 then
        signs with a random nonce, a little faster. On the token endpoint's hot path: the
        protected header of a (kid, typ) is encoded once per ring snapshot, and the signature
        is made with cryptography directly."""
        snap = self._snap
        now = self.clock()
        self._refuse_if_stale(now)
        info = _signing_key(snap, alg, now)
        header = snap.headers.get((info.kid, typ))
        if header is None:
            header = b64url(orjson.dumps({"alg": alg, "kid": info.kid, "typ": typ}))
            snap.headers[(info.kid, typ)] = header
        signing_input = header + b"." + b64url(orjson.dumps(dict(claims)))
        signature = _jws_signature(alg, snap.private[info.kid], signing_input, repeatable)
        return (signing_input + b"." + b64url(signature)).decode("ascii")

    def _refuse_if_stale(self, now: float) -> None:
        """Nothing by default: a ring whose copy can fall behind refuses here."""

    def verify(
        self,
        token: str,
        algorithms: Iterable[str],
        *,
        issuer: str | None = None,
        audience: str | None = None,
        leeway: float = 0,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The claims of a token this server signed, with any published key (for
        introspection, userinfo, the admin API and logout hints); jwt.InvalidTokenError
        when it is not one, or they do not hold.

        The JWS is the kernel's to read (portcullis/jose.py), as the gateway reads tokens: a
        compact serialisation of canonical base64url parts, header and payload JSON objects;
        the `kid` of a key of this ring and its `alg`, one of `algorithms`; the signature
        of that key, an ES256 one in the low-S spelling this ring signs (`sign`): the other
        spelling of the same signature is refused as a bad signature. Then the claims, as
        PyJWT's `decode` judges them (`_check_claims`) but at the ring's clock, so a token
        is valid when its server says: `options` names the claims it must `require` and
        may turn off `verify_aud`, `verify_iss`, `verify_exp`, `verify_nbf`, `verify_iat`."""
        snap = self._snap
        parts = compact_parts(token)
        if parts is None:
            raise jwt.DecodeError("not a compact JWS")
        header = _part(parts[0], "header")
        kid = header.get("kid")
        if not isinstance(kid, str) or kid not in snap.private:
            raise jwt.InvalidTokenError("unknown key")
        info = snap.infos[kid]
        if header.get("alg") != info.alg or info.alg not in set(algorithms):
            raise jwt.InvalidTokenError("algorithm does not match the key")
        try:
            signature = decode_checked_alphabet(parts[2])
        except binascii.Error:
            raise jwt.DecodeError("the signature is not base64url") from None
        signing_input = token[: len(parts[0]) + 1 + len(parts[1])].encode("ascii")
        key = snap.private[kid].public_key()
        if not is_low_s(info.alg, signature) or not verify_signature(
            info.alg, key, signing_input, signature
        ):
            raise jwt.InvalidSignatureError("Signature verification failed")
        claims = _part(parts[1], "payload")
        _check_claims(
            claims,
            self.clock(),
            dict(options or {}),
            issuer=issuer,
            audience=audience,
            leeway=leeway,
        )
        return claims


class KeyRing(SigningRing):
    """The ring in a directory of this machine (`keys.dir`)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        policy: RotationPolicy | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(policy, clock)
        self.dir = Path(directory)
        self.where = f"the key directory {self.dir}"

    # ------------------------------------------------------------------ persistence

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _stamp(self) -> Stamp | None:
        try:
            st = os.stat(self.dir / METADATA)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read(self) -> tuple[dict[str, KeyInfo], dict[str, Any], Stamp | None]:
        """The ring on disk (call under the lock); private keys already in memory are kept."""
        stamp = self._stamp()
        infos: dict[str, KeyInfo] = {}
        if stamp is not None:
            for entry in json.loads((self.dir / METADATA).read_text()):
                info = KeyInfo(**entry)
                infos[info.kid] = info
        known = self._snap.private
        private = {
            kid: known[kid] if kid in known else _read_private(self.dir / f"{kid}.pem")
            for kid in infos
        }
        return infos, private, stamp

    def _write(self, infos: Mapping[str, KeyInfo], private: Mapping[str, Any]) -> None:
        """Write the PEM files of new keys, then the metadata atomically, delete the PEM
        files of keys no longer in it, and make the result the in-memory ring (call under
        the exclusive lock)."""
        for kid in infos:
            if not (self.dir / f"{kid}.pem").exists():
                _write_private(self.dir / f"{kid}.pem", private[kid])
        tmp = self.dir / (METADATA + ".tmp")
        ordered = sorted(infos.values(), key=lambda i: (i.created_at, i.kid))
        with open(tmp, "w") as f:
            f.write(json.dumps([asdict(i) for i in ordered], indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / METADATA)
        for kid in set(private) - set(infos):
            (self.dir / f"{kid}.pem").unlink(missing_ok=True)
        kept = {kid: key for kid, key in private.items() if kid in infos}
        self._snap = ring_snapshot(infos, kept, self._stamp())

    def load(self, algorithms: Iterable[str]) -> list[Event]:
        """Read the ring, generating an active key for any algorithm that has none, and
        writing the transitions that are due."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        now = self.clock()
        with self._locked(exclusive=True):
            infos, private, stamp = self._read()
            known = list(infos)
            events = advance(infos, private, now, self.policy)
            events += ensure_active(infos, private, algorithms, now)
            if events or stamp is None:
                self._date_from_writing(infos, known)
                self._write(infos, private)
            else:
                self._snap = ring_snapshot(infos, private, stamp)
        return events

    def reload(self) -> None:
        with self._locked(exclusive=False):
            self._snap = ring_snapshot(*self._read())

    def check(self, now: float) -> list[Event]:
        """What a running server does every check: write the transitions that are due
        (and an automatic rotation), else reload the ring if another process changed it."""
        snap = self._snap
        if self.policy is not None and change_due(snap.infos, now, self.policy):
            with self._locked(exclusive=True):
                infos, private, _ = self._read()
                known = list(infos)
                events = advance(infos, private, now, self.policy)
                if events:
                    self._date_from_writing(infos, known)
                    self._write(infos, private)
                else:
                    self._snap = ring_snapshot(infos, private, self._stamp())
                return events
        if self._stamp() != snap.stamp:
            self.reload()
        return []

    def rotate(self, algorithms: Iterable[str], now: float) -> list[Rotation]:
        """Publish a successor for each algorithm's active key; it signs from publish_ahead
        (plus the time every server needs to notice it) on. An algorithm that already has
        a successor waiting keeps it."""
        if self.policy is None:
            raise RuntimeError("rotation needs a rotation policy")
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._locked(exclusive=True):
            infos, private, _ = self._read()
            known = list(infos)
            advance(infos, private, now, self.policy)
            result = add_successors(infos, private, algorithms, now, self.policy)
            self._date_from_writing(infos, known)
            self._write(infos, private)
        return [replace(r, info=infos[r.info.kid]) for r in result]

    def _date_from_writing(self, infos: dict[str, KeyInfo], known: Iterable[str]) -> None:
        if self.policy is not None:
            date_from_writing(infos, known, self.clock(), self.policy)

    def retire(self, kid: str, now: float, last_token_expiry: float) -> None:
        """Stop signing with `kid`; keep it published until `last_token_expiry`."""
        with self._locked(exclusive=True):
            infos, private, _ = self._read()
            info = infos[kid]
            infos[kid] = replace(
                info,
                state=KeyState.RETIRED.value,
                retired_at=now,
                remove_after=last_token_expiry,
            )
            self._write(infos, private)

    def purge(self, now: float) -> list[str]:
        """Remove retired keys whose every token has expired."""
        with self._locked(exclusive=True):
            infos, private, _ = self._read()
            gone = [
                i.kid
                for i in infos.values()
                if i.state == KeyState.RETIRED
                and i.remove_after is not None
                and i.remove_after <= now
            ]
            if gone:
                for kid in gone:
                    del infos[kid]
                self._write(infos, private)
            else:
                self._snap = ring_snapshot(infos, private, self._stamp())
        return gone

    # ------------------------------------------------------------------ lifecycle, async
    # Files are read and locks waited for in a worker thread, off the event loop; the
    # snapshot is replaced in one assignment, so the loop may sign meanwhile.

    async def start(self, algorithms: Iterable[str]) -> list[Event]:
        return await asyncio.to_thread(self.load, list(algorithms))

    async def tick(self, now: float) -> list[Event]:
        return await asyncio.to_thread(self.check, now)

    async def rotate_keys(self, algorithms: Iterable[str], now: float) -> list[Rotation]:
        return await asyncio.to_thread(self.rotate, list(algorithms), now)

    async def listing(self, now: float) -> list[KeyInfo] | None:
        if not (self.dir / METADATA).exists():
            return None
        self.reload()
        return self.view(now)


def change_due(infos: Mapping[str, KeyInfo], now: float, policy: RotationPolicy) -> bool:
    """Whether a transition or an automatic rotation is due at `now`."""
    for info in infos.values():
        if info.state == KeyState.NEXT and info.active_from <= now:
            return True
        if (
            info.state == KeyState.RETIRED
            and info.remove_after is not None
            and info.remove_after <= now
        ):
            return True
    return bool(_rotation_due(infos, now, policy))


def _whole_seconds(claims: Mapping[str, Any], name: str, error: type[Exception]) -> int:
    try:
        return int(claims[name])
    except (ValueError, TypeError, OverflowError):
        raise error(f"the {name} claim must be an integer") from None


def _part(part: str, name: str) -> dict[str, Any]:
    """The JSON object a token's header or payload (`name`) encodes."""
    try:
        return json_object(part)
    except NotAnObject as exc:
        raise jwt.DecodeError(f"the {name} {exc.problem}") from None


def _check_claims(
    claims: Mapping[str, Any],
    now: float,
    options: Mapping[str, Any],
    *,
    issuer: str | None,
    audience: str | None,
    leeway: float,
) -> None:
    """RFC 7519 §4.1 as PyJWT's `decode` applies them, in its order, at `now`: the claims
    `options` requires present; `iat`, `nbf` and `exp` (each only when present and its
    check is on); `iss` the issuer, when one is given; `aud` naming the audience given, or
    none at all when none is; `sub` and `jti` strings."""
    for name in options.get("require", ()):
        if claims.get(name) is None:
            raise jwt.MissingRequiredClaimError(name)

    def late(name: str, error: type[Exception], than: float) -> bool:
        judged = bool(options.get(f"verify_{name}", True))
        return judged and name in claims and _whole_seconds(claims, name, error) > than

    if late("iat", jwt.InvalidIssuedAtError, now + leeway):
        raise jwt.ImmatureSignatureError("the token is not yet valid (iat)")
    if late("nbf", jwt.DecodeError, now + leeway):
        raise jwt.ImmatureSignatureError("the token is not yet valid (nbf)")
    if (
        options.get("verify_exp", True)
        and "exp" in claims
        and not late("exp", jwt.DecodeError, now - leeway)
    ):
        raise jwt.ExpiredSignatureError("the token has expired")
    if issuer is not None and options.get("verify_iss", True):
        if "iss" not in claims:
            raise jwt.MissingRequiredClaimError("iss")
        if claims["iss"] != issuer:
            raise jwt.InvalidIssuerError("Invalid issuer")
    if options.get("verify_aud", True):
        _check_audience(claims.get("aud"), audience)
    if "sub" in claims and not isinstance(claims["sub"], str):
        raise jwt.exceptions.InvalidSubjectError("Subject must be a string")
    if "jti" in claims and not isinstance(claims["jti"], str):
        raise jwt.exceptions.InvalidJTIError("JWT ID must be a string")


def _check_audience(aud: Any, audience: str | None) -> None:
    """RFC 7519 §4.1.3: a token for `audience` names it in `aud` (a string, or an array of
    strings); a token whose reader names no audience has none."""
    if audience is None:
        if aud:
            raise jwt.InvalidAudienceError("Invalid audience")
        return
    if not aud:
        raise jwt.MissingRequiredClaimError("aud")
    names = [aud] if isinstance(aud, str) else aud
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise jwt.InvalidAudienceError("Invalid claim format in token")
    if audience not in names:
        raise jwt.InvalidAudienceError("Audience doesn't match")


@functools.cache
def _ecdsa_sha256() -> ec.ECDSA:
    """Deterministic ECDSA (RFC 6979) where the OpenSSL underneath has it: the same claims
    signed again give the same token, so a refresh retried within the grace window is
    answered byte for byte as the first time (its plan is signed again, tokens.py).
    Verifiers cannot tell the two kinds of signature apart."""
    deterministic = ec.ECDSA(hashes.SHA256(), deterministic_signing=True)
    try:
        ec.generate_private_key(ec.SECP256R1()).sign(b"probe", deterministic)
    except UnsupportedAlgorithm:
        return ec.ECDSA(hashes.SHA256())
    return deterministic


_SHA256 = hashes.SHA256()
_PKCS1V15 = padding.PKCS1v15()
_ECDSA_RANDOM = ec.ECDSA(_SHA256)


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def b64url(data: bytes) -> bytes:
    """base64url without padding (RFC 7515 §2), without base64.urlsafe_b64encode's copies."""
    return binascii.b2a_base64(data, newline=False).translate(_URLSAFE).rstrip(b"=")


def _jws_signature(alg: str, key: Any, signing_input: bytes, repeatable: bool = True) -> bytes:
    """RFC 7518 §3.3 (RS256), §3.4 (ES256: r and s as fixed-size big-endian integers, not
    DER, and s in its low half: portcullis/jose.py), RFC 8037 §3.1 (EdDSA). RS256 and EdDSA
    signatures are deterministic by nature; ES256's only when `repeatable`."""
    if alg == "ES256":
        ecdsa = _ecdsa_sha256() if repeatable else _ECDSA_RANDOM
        r, s = decode_dss_signature(key.sign(signing_input, ecdsa))
        # OpenSSL gives s or n - s alike; gateways key on the low-S spelling, and this
        # server's own verification refuses the other.
        return low_s(alg, r.to_bytes(32, "big") + s.to_bytes(32, "big"))
    if alg == "RS256":
        return bytes(key.sign(signing_input, _PKCS1V15, _SHA256))
    if alg == "EdDSA":
        return bytes(key.sign(signing_input))
    raise ValueError(f"unsupported signing algorithm {alg}")


def _signing_key(snap: _Snapshot, alg: str, now: float) -> KeyInfo:
    """The active or next key of `alg` activated last by `now` (the newest of those that
    were activated together)."""
    for info in snap.signers.get(alg, ()):
        if info.active_from <= now:
            return info
    raise LookupError(f"no active {alg} key")
