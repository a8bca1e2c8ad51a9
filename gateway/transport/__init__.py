"""The wire beneath the request path: the HTTP/1.1 client to the upstream and its framing
checks, the aiohttp seams, trace context, client certificates, capacity bounds and the Redis
connection pool."""
