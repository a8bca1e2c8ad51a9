"""An example single-page app: a public OAuth client that lives in the browser.

The page (static/app.js, plain JavaScript, no build step) signs the user in with the
authorization code flow and PKCE, keeps its tokens in memory only, and calls across origins
(CORS) both the authorization server's token endpoint and the orders API through the
gateway. `app.py` is the small server that hands out the page and its settings. Run it
with `python -m examples.spa --help`.
"""

from .app import Config, create_app

__all__ = ["Config", "create_app"]
