"""The authorization endpoint (RFC 6749 §4.1.1, OIDC Core §3.1.2) and its login and consent
pages.

Order of checks:
 1. client_id known (a metadata document's URL: fetched and checked by
    authserver/metadata_documents.py, a refusal shown on the page) and redirect_uri
    registered (exactly, or for a public native client by the loopback rule of RFC 8252
    §7.3, and free of control characters and spaces), neither given twice — else a 400
    page, never a redirect to an unverified URI (RFC 6749 §4.1.2.1);
 2. everything else — errors now redirect to the client with `error`, `error_description`,
    `state` and `iss` (RFC 9207): repeated parameters, request objects, response_type,
    response_mode, scope, PKCE (S256 only), prompt, max_age, resource;
 3. login (unless a session fits `prompt` and `max_age`): the password, then for a user
    with an authenticator app its code (POST /login/code, the pending sign-in of
    endpoints/signin.py between the two); or a passkey, or an upstream identity provider
    (federation.py). With `password_sign_in: false` the page has no password form and
    POST /login refuses before reading the form;
 4. the level of the sign-in: a second factor when the request asks for it (`acr_values`,
    else the client's `default_acr_values`), the client requires it (`require_mfa`) or the
    operator requires it of this user (`second_factors`). A session signed in with the
    password alone signs in again, with both factors; a user without a second factor is
    led to set one up (an authenticator app at /factors, or a passkey), and the request goes
    on from there;
 5. consent (unless skipped or already given); then a single-use code in a 302/303
    redirect.
The login and consent forms carry the authorization parameters as hidden fields and post
them back; they are validated again from step 1, so nothing on the page is trusted. The consent
form also carries a proof, bound to the session, that these exact parameters already passed
the login checks: without it, `prompt=login` or `max_age=0` would send the user who just
signed in and approved back to the login page forever.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from portcullis.addresses import is_loopback
from portcullis.jose import is_thumbprint

from .. import accesslog, audit
from ..audit import Event
from ..factors import (
    ENROLMENT_NEEDS_SIGN_IN_WITHIN,
    Method,
    methods_of,
    multi_factor,
)
from ..grants.base import target_for
from ..metadata_documents import DocumentRefused, MetadataDocuments
from ..protocol import assurance, pkce
from ..protocol import scopes as scope_rules
from ..protocol.client_ids import document_url
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from ..protocol.resources import Audiences, ProtectedResource
from ..registry import Client
from ..sessions import Session, Sessions
from ..store.base import MANAGED_BY_METADATA_DOCUMENT, CodeRecord
from ..tokens import digest, random_token
from . import signin
from .forms import form_items, given_more_than_once, query_items, with_query
from .passkey_offers import has_second_factor

CARRIED = (
    "response_type",
    "client_id",
    "redirect_uri",
    "scope",
    "state",
    "nonce",
    "code_challenge",
    "code_challenge_method",
    "prompt",
    "max_age",
    "response_mode",
    "resource",
    "login_hint",
    "dpop_jkt",
    "acr_values",
)
PROMPTS = frozenset({"none", "login", "consent", "select_account"})
_MAX_AGE = re.compile(r"^[0-9]{1,10}$")
CONSENT_PROOF = "login_checked"  # the consent form's field proving the login checks passed


@dataclass(frozen=True)
class Parameters:
    """Request parameters: the first value of each (empty ones count as absent, RFC 6749
    §3.1) and the names given more than once, which RFC 6749 §3.1 forbids."""

    values: dict[str, str]
    repeated: frozenset[str]

    @classmethod
    def collect(cls, items: Iterable[tuple[str, object]]) -> Parameters:
        values: dict[str, str] = {}
        repeated: set[str] = set()
        for key, value in items:
            if not isinstance(value, str):
                raise invalid_request("parameters must be text")
            if key in values:
                repeated.add(key)
            else:
                values[key] = value
        return cls({k: v for k, v in values.items() if v != ""}, frozenset(repeated))


@dataclass(frozen=True)
class AuthorizationRequest:
    client: Client
    redirect_uri: str
    params: dict[str, str]
    scopes: tuple[str, ...]
    state: str | None
    nonce: str | None
    code_challenge: str | None
    prompt: frozenset[str]
    max_age: int | None
    audience: str
    dpop_jkt: str | None = None  # RFC 9449 §10: the key the code is bound to
    resource: ProtectedResource | None = None  # the registered resource `audience` is
    acr_values: tuple[str, ...] = ()  # OIDC Core §3.1.2.1, in order of preference

    def carried(self) -> list[tuple[str, str]]:
        return [(k, self.params[k]) for k in CARRIED if k in self.params]


class PageError(Exception):
    """Before the redirect URI is trusted: answer with a page, never a redirect."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RedirectError(Exception):
    def __init__(
        self,
        request: AuthorizationRequest | None,
        redirect_uri: str,
        state: str | None,
        error: OAuthError,
    ) -> None:
        super().__init__(error.description)
        self.redirect_uri = redirect_uri
        self.state = state
        self.error = error


