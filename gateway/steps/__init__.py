"""The request path: `pipeline.Pipeline.admit` and the steps it runs in order (CORS, the
well-known documents, credentials, verification, revocation, DPoP replay, route rules, MCP
calls, rate limits), with refusals as values and their one rendering (`errors`)."""
