"""Shared kernel of Portcullis: configuration files, HTTP helpers, the process runtime, the
client address of a request that came through trusted proxies, and the pure standards code
both services apply: jose (base64url, compact JWS, signature checks, RFC 7638 thumbprints,
the one spelling of an ECDSA signature) and dpop (RFC 9449 proof checks, `htu`, `ath`,
nonces).

It imports neither the gateway nor the authserver and holds no OAuth policy.
"""
