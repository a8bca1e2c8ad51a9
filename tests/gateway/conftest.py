"""Gateway fixtures: the authorization server's, for tests that introspect its tokens."""

from tests.authserver.conftest import http, key_root, start_authserver

__all__ = ["http", "key_root", "start_authserver"]
