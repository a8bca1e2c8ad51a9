"""The OpenAPI 3.1 document of the admin API (`GET /admin/v1/openapi.json`): every path,
parameter and body, from the same field lists the resources use."""

from __future__ import annotations

from typing import Any

from . import clients, grants, keys, users
from .collection import DEFAULT_LIMIT, MAX_LIMIT, Collection

_STR = {"type": "string"}
_STRS = {"type": "array", "items": _STR}
_BOOL = {"type": "boolean"}
_DATE = {"type": "string", "format": "date-time"}
_NULL_STR = {"type": ["string", "null"]}
_NULL_DATE = {"type": ["string", "null"], "format": "date-time"}
_MANAGED = {"type": "string", "enum": ["config", "api"]}
# A client may also have registered itself (RFC 7591) or be described by its metadata
# document (its client_id is the document's URL).
_CLIENT_MANAGED = {"type": "string", "enum": ["config", "api", "dynamic", "metadata_document"]}
_ALG = {"type": ["string", "null"], "enum": ["ES256", "RS256", "EdDSA", None]}

_CLIENT_WRITABLE: dict[str, Any] = {
    "clientName": _STR,
    "redirectUris": _STRS,
    "postLogoutRedirectUris": _STRS,
    "grantTypes": {
        "type": "array",
        "items": {
            "enum": [
                "authorization_code",
                "client_credentials",
                "refresh_token",
                "urn:ietf:params:oauth:grant-type:device_code",
            ]
        },
    },
    "tokenEndpointAuthMethod": {
        "enum": ["client_secret_basic", "client_secret_post", "private_key_jwt", "none"]
    },
    "scope": {"type": "string", "description": "space-separated"},
    "resources": _STRS,
    "jwks": {"type": ["object", "null"], "description": "a public JWK Set"},
    "requirePkce": _BOOL,
    "skipConsent": _BOOL,
    "idTokenSignedResponseAlg": _ALG,
    "introspection": _BOOL,
    "dpopBoundAccessTokens": _BOOL,
    "applicationType": {"enum": ["web", "native"]},
    "requireMfa": _BOOL,
    "defaultAcrValues": {
        "type": "array",
        "items": {"enum": ["urn:portcullis:acr:pwd", "urn:portcullis:acr:mfa"]},
    },
}
_USER_WRITABLE: dict[str, Any] = {
    "username": _STR,
    **{
        name: (
            {"type": ["boolean", "null"]}
            if name.endswith("Verified")
            else {"type": ["object", "null"], "additionalProperties": _STR}
            if name == "address"
            else _NULL_STR
        )
        for name in users.CLAIMS
    },
    "roles": _STRS,
    "disabled": _BOOL,
}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = list(required)
    return schema


SCHEMAS: dict[str, Any] = {
    "Error": _object(
        {
            "error": _object(
                {
                    "code": _STR,
                    "message": _STR,
                    "details": {
                        "type": "array",
                        "items": _object({"field": _STR, "issue": _STR}, ("field", "issue")),
                    },
                },
                ("code", "message", "details"),
            )
        },
        ("error",),
    ),
    "Pagination": _object({"nextCursor": _NULL_STR, "hasMore": _BOOL}, ("nextCursor", "hasMore")),
    "Client": _object(
        {
            "clientId": _STR,
            **_CLIENT_WRITABLE,
            "managedBy": _CLIENT_MANAGED,
            "blocked": {
                "type": "boolean",
                "description": "refused wherever it is named; settable on metadata_document"
                " clients only",
            },
            "createdAt": _DATE,
            "updatedAt": _DATE,
            "clientSecret": {
                "type": "string",
                "description": "only when generated: at creation, rotation, or when the"
                " client became confidential",
            },
        },
        ("clientId", "managedBy", "createdAt", "updatedAt"),
    ),
    "ClientInput": _object({"clientId": _STR, **_CLIENT_WRITABLE, "blocked": _BOOL}),
    "User": _object(
        {
            "id": _STR,
            **_USER_WRITABLE,
            "managedBy": _MANAGED,
            "createdAt": _DATE,
            "updatedAt": _DATE,
        },
        ("id", "username", "roles", "disabled", "managedBy", "createdAt", "updatedAt"),
    ),
    "UserInput": _object(
        {"id": _STR, **_USER_WRITABLE, "password": {"type": "string", "writeOnly": True}},
        ("username", "password"),
    ),
    "UserUpdate": _object(
        {"id": _STR, **_USER_WRITABLE, "password": {"type": "string", "writeOnly": True}}
    ),
    "Password": _object({"password": {"type": "string", "minLength": 8}}, ("password",)),
    "SecondFactor": _object(
        {
            "kind": {"enum": ["totp"]},
            "createdAt": {"type": "string", "format": "date-time"},
            "recoveryCodesLeft": {"type": "integer", "minimum": 0},
        },
        ("kind", "createdAt", "recoveryCodesLeft"),
    ),
    "Passkey": _object(
        {
            "id": {**_STR, "description": "the credential id, base64url"},
            "name": {**_STR, "description": "the name the user gave it"},
            "createdAt": _DATE,
            "lastUsedAt": {"type": ["string", "null"], "format": "date-time"},
            "backupEligible": {
                "type": "boolean",
                "description": "may be synced to other devices (amr swk; else hwk)",
            },
            "transports": _STRS,
        },
        ("id", "name", "createdAt", "lastUsedAt", "backupEligible", "transports"),
    ),
    "Identity": _object(
        {
            "id": _STR,
            "issuer": {**_STR, "description": "the upstream provider's issuer identifier"},
            "subject": {**_STR, "description": "the user's `sub` at that provider"},
            "linkedAt": _DATE,
        },
        ("id", "issuer", "subject", "linkedAt"),
    ),
    "Grant": _object(
        {
            "id": _STR,
            "clientId": _STR,
            "subject": _STR,
            "scopes": _STRS,
            "refreshFamily": _NULL_STR,
            "createdAt": _DATE,
            "lastUsedAt": _DATE,
            "expiresAt": _DATE,
            "revokedAt": _NULL_DATE,
        }
    ),
    "Key": _object(
        {
            "kid": _STR,
            "alg": _STR,
            "state": {"enum": ["next", "active", "retired"]},
            "createdAt": _DATE,
            "activateAt": _DATE,
            "retiredAt": _NULL_DATE,
            "removeAfter": _NULL_DATE,
        }
    ),
    "KeyInput": _object({"alg": {"enum": ["ES256", "RS256", "EdDSA"]}}),
}


