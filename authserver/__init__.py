"""Portcullis authorization server."""
