"""POST /device_authorization (RFC 8628 §3.1, §3.2): a device starts the flow.

1. parse the url-encoded form once; a parameter given twice is invalid_request;
2. authenticate the client as at the token endpoint (public clients by client_id);
3. the client must be registered for the device grant, else unauthorized_client;
4. scope checked as at the authorization endpoint (required, within the client's), and
   `resource` (RFC 8707) names the audience;
5. a device code (high entropy, stored as its digest) and a user code (RFC 8628 §6.1) are
   drawn and stored pending; a user code still in use is drawn again;
6. JSON with Cache-Control: no-store. One `except OAuthError` renders every error.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlencode

from aiohttp import web

from ..clients import ClientAuthenticator
from ..clock import Clock
from ..grants.base import target_for
from ..grants.device_code import GRANT_TYPE
from ..protocol import scopes as scope_rules
from ..protocol import user_codes
from ..protocol.errors import ErrorCode, OAuthError
from ..protocol.lifecycle import Device
from ..protocol.resources import Audiences
from ..store.base import AlreadyExists, DeviceRecord, Store
from ..tokens import digest, random_token
from .errors import json_no_store, oauth_json_error
from .forms import read_form

# A clash needs another live code with the same user code: with 20**8 codes, even a
# hundred thousand pending codes make one draw clash once in 256 000, so three draws in a
# row never fail but through a bug.
USER_CODE_DRAWS = 3


class DeviceAuthorizationEndpoint:
    def __init__(
        self,
        clients: ClientAuthenticator,
        store: Store,
        *,
        audiences: Audiences,
        lifetime: timedelta,
        interval: timedelta,
        verification_uri: str,
        url: str,
        clock: Clock,
    ) -> None:
        self.clients = clients
        self.store = store
        self.audiences = audiences
        self.lifetime = lifetime.total_seconds()
        self.interval = interval.total_seconds()
        self.verification_uri = verification_uri
        self.url = url
        self.clock = clock

    async def handle(self, request: web.Request) -> web.Response:
        try:
            form = await read_form(request)  # 1
            authorization = request.headers.get("Authorization")
            client = await self.clients.authenticate(form, authorization, self.url)  # 2
            if GRANT_TYPE not in client.grant_types:  # 3
                raise OAuthError(
                    ErrorCode.UNAUTHORIZED_CLIENT, "this client may not use the device grant"
                )
            scopes = scope_rules.parse(form.get("scope"))  # 4
            if not scopes:
                raise OAuthError(ErrorCode.INVALID_SCOPE, "scope is required")
            scope_rules.require_allowed(scopes, client.scope)
            audience = target_for(self.audiences, client, form.get("resource"), scopes).audience

            now = self.clock()  # 5
            device_code = random_token()
            for draw in range(USER_CODE_DRAWS):
                user_code = user_codes.generate()
                try:
                    await self.store.save_device(
                        DeviceRecord(
                            device_code_hash=digest(device_code),
                            user_code=user_code,
                            client_id=client.client_id,
                            scope=scope_rules.render(scopes),
                            audience=audience,
                            state=Device.PENDING.value,
                            subject=None,
                            interval=self.interval,
                            last_poll=None,
                            expires_at=now + self.lifetime,
                            created_at=now,
                        )
                    )
                    break
                except AlreadyExists:
                    if draw == USER_CODE_DRAWS - 1:
                        raise
            shown = user_codes.display(user_code)
            return json_no_store(  # 6
                {
                    "device_code": device_code,
                    "user_code": shown,
                    "verification_uri": self.verification_uri,
                    "verification_uri_complete": self.verification_uri
                    + "?"
                    + urlencode({"user_code": shown}),
                    "expires_in": int(self.lifetime),
                    "interval": int(self.interval),
                }
            )
        except OAuthError as error:
            return oauth_json_error(error)
