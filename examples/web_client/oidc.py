"""The relying party's half of OpenID Connect, written out by hand (no OAuth library).

Owns: the provider's discovery document (OIDC Discovery §4), its key set, PKCE (RFC 7636),
the token requests with client_secret_basic (RFC 6749 §2.3.1), ID token validation
(OIDC Core §3.1.3.7, §3.1.3.8 and, after a refresh, §12.2) and token revocation (RFC 7009).
PyJWT checks signatures and the registered claims; everything OpenID Connect adds is checked
here. Nothing in this module knows about web pages or sessions.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote_plus, urlencode

import aiohttp
import jwt

# Asymmetric algorithms only: `none` and the HMAC family (whose key would be our own client
# secret) are never accepted, whatever the provider advertises.
_HASH_OF_ALG: Mapping[str, Callable[..., Any]] = {
    "RS256": hashlib.sha256,
    "PS256": hashlib.sha256,
    "ES256": hashlib.sha256,
    "RS384": hashlib.sha384,
    "PS384": hashlib.sha384,
    "ES384": hashlib.sha384,
    "RS512": hashlib.sha512,
    "PS512": hashlib.sha512,
    "ES512": hashlib.sha512,
    "EdDSA": hashlib.sha512,  # Ed25519 hashes with SHA-512 (OpenID Connect Core errata)
}
ALGORITHMS = tuple(_HASH_OF_ALG)
LEEWAY = timedelta(seconds=30)  # clock skew allowed on exp and iat
JWKS_REFETCH_COOLDOWN = timedelta(seconds=10)  # an unknown kid refetches at most this often
MAX_DOCUMENT_BYTES = 1024 * 1024
TIMEOUT = aiohttp.ClientTimeout(total=10)


class ProviderError(Exception):
    """Something the provider answered (or failed to) that ends the current step."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TokenEndpointError(ProviderError):
    """An error answer of the token endpoint (RFC 6749 §5.2)."""

    def __init__(self, status: int, error: str, description: str | None) -> None:
        text = f"{error}: {description}" if description else error
        super().__init__(f"the token endpoint refused the request ({status} {text})")
        self.status = status
        self.error = error
        self.description = description


class IdTokenError(ProviderError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"the ID token is not acceptable: {reason}")
        self.reason = reason


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_verifier() -> str:
    """A PKCE code verifier: 64 random bytes, 86 characters (RFC 7636 §4.1 asks 43 to 128)."""
    return secrets.token_urlsafe(64)


def s256_challenge(verifier: str) -> str:
    """RFC 7636 §4.2: BASE64URL(SHA256(ASCII(code_verifier)))."""
    return b64url(hashlib.sha256(verifier.encode("ascii")).digest())