def _loopback_ip(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "localhost" is a name, not the loopback rule (RFC 8252 §8.3)


# Control characters (C0, DEL, C1) and the space.
_NOT_IN_URI = re.compile(r"[\x00-\x20\x7f-\x9f]")


def uri_characters_only(uri: str) -> bool:
    """Whether `uri` is free of the characters no URI holds: RFC 3986 §2 allows none of
    the controls or the space. URL splitting drops TAB, CR and LF (urlsplit follows the
    WHATWG URL parser there), so without this a URI carrying them would match a loopback
    registration (RFC 8252 §7.3) and get a code whose redirect cannot be written."""
    return _NOT_IN_URI.search(uri) is None


def redirect_uri_registered(client: Client, uri: str) -> bool:
    """Exact string match (RFC 9700 §2.1), or, for a public native client only, an http
    loopback IP literal on any port (RFC 8252 §7.3)."""
    if uri in client.redirect_uris:
        return True
    if not client.loopback_any_port:
        return False
    requested = urlsplit(uri)
    if requested.scheme != "http" or not _loopback_ip(requested.hostname):
        return False
    if requested.username is not None or requested.password is not None or "#" in uri:
        return False
    try:
        requested.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        return False
    for registered in client.redirect_uris:
        reg = urlsplit(registered)
        if (
            reg.scheme == "http"
            and _loopback_ip(reg.hostname)
            and reg.hostname == requested.hostname
            and reg.path == requested.path
            and reg.query == requested.query
        ):
            return True
    return False


# MCP authorization, security considerations: a document cannot stop another program on the
# user's machine from claiming a localhost redirect; the user is told.
LOOPBACK_ONLY = (
    "This application returns you only to addresses on your own computer. Any program "
    "running there could claim to be it: allow access only if you just started it yourself."
)


def described_by(client: Client) -> str | None:
    """The host of the metadata document that describes `client`, shown first on its
    consent page (draft §"OAuth Phishing Attacks"); None for any other client."""
    if client.managed_by != MANAGED_BY_METADATA_DOCUMENT:
        return None
    return document_url(client.client_id).shown_host


def loopback_only(client: Client) -> bool:
    """Whether every redirect URI of `client` goes to this machine."""
    return bool(client.redirect_uris) and all(
        urlsplit(uri).scheme == "http" and is_loopback(urlsplit(uri).hostname)
        for uri in client.redirect_uris
    )


def _shown_host(uri: str) -> str:
    parts = urlsplit(uri)
    return parts.netloc.rpartition("@")[2] or uri


def _redirect(request: web.Request, location: str) -> web.Response:
    # 303 after a POST so the browser does not re-post to the client; 302 after a GET.
    # Never 307, which would replay the form (with the password) to the client.
    status = 303 if request.method == "POST" else 302
    return web.Response(status=status, headers={"Location": location, "Cache-Control": "no-store"})


async def _params(request: web.Request) -> Parameters:
    if request.method == "POST":
        return Parameters.collect(await form_items(request))
    return Parameters.collect(query_items(request))


class AuthorizationEndpoint(signin.SignInPage):
    """GET/POST /authorize, and the login and consent forms posted back to it."""

    def __init__(
        self,
        services: signin.SignInServices,
        *,
        issuer: str,
        audiences: Audiences,
        code_lifetime: float,
        documents: MetadataDocuments | None = None,
    ) -> None:
        super().__init__(services)
        self.documents = documents
        self.issuer = issuer
        self.audiences = audiences
        self.code_lifetime = code_lifetime

    async def validate(self, given: Parameters) -> AuthorizationRequest:
        params = given.values
        trusted_first = sorted(given.repeated & {"client_id", "redirect_uri"})
        if trusted_first:
            raise PageError(f"The request gives {' and '.join(trusted_first)} more than once.")
        client_id = params.get("client_id")
        client = await self._client(client_id) if client_id else None
        if client is None:
            raise PageError("The application that sent you here is not registered.")
        accesslog.client_known(client.client_id)
        if "authorization_code" not in client.grant_types:
            raise PageError("This application may not ask for sign-in.")
        redirect_uri = params.get("redirect_uri")
        if redirect_uri is None:
            raise PageError("The request has no redirect_uri.")
        if not uri_characters_only(redirect_uri):
            raise PageError("The redirect address is not a valid URI.")
        if not redirect_uri_registered(client, redirect_uri):
            raise PageError("The redirect address is not registered for this application.")

        # A repeated state cannot be echoed: which one would the client expect?
        state = None if "state" in given.repeated else params.get("state")

        def fail(error: OAuthError) -> RedirectError:
            return RedirectError(None, redirect_uri, state, error)

        try:
            if given.repeated:
                raise given_more_than_once(given.repeated)
            if "request" in params:
                raise OAuthError(
                    ErrorCode.REQUEST_NOT_SUPPORTED, "request objects are not supported"
                )
            if "request_uri" in params:
                raise OAuthError(
                    ErrorCode.REQUEST_URI_NOT_SUPPORTED, "request_uri is not supported"
                )
            if "response_type" not in params:
                raise invalid_request("response_type is required")
            if params["response_type"] != "code":
                raise OAuthError(ErrorCode.UNSUPPORTED_RESPONSE_TYPE, "response_type must be code")
            if params.get("response_mode", "query") != "query":
                raise invalid_request("response_mode must be query")
            scopes = scope_rules.parse(params.get("scope"))
            if not scopes:
                raise OAuthError(ErrorCode.INVALID_SCOPE, "scope is required")
            scope_rules.require_allowed(scopes, client.scope)
            nonce = params.get("nonce")
            challenge = params.get("code_challenge")
            if client.require_pkce or challenge is not None or "code_challenge_method" in params:
                pkce.check_challenge(challenge, params.get("code_challenge_method"))
            elif not ("openid" in scopes and nonce):
                # Without PKCE only a legacy OpenID Connect client's nonce protects the code.
                raise invalid_request("code_challenge is required (PKCE with S256)")
            prompt = frozenset(params.get("prompt", "").split())
            if not prompt <= PROMPTS:
                raise invalid_request("prompt has an unknown value")
            if "none" in prompt and len(prompt) > 1:
                raise invalid_request("prompt=none cannot be combined with other values")
            max_age = None
            if "max_age" in params:
                if not _MAX_AGE.match(params["max_age"]):
                    raise invalid_request("max_age must be a non-negative integer")
                max_age = int(params["max_age"])
            target = target_for(self.audiences, client, params.get("resource"), scopes)
            dpop_jkt = params.get("dpop_jkt")
            if dpop_jkt is not None and not is_thumbprint(dpop_jkt):
                # RFC 9449 §10: a JWK SHA-256 thumbprint (RFC 7638), base64url.
                raise invalid_request("dpop_jkt must be a JWK SHA-256 thumbprint")
        except OAuthError as error:
            raise fail(error) from None
        return AuthorizationRequest(
            client=client,
            redirect_uri=redirect_uri,
            params={k: v for k, v in params.items() if k in CARRIED},
            scopes=scopes,
            state=state,
            nonce=nonce,
            code_challenge=challenge,
            prompt=prompt,
            max_age=max_age,
            audience=target.audience,
            dpop_jkt=dpop_jkt,
            resource=target.resource,
            acr_values=tuple(params.get("acr_values", "").split()),
        )

    async def _client(self, client_id: str) -> Client | None:
        if self.documents is None:
            return await self.clients.client(client_id)
        try:
            return await self.documents.for_authorization(client_id)
        except DocumentRefused as refused:
            raise PageError(refused.message) from None

    def error_redirect(self, request: web.Request, exc: RedirectError) -> web.Response:
        return _redirect(
            request,
            with_query(
                exc.redirect_uri,
                {
                    "error": exc.error.code.value,
                    "error_description": exc.error.description,
                    "state": exc.state,
                    "iss": self.issuer,  # RFC 9207 §2
                },
            ),
        )

    def _needs_login(
        self, auth: AuthorizationRequest, session: Session | None, login_done: bool
    ) -> bool:
        if session is None or not session.logged_in:
            return True
        if login_done:
            return False
        if "login" in auth.prompt or "select_account" in auth.prompt:
            return True
        return auth.max_age is not None and self.clock() - session.record.auth_time > auth.max_age

    async def proceed(
        self,
        request: web.Request,
        auth: AuthorizationRequest,
        session: Session | None,
        *,
        login_done: bool = False,
        consent_given: bool = False,
    ) -> web.Response:
        """Login, consent or the code, whichever is next for this request and session.

        `login_done`: this session has just signed in for this request, or passed the login
        checks for it before the consent page was shown; `prompt` and `max_age` are satisfied.
        """
        if self._needs_login(auth, session, login_done):
            if "none" in auth.prompt:
                raise RedirectError(
                    auth,
                    auth.redirect_uri,
                    auth.state,
                    OAuthError(ErrorCode.LOGIN_REQUIRED, "the user is not signed in"),
                )
            return await self.login_page(request, auth)
        assert session is not None
        subject = session.record.subject
        if not multi_factor(session.amr) and await self._needs_second_factor(auth, subject):
            if await self.has_second_factor(subject):
                # Signed in with the password alone (before the app was set up): both now.
                if "none" in auth.prompt:
                    raise RedirectError(
                        auth,
                        auth.redirect_uri,
                        auth.state,
                        OAuthError(ErrorCode.LOGIN_REQUIRED, "a second factor is required"),
                    )
                return await self.login_page(request, auth)
            if not self.factors.available and not self._passkeys_available:
                raise RedirectError(
                    auth,
                    auth.redirect_uri,
                    auth.state,
                    OAuthError(
                        ErrorCode.ACCESS_DENIED,
                        "a second factor is required and this server cannot set one up",
                    ),
                )
            if "none" in auth.prompt:
                raise RedirectError(
                    auth,
                    auth.redirect_uri,
                    auth.state,
                    OAuthError(
                        ErrorCode.INTERACTION_REQUIRED, "the user must set up a second factor"
                    ),
                )
            signed_in_for = self.clock() - session.record.auth_time
            if signed_in_for > ENROLMENT_NEEDS_SIGN_IN_WITHIN.total_seconds():
                return await self.login_page(request, auth)  # the password first, again
            return await self.enrolment_page(auth, session)
        if not consent_given and not auth.client.skip_consent:
            granted = await self.store.granted_scopes(subject, auth.client.client_id)
            if "consent" in auth.prompt or not set(auth.scopes) <= granted:
                if "none" in auth.prompt:
                    raise RedirectError(
                        auth,
                        auth.redirect_uri,
                        auth.state,
                        OAuthError(ErrorCode.CONSENT_REQUIRED, "the user has not consented"),
                    )
                return await self.consent_page(auth, session)
        now = self.clock()
        code = random_token()
        await self.store.save_code(
            CodeRecord(
                code_hash=digest(code),
                client_id=auth.client.client_id,
                subject=subject,
                redirect_uri=auth.redirect_uri,
                scope=scope_rules.render(auth.scopes),
                audience=auth.audience,
                nonce=auth.nonce,
                code_challenge=auth.code_challenge,
                auth_time=session.record.auth_time,
                expires_at=now + self.code_lifetime,
                created_at=now,
                dpop_jkt=auth.dpop_jkt,
                amr=session.amr,
            )
        )
        response = _redirect(
            request,
            with_query(auth.redirect_uri, {"code": code, "state": auth.state, "iss": self.issuer}),
        )
        self.sessions.set_cookie(response, session)
        return response

    async def has_second_factor(self, subject: str) -> bool:
        """An authenticator app, or a passkey."""
        return await has_second_factor(self.factors, self.passkeys, subject)

    @property
    def _passkeys_available(self) -> bool:
        return self.passkeys is not None and self.passkeys.available

    async def _needs_second_factor(self, auth: AuthorizationRequest, subject: str) -> bool:
        client = auth.client
        if client.require_mfa:
            return True
        if assurance.needs_second_factor(auth.acr_values or client.default_acr_values):
            return True
        user = await self.users.by_subject(subject)
        return user is not None and self.requirement.applies_to(user.roles)

    async def enrolment_page(self, auth: AuthorizationRequest, session: Session) -> web.Response:
        """A user who must have a second factor and has none: setting one up (an
        authenticator app, or a passkey, whichever this server can keep), the request
        carried along to go on once it is done."""
        passkey = None
        if self.passkeys is not None:
            passkey = await self.passkeys.offer_creation(session, auth.carried())
        response = self.pages.render(
            "factors.html",
            title="Set up a second factor",
            enrolled=False,
            recovery_codes_left=0,
            reason=(
                f"{auth.client.client_name} asks for a second factor at sign-in, and your "
                "account has none yet."
            ),
            app_available=self.factors.available,
            action=self.base_path + "/factors/totp",
            csrf_token=Sessions.csrf_token(session),
            carried=auth.carried(),
            passkey=passkey,
        )
        self.sessions.set_cookie(response, session)
        return response

    async def after_enrolment(
        self, request: web.Request, auth: AuthorizationRequest, session: Session
    ) -> web.Response:
        """The request a user led to set up a second factor goes on with, now that a passkey
        was added: the second step, where it is used, after the first step this session
        signed in with. Adding a passkey proves nothing of its own (its attestation is
        `none`: no signature), so an assertion of it is what makes the sign-in two factors."""
        if multi_factor(session.amr):
            return await self.proceed(request, auth, session)
        first = signin.FirstStep(session.amr, session.record.auth_time)
        return await self.code_page(request, auth, session, session.record.subject, first=first)

    async def login_page(
        self,
        request: web.Request,
        auth: AuthorizationRequest,
        *,
        error: str | None = None,
        status: int = 200,
        username: str | None = None,
    ) -> web.Response:
        # A signed-in user asked to sign in again (prompt=login, max_age) keeps the session for
        # the form's CSRF token; the login replaces it.
        session = await self.sessions.ensure(request)
        response = self.pages.render(
            "login.html",
            status=status,
            title="Sign in",
            action=self.base_path + "/login",
            csrf_token=Sessions.csrf_token(session),
            carried=auth.carried(),
            client_name=auth.client.client_name,
            client_host=described_by(auth.client),  # the name is the document's to choose
            error=error,
            username=username or auth.params.get("login_hint"),
            form_targets=[auth.redirect_uri],
            password_form=self.password_sign_in,
            providers=self.sign_in_links(session, auth.carried()) if self.sign_in_links else [],
            passkey=self.passkeys.offer_sign_in(session, auth.carried()) if self.passkeys else None,
        )
        self.sessions.set_cookie(response, session)
        return response

    async def consent_page(self, auth: AuthorizationRequest, session: Session) -> web.Response:
        user = await self.users.by_subject(session.record.subject)
        document = described_by(auth.client)
        response = self.pages.render(
            "consent.html",
            title="Allow access",
            action=self.base_path + "/consent",
            csrf_token=Sessions.csrf_token(session),
            carried=[*auth.carried(), (CONSENT_PROOF, Sessions.proof(session, auth.carried()))],
            client_name=auth.client.client_name,
            client_host=document,
            redirect_host=_shown_host(auth.redirect_uri) if document else None,
            scopes=[{"name": s, "description": self.scope_description(s)} for s in auth.scopes],
            resource=self.audiences.shown(auth.audience),
            user_name=user.display_name if user else session.record.subject,
            warning=LOOPBACK_ONLY if document and loopback_only(auth.client) else None,
            form_targets=[auth.redirect_uri],
        )
        self.sessions.set_cookie(response, session)
        return response

    def _cannot_handle(self, message: str) -> web.Response:
        return self.pages.error(400, "This sign-in request cannot be handled", message)

    def _expired_session(self) -> web.Response:
        return self.pages.error(
            403,
            "Your session expired",
            "Please go back to the application and try again.",
            "csrf",
        )

    # ------------------------------------------------------------------------- handlers

    async def authorize(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                params = await _params(request)
            except OAuthError as exc:
                raise PageError(f"The request is malformed: {exc.description}.") from None
            auth = await self.validate(params)
            session = await self.sessions.current(request)
            # A page that continues this request after a sign-in step of its own (the
            # set-up of a second factor) vouches for it as the consent form does.
            checked = (
                request.method == "POST"
                and session is not None
                and session.logged_in
                and Sessions.proof_valid(session, auth.carried(), params.values.get(CONSENT_PROOF))
            )
            return await self.proceed(request, auth, session, login_done=checked)
        except PageError as exc:
            return self._cannot_handle(exc.message)
        except RedirectError as exc:
            return self.error_redirect(request, exc)

    async def login(self, request: web.Request) -> web.StreamResponse:
        """POST /login: check the password (throttled), start a session, continue the flow."""
        if not self.password_sign_in:
            return signin.password_refused(self.pages)
        try:
            given = await _params(request)
            form = given.values
            auth = await self.validate(given)
            session = await self.sessions.current(request)
            if not Sessions.csrf_valid(session, form.get("csrf_token")):
                return self._expired_session()
            username = form.get("username", "")
            outcome = await self.passwords.check(
                request, username, form.get("password", ""), auth.client.client_id
            )
            if isinstance(outcome, signin.Throttled):
                response = await self.login_page(
                    request, auth, error=signin.THROTTLED, status=429, username=username
                )
                response.headers["Retry-After"] = str(outcome.retry_after)
                return response
            if outcome is None:
                # Not 401: that status promises an HTTP authentication challenge
                # (RFC 9110 §15.5.2), a form is not one.
                return await self.login_page(
                    request, auth, error=signin.WRONG, status=400, username=username
                )
            if await self.has_second_factor(outcome.subject):
                assert session is not None
                return await self.code_page(request, auth, session, outcome.subject)
            new_session = await self.sessions.login(
                request, outcome.subject, methods_of(Method.PASSWORD)
            )
            return await self.proceed(request, auth, new_session, login_done=True)
        except PageError as exc:
            return self._cannot_handle(exc.message)
        except RedirectError as exc:
            return self.error_redirect(request, exc)
        except OAuthError as exc:
            return self._cannot_handle(exc.description)

    async def code_page(
        self,
        request: web.Request,
        auth: AuthorizationRequest,
        session: Session,
        subject: str,
        *,
        until: float | None = None,
        error: str | None = None,
        status: int = 200,
        first: signin.FirstStep = signin.PASSWORD_STEP,
    ) -> web.Response:
        """The second step: the code of the user's app, or one of their passkeys, the first
        step (`first`: the password, or a sign-in at an upstream provider) already passed."""
        expires = self.clock() + signin.PENDING.total_seconds() if until is None else until
        pending = signin.PendingSignIn.fields(session, subject, expires, auth.carried(), first)
        passkey = None
        if self.passkeys is not None:
            fields = [*auth.carried(), *pending]
            passkey = await self.passkeys.offer_second_step(
                session, subject, auth.carried(), fields
            )
        response = self.pages.render(
            "second_step.html",
            status=status,
            title="Enter your code",
            action=self.base_path + "/login/code",
            csrf_token=Sessions.csrf_token(session),
            carried=[*auth.carried(), *pending],
            client_name=auth.client.client_name,
            error=error,
            form_targets=[auth.redirect_uri],
            passkey=passkey,
            app=await self.factors.enrolled(subject),
        )
        self.sessions.set_cookie(response, session)
        return response

    async def login_code(self, request: web.Request) -> web.StreamResponse:
        """POST /login/code: the second step of a pending sign-in (throttled), then the
        session, signed in with both factors, and the flow goes on."""
        try:
            given = await _params(request)
            form = given.values
            auth = await self.validate(given)
            session = await self.sessions.current(request)
            if session is None or not Sessions.csrf_valid(session, form.get("csrf_token")):
                return self._expired_session()
            now = self.clock()
            pending = signin.PendingSignIn.verified(session, form, auth.carried(), now)
            if pending is None:
                # Forged, for another request, expired, or used already (signing in ended
                # the session it was bound to): the password step again.
                return self.pages.error(
                    403,
                    "Please sign in again",
                    "This sign-in has expired. Go back to the application and try again.",
                    "login_expired",
                )
            until = float(form[signin.PENDING_UNTIL])

            def again(error: str, status: int) -> Awaitable[web.Response]:
                return self.code_page(
                    request,
                    auth,
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
            return await self.proceed(request, auth, signed_in, login_done=True)
        except PageError as exc:
            return self._cannot_handle(exc.message)
        except RedirectError as exc:
            return self.error_redirect(request, exc)
        except OAuthError as exc:
            return self._cannot_handle(exc.description)

    async def consent(self, request: web.Request) -> web.StreamResponse:
        """POST /consent: the user's decision, then the code or access_denied."""
        try:
            given = await _params(request)
            form = given.values
            auth = await self.validate(given)
            session = await self.sessions.current(request)
            if (
                session is None
                or not session.logged_in
                or not Sessions.csrf_valid(session, form.get("csrf_token"))
            ):
                return self._expired_session()
            decision = form.get("decision")
            if decision == "deny":
                audit.record(
                    Event.CONSENT_DENIED,
                    audit.USER,
                    client_id=auth.client.client_id,
                    subject=session.record.subject,
                    scope=scope_rules.render(auth.scopes),
                )
                raise RedirectError(
                    auth,
                    auth.redirect_uri,
                    auth.state,
                    OAuthError(ErrorCode.ACCESS_DENIED, "the user denied the request"),
                )
            if decision != "approve":
                return self.pages.error(400, "No decision", "Choose Allow or Deny.")
            # Without the proof (a hand-made form) the login checks run again: this session
            # might never have passed `prompt=login` or `max_age` for this request.
            checked = Sessions.proof_valid(session, auth.carried(), form.get(CONSENT_PROOF))
            if checked:
                await self.store.grant_scopes(
                    session.record.subject,
                    auth.client.client_id,
                    frozenset(auth.scopes),
                    self.clock(),
                )
                audit.record(
                    Event.CONSENT_GIVEN,
                    audit.USER,
                    client_id=auth.client.client_id,
                    subject=session.record.subject,
                    scope=scope_rules.render(auth.scopes),
                )
            return await self.proceed(
                request, auth, session, login_done=checked, consent_given=checked
            )
        except PageError as exc:
            return self._cannot_handle(exc.message)
        except RedirectError as exc:
            return self.error_redirect(request, exc)
        except OAuthError as exc:
            return self._cannot_handle(exc.description)
