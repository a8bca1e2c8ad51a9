"""The admin API, `{issuer}/admin/v1`: clients, users, grants and keys managed at runtime.

One module per resource (clients.py, users.py, grants.py, keys.py); the conventions every
resource shares are written once: the error body and HTTP semantics (http.py), collections
(collection.py), validation with the configuration file's rules (validation.py), who may
call (access.py), and the routing and audit log (api.py). openapi.py describes it all.
"""