def token_hash(token: str, alg: str) -> str:
    """OIDC Core §3.1.3.6: the left half of the hash of the token's ASCII octets, base64url,
    with the hash function of the ID token's `alg`."""
    digest = _HASH_OF_ALG[alg](token.encode("ascii")).digest()
    return b64url(digest[: len(digest) // 2])


def basic_credentials(client_id: str, client_secret: str) -> str:
    """RFC 6749 §2.3.1: both parts form-url-encoded before they are joined and Base64-encoded,
    so a `:` or a non-ASCII character in either survives."""
    raw = f"{quote_plus(client_id)}:{quote_plus(client_secret)}".encode()
    return "Basic " + base64.b64encode(raw).decode()


@dataclass(frozen=True)
class Metadata:
    """The parts of the provider's discovery document this client uses."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    end_session_endpoint: str | None
    revocation_endpoint: str | None
    id_token_algorithms: tuple[str, ...]
    iss_parameter_supported: bool  # RFC 9207 §3

    @classmethod
    def parse(cls, document: Any, issuer: str) -> Metadata:
        if not isinstance(document, dict):
            raise ProviderError("the discovery document is not a JSON object")
        # OIDC Discovery §4.3: the issuer in the document is exactly the one we asked; a
        # different one could be an impostor's document.
        if document.get("issuer") != issuer:
            raise ProviderError(
                f"the discovery document names issuer {document.get('issuer')!r}, not {issuer!r}"
            )

        def url(name: str, required: bool = True) -> str | None:
            value = document.get(name)
            if isinstance(value, str) and value.startswith(("https://", "http://")):
                return value
            if required or value is not None:
                raise ProviderError(f"the discovery document has no usable {name}")
            return None

        advertised = document.get("id_token_signing_alg_values_supported") or ["RS256"]
        if not isinstance(advertised, list):
            raise ProviderError("id_token_signing_alg_values_supported is not a list")
        algorithms = tuple(a for a in advertised if a in _HASH_OF_ALG)
        if not algorithms:
            raise ProviderError("no ID token algorithm of the provider is one this client accepts")
        return cls(
            issuer=issuer,
            authorization_endpoint=url("authorization_endpoint") or "",
            token_endpoint=url("token_endpoint") or "",
            jwks_uri=url("jwks_uri") or "",
            end_session_endpoint=url("end_session_endpoint", required=False),
            revocation_endpoint=url("revocation_endpoint", required=False),
            id_token_algorithms=algorithms,
            iss_parameter_supported=document.get("authorization_response_iss_parameter_supported")
            is True,
        )


@dataclass(frozen=True)
class TokenSet:
    access_token: str
    expires_at: float | None
    scope: str
    refresh_token: str | None
    id_token: str | None


class Provider:
    """One OpenID provider, seen by one registered client."""

    def __init__(
        self, issuer: str, client_id: str, client_secret: str, http: aiohttp.ClientSession
    ) -> None:
        self.issuer = issuer
        self.client_id = client_id
        self._authorization = basic_credentials(client_id, client_secret)
        self._http = http
        self._metadata: Metadata | None = None
        self._keys: dict[str, dict[str, Any]] = {}
        self._keys_fetched_at = float("-inf")

    # ------------------------------------------------------------------ documents

    async def _get_json(self, url: str, what: str) -> Any:
        try:
            async with self._http.get(
                url, timeout=TIMEOUT, headers={"Accept": "application/json"}
            ) as response:
                if response.status != 200:
                    raise ProviderError(f"{what} answered {response.status}")
                body = await response.content.read(MAX_DOCUMENT_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProviderError(f"{what} could not be fetched ({exc.__class__.__name__})") from None
        if len(body) > MAX_DOCUMENT_BYTES:
            raise ProviderError(f"{what} is too large")
        try:
            return json.loads(body)
        except ValueError:
            raise ProviderError(f"{what} is not JSON") from None

    async def metadata(self) -> Metadata:
        """The discovery document, fetched on first use and kept (a failure is not kept)."""
        if self._metadata is None:
            document = await self._get_json(
                self.issuer + "/.well-known/openid-configuration", "the discovery document"
            )
            self._metadata = Metadata.parse(document, self.issuer)
        return self._metadata

    async def _key(self, kid: str | None, alg: str) -> jwt.PyJWK:
        """The provider's public key for `kid`; an unknown kid refetches the key set, at most
        once per cool-down, so made-up kids cannot make us hammer the provider."""
        if kid is None:
            raise IdTokenError("its header names no key (kid)")
        metadata = await self.metadata()
        now = time.monotonic()
        cooldown = JWKS_REFETCH_COOLDOWN.total_seconds()
        if kid not in self._keys and now - self._keys_fetched_at >= cooldown:
            document = await self._get_json(metadata.jwks_uri, "the key set")
            keys = document.get("keys") if isinstance(document, dict) else None
            if not isinstance(keys, list):
                raise ProviderError("the key set has no keys list")
            self._keys = {
                k["kid"]: k
                for k in keys
                if isinstance(k, dict) and isinstance(k.get("kid"), str) and "d" not in k
            }
            self._keys_fetched_at = now
        jwk = self._keys.get(kid)
        if jwk is None:
            raise IdTokenError("it is signed with a key the provider does not publish")
        if jwk.get("use", "sig") != "sig" or jwk.get("alg", alg) != alg:
            raise IdTokenError(f"key {kid!r} is not a {alg} signing key")
        try:
            return jwt.PyJWK(jwk, algorithm=alg)
        except jwt.PyJWTError as exc:
            raise IdTokenError(f"key {kid!r} is unusable ({exc})") from None

    # ------------------------------------------------------------------ requests

    def authorization_url(
        self, metadata: Metadata, *, redirect_uri: str, scope: str, state: str, nonce: str,
        verifier: str,
    ) -> str:  # fmt: skip
        query = urlencode(
            {
                "response_type": "code",
                "client_id": self.client_id,
                "redirect_uri": redirect_uri,
                "scope": scope,
                "state": state,
                "nonce": nonce,
                "code_challenge": s256_challenge(verifier),
                "code_challenge_method": "S256",
            }
        )
        separator = "&" if "?" in metadata.authorization_endpoint else "?"
        return metadata.authorization_endpoint + separator + query

    async def _token_request(self, form: Mapping[str, str], scope_asked: str) -> TokenSet:
        metadata = await self.metadata()
        try:
            async with self._http.post(
                metadata.token_endpoint,
                data=dict(form),
                headers={"Authorization": self._authorization, "Accept": "application/json"},
                timeout=TIMEOUT,
            ) as response:
                status = response.status
                raw = await response.content.read(MAX_DOCUMENT_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProviderError(
                f"the token endpoint could not be reached ({exc.__class__.__name__})"
            ) from None
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ProviderError(f"the token endpoint answered {status} without a JSON object")
        if status != 200:
            error = body.get("error")
            description = body.get("error_description")
            raise TokenEndpointError(
                status,
                error if isinstance(error, str) else "unknown_error",
                description if isinstance(description, str) else None,
            )
        access_token = body.get("access_token")
        token_type = body.get("token_type")
        if not isinstance(access_token, str) or not access_token:
            raise ProviderError("the token response has no access_token")
        # RFC 6749 §7.1: the client must understand the token type; we only send Bearer.
        if not isinstance(token_type, str) or token_type.lower() != "bearer":
            raise ProviderError(f"the token type {token_type!r} is not Bearer")
        expires_in = body.get("expires_in")
        refresh_token = body.get("refresh_token")
        id_token = body.get("id_token")
        scope = body.get("scope")
        return TokenSet(
            access_token=access_token,
            expires_at=time.time() + expires_in
            if isinstance(expires_in, int) and not isinstance(expires_in, bool)
            else None,
            # RFC 6749 §5.1: scope may be left out when it is exactly what was asked.
            scope=scope if isinstance(scope, str) else scope_asked,
            refresh_token=refresh_token if isinstance(refresh_token, str) else None,
            id_token=id_token if isinstance(id_token, str) else None,
        )

    async def exchange_code(
        self, code: str, *, redirect_uri: str, verifier: str, scope_asked: str
    ) -> TokenSet:
        """RFC 6749 §4.1.3 with the PKCE verifier (RFC 7636 §4.5)."""
        tokens = await self._token_request(
            {
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": redirect_uri,
                "code_verifier": verifier,
            },
            scope_asked,
        )
        if tokens.id_token is None:
            raise ProviderError("the token response has no id_token (OIDC Core §3.1.3.3)")
        return tokens

    async def refresh(self, refresh_token: str, scope_granted: str) -> TokenSet:
        """RFC 6749 §6. The provider may rotate the refresh token: keep the new one."""
        tokens = await self._token_request(
            {"grant_type": "refresh_token", "refresh_token": refresh_token}, scope_granted
        )
        if tokens.refresh_token is None:
            # RFC 6749 §6: without a new one, the old refresh token stays valid.
            tokens = TokenSet(
                tokens.access_token, tokens.expires_at, tokens.scope, refresh_token, tokens.id_token
            )
        return tokens

    async def revoke(self, token: str, hint: str) -> bool:
        """RFC 7009; True when the provider confirmed. A failure is not the user's problem."""
        metadata = await self.metadata()
        if metadata.revocation_endpoint is None:
            return False
        try:
            async with self._http.post(
                metadata.revocation_endpoint,
                data={"token": token, "token_type_hint": hint},
                headers={"Authorization": self._authorization},
                timeout=TIMEOUT,
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def end_session_url(
        self, metadata: Metadata, *, id_token: str, post_logout_redirect_uri: str, state: str
    ) -> str | None:
        """RP-Initiated Logout 1.0 §2, or None when the provider offers no such endpoint."""
        if metadata.end_session_endpoint is None:
            return None
        query = urlencode(
            {
                "id_token_hint": id_token,
                "post_logout_redirect_uri": post_logout_redirect_uri,
                "state": state,
                "client_id": self.client_id,
            }
        )
        separator = "&" if "?" in metadata.end_session_endpoint else "?"
        return metadata.end_session_endpoint + separator + query

    # ------------------------------------------------------------------ the ID token

    async def validate_id_token(
        self,
        id_token: str,
        *,
        nonce: str | None,
        access_token: str | None,
        previous: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The claims of a valid ID token, else IdTokenError.

        `nonce`: the value sent in the authorization request (required to match), or None
        after a refresh. `previous`: the claims of the ID token being replaced by a refresh,
        which the new one must agree with (OIDC Core §12.2).
        """
        metadata = await self.metadata()
        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError:
            raise IdTokenError("it is not a JWS") from None
        alg = header.get("alg")
        # §3.1.3.7 step 7: the algorithm we expect, never one the token chooses for us.
        if alg not in metadata.id_token_algorithms:
            raise IdTokenError(f"alg {alg!r} is not one this client accepts")
        if header.get("typ") not in (None, "JWT"):
            # An access token (typ at+jwt, RFC 9068) is no proof of who signed in.
            raise IdTokenError(f"typ {header.get('typ')!r} is not an ID token's")
        if "crit" in header:
            raise IdTokenError("it has critical header parameters this client does not know")
        kid = header.get("kid")
        key = await self._key(kid if isinstance(kid, str) else None, alg)
        try:
            claims: dict[str, Any] = jwt.decode(
                id_token,
                key,
                algorithms=[alg],
                issuer=self.issuer,  # step 2: exactly our issuer
                audience=self.client_id,  # step 3: we are an audience
                leeway=LEEWAY,  # step 9: exp, with some clock skew
                options={"require": ["iss", "sub", "aud", "exp", "iat"]},
            )
        except jwt.ExpiredSignatureError:
            raise IdTokenError("it has expired") from None
        except jwt.InvalidIssuerError:
            raise IdTokenError("it was issued by someone else (iss)") from None
        except jwt.InvalidAudienceError:
            raise IdTokenError("it is meant for another client (aud)") from None
        except jwt.InvalidSignatureError:
            raise IdTokenError("its signature does not verify") from None
        except jwt.PyJWTError as exc:
            raise IdTokenError(str(exc)) from None

        # Step 3 continued: every other audience must be one we trust, and we trust none.
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if any(a != self.client_id for a in audiences):
            raise IdTokenError("it also names audiences this client does not trust")
        # Steps 4 and 5: an authorized party, when named, is us.
        if "azp" in claims and claims["azp"] != self.client_id:
            raise IdTokenError("it was issued to another party (azp)")
        # Step 10: iat must be a time, and not in the future.
        iat = claims["iat"]
        if not isinstance(iat, int | float) or iat > time.time() + LEEWAY.total_seconds():
            raise IdTokenError("its iat is not a time in the past")
        if not isinstance(claims["sub"], str) or not claims["sub"]:
            raise IdTokenError("its sub is not a string")

        # Step 11: the nonce binds the token to our authorization request (replay defence).
        token_nonce = claims.get("nonce")
        if nonce is not None and not (
            isinstance(token_nonce, str)
            and hmac.compare_digest(token_nonce.encode(), nonce.encode())
        ):
            raise IdTokenError("its nonce is not the one this client sent")

        # §3.1.3.8: at_hash binds the access token that came with it.
        if "at_hash" in claims and access_token is not None:
            expected = token_hash(access_token, alg)
            if not isinstance(claims["at_hash"], str) or not hmac.compare_digest(
                claims["at_hash"].encode(), expected.encode()
            ):
                raise IdTokenError("its at_hash does not match the access token")

        if previous is not None:
            # §12.2: the refreshed ID token is about the same sign-in.
            for name in ("iss", "sub"):
                if claims.get(name) != previous.get(name):
                    raise IdTokenError(f"its {name} differs from the first ID token's")
            if "auth_time" in previous and claims.get("auth_time") != previous["auth_time"]:
                raise IdTokenError("its auth_time differs from the first ID token's")
            if token_nonce is not None and token_nonce != previous.get("nonce"):
                raise IdTokenError("its nonce differs from the first ID token's")
        return claims
