"""An example web application that signs people in with OpenID Connect and calls the orders
API through the gateway with their access token.

It is a confidential client (client_secret_basic) using the authorization code flow with
PKCE, written with no OAuth library so that every step can be read: `oidc.py` holds the
protocol, `sessions.py` the server-side sessions, `app.py` the pages. Run it with
`python -m examples.web_client --help`.
"""

from .app import Config, create_app

__all__ = ["Config", "create_app"]
