"""The gateway's vocabulary and pure decisions: the resolved records, the clock, principals,
bearer credentials, route rules, scope policy, DPoP proof checks and the exchange record.
Nothing here reaches aiohttp or a socket, so all of it is tested without a server."""
