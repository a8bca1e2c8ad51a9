"""Token verifiers: turn a bearer token into a Principal or refuse it."""
