"""Portcullis gateway: a reverse proxy that checks bearer tokens before the upstream sees them."""
