"""End-to-end fixtures: the authorization server's test fixtures, shared here."""

from tests.authserver.conftest import http, key_root, start_authserver

__all__ = ["http", "key_root", "start_authserver"]