def _patch_of(name: str) -> dict[str, Any]:
    """An RFC 7396 merge patch of `name`: any of its members, each also null (removed)."""
    schema = SCHEMAS[name]
    return {
        "type": "object",
        "properties": {
            key: {"anyOf": [value, {"type": "null"}]} for key, value in schema["properties"].items()
        },
        "additionalProperties": False,
    }


SCHEMAS["ClientPatch"] = _patch_of("ClientInput")
SCHEMAS["UserPatch"] = _patch_of("UserUpdate")


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], media: str = "application/json") -> dict[str, Any]:
    return {"content": {media: {"schema": schema}}}


_ERRORS = {
    status: {"description": text, **_json(_ref("Error"))}
    for status, text in {
        "400": "malformed request (bad JSON)",
        "401": "no token, or one that is invalid, expired, revoked or for another API",
        "403": "insufficient_scope, or forbidden: a user without the admin role",
        "404": "no such resource",
        "406": "Accept rules out JSON",
        "409": "a duplicate, managed_by_config, managed_by_registration or"
        " managed_by_metadata_document",
        "412": "If-Match names another version",
        "415": "a body of another media type",
        "422": "validation_error, one detail per problem",
        "503": "the store or the hashing pool cannot serve now",
    }.items()
}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: _ERRORS[s] for s in ("401", "403", "406", "503", *statuses)}


def _list_parameters(c: Collection) -> list[dict[str, Any]]:
    return [
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "default": DEFAULT_LIMIT},
            "description": f"items per page; above {MAX_LIMIT} is taken as {MAX_LIMIT}",
        },
        {
            "name": "cursor",
            "in": "query",
            "schema": _STR,
            "description": "nextCursor of the page before",
        },
        {
            "name": "sort",
            "in": "query",
            "schema": _STR,
            "description": "comma-separated; -field for descending: "
            + ", ".join(sorted(c.sortable)),
        },
        {"name": "fields", "in": "query", "schema": _STR, "description": ", ".join(c.fields)},
        {
            "name": "q",
            "in": "query",
            "schema": _STR,
            "description": "searches " + ", ".join(c.search),
        },
        *(
            {
                "name": name,
                "in": "query",
                "schema": {"type": "array", "items": _STR},
                "style": "form",
                "explode": True,
                "description": "repeat for OR",
            }
            for name in sorted(c.filters)
        ),
    ]


def _collection(item: str, c: Collection, create: str | None) -> dict[str, Any]:
    path: dict[str, Any] = {
        "get": {
            "summary": f"list {item}s",
            "parameters": _list_parameters(c),
            "responses": {
                "200": {
                    "description": "a page",
                    **_json(
                        _object(
                            {
                                "data": {"type": "array", "items": _ref(item)},
                                "pagination": _ref("Pagination"),
                            },
                            ("data", "pagination"),
                        )
                    ),
                },
                **_errors("422"),
            },
        }
    }
    if create is not None:
        path["post"] = {
            "summary": f"create a {item.lower()}",
            "requestBody": {"required": True, **_json(_ref(create))},
            "responses": {
                "201": {
                    "description": "created; Location names it",
                    "headers": {"Location": {"schema": _STR}, "ETag": {"schema": _STR}},
                    **_json(_ref(item)),
                },
                **_errors("400", "409", "415", "422"),
            },
        }
    return path


