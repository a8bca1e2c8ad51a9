"""Shared kernel of Portcullis: configuration files, HTTP helpers, the process runtime, the
client address of a request that came through trusted proxies, and pure standards code both
services apply (jose: the one spelling of an ECDSA signature).

It imports neither the gateway nor the authserver and holds no OAuth policy.
"""
