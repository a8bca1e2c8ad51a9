"""An orders API that knows nothing of OAuth: the upstream the demo gateway protects.

It believes whatever identity headers it receives (X-Auth-Subject and friends), exactly
like many internal services do; the gateway in front is what makes that belief safe.
Run it with `python -m examples.legacy_api --port 8081`.
"""

from .app import create_app

__all__ = ["create_app"]
