"""Shared kernel of Portcullis: configuration files, HTTP helpers, the process runtime, and
the client address of a request that came through trusted proxies.

It imports neither the gateway nor the authserver and holds no OAuth logic.
"""