_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
_IF_MATCH = {"name": "If-Match", "in": "header", "schema": _STR}


def _item(
    item: str, replace: str | None, changes: bool, patch: str | None = None
) -> dict[str, Any]:
    ok = {"description": "the resource", "headers": {"ETag": {"schema": _STR}}, **_json(_ref(item))}
    path: dict[str, Any] = {
        "parameters": [_ID],
        "get": {
            "summary": f"read a {item.lower()}",
            "parameters": [{"name": "If-None-Match", "in": "header", "schema": _STR}],
            "responses": {"200": ok, "304": {"description": "not modified"}, **_errors("404")},
        },
    }
    if replace is not None:
        assert patch is not None, "a resource that is replaced is patched too"
        path["put"] = {
            "summary": f"replace a {item.lower()}",
            "parameters": [_IF_MATCH],
            "requestBody": {"required": True, **_json(_ref(replace))},
            "responses": {"200": ok, **_errors("400", "404", "409", "412", "415", "422")},
        }
        path["patch"] = {
            "summary": f"change a {item.lower()} (RFC 7396 merge patch)",
            "parameters": [_IF_MATCH],
            "requestBody": {
                "required": True,
                **_json(_ref(patch), "application/merge-patch+json"),
            },
            "responses": {"200": ok, **_errors("400", "404", "409", "412", "415", "422")},
        }
    if changes:
        path["delete"] = {
            "summary": f"delete a {item.lower()}",
            "parameters": [_IF_MATCH],
            "responses": {"204": {"description": "done"}, **_errors("404", "409", "412")},
        }
    return path


def _identities() -> dict[str, Any]:
    """The identities at upstream providers a user signs in with: read-only."""
    path = {"parameters": [_ID], **_collection("Identity", users.IDENTITIES, None)}
    path["get"]["summary"] = "list the user's identities at upstream OpenID Connect providers"
    path["get"]["responses"].update(_errors("404"))
    return path


def _passkeys() -> dict[str, Any]:
    """A user's passkeys: listed, never their keys; removed one by one."""
    path = {"parameters": [_ID], **_collection("Passkey", users.PASSKEYS, None)}
    path["get"]["summary"] = "list the user's passkeys (never their keys)"
    path["get"]["responses"].update(_errors("404"))
    return path


def document(base_url: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Portcullis admin API",
            "version": "1",
            "description": "Clients, users, grants and signing keys of the authorization"
            " server. Access tokens of this server with aud " + base_url + " and scope"
            " admin:read (safe methods) or admin:write.",
        },
        "servers": [{"url": base_url}],
        "security": [{"bearer": []}],
        "paths": {
            "/clients": _collection("Client", clients.COLLECTION, "ClientInput"),
            "/clients/{id}": _item("Client", "ClientInput", True, "ClientPatch"),
            "/clients/{id}/secret": {
                "parameters": [_ID],
                "post": {
                    "summary": "replace the client's secret; the new one is shown once",
                    "parameters": [_IF_MATCH],
                    "responses": {
                        "200": {
                            "description": "the client and clientSecret",
                            **_json(_ref("Client")),
                        },
                        **_errors("404", "409", "412"),
                    },
                },
            },
            "/users": _collection("User", users.COLLECTION, "UserInput"),
            "/users/{id}": _item("User", "UserUpdate", True, "UserPatch"),
            "/users/{id}/password": {
                "parameters": [_ID],
                "post": {
                    "summary": "set the user's password",
                    "parameters": [_IF_MATCH],
                    "requestBody": {"required": True, **_json(_ref("Password"))},
                    "responses": {
                        "204": {"description": "set"},
                        **_errors("400", "404", "409", "412", "415", "422"),
                    },
                },
            },
            "/users/{id}/second-factor": {
                "parameters": [_ID],
                "get": {
                    "summary": "the user's authenticator app (never its secret)",
                    "responses": {
                        "200": {"description": "the factor", **_json(_ref("SecondFactor"))},
                        **_errors("404"),
                    },
                },
                "delete": {
                    "summary": "remove the user's authenticator app and recovery codes",
                    "responses": {"204": {"description": "removed"}, **_errors("404")},
                },
            },
            "/users/{id}/identities": _identities(),
            "/users/{id}/passkeys": _passkeys(),
            "/users/{id}/passkeys/{passkeyId}": {
                "parameters": [
                    _ID,
                    {"name": "passkeyId", "in": "path", "required": True, "schema": _STR},
                ],
                "delete": {
                    "summary": "remove one of the user's passkeys",
                    "responses": {"204": {"description": "removed"}, **_errors("404")},
                },
            },
            "/grants": _collection("Grant", grants.COLLECTION, None),
            "/grants/{id}": _item("Grant", None, True),
            "/keys": _collection("Key", keys.COLLECTION, "KeyInput"),
            "/keys/{id}": _item("Key", None, False),
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
