"""OAuth and OpenID Connect rules as pure functions and tables: standard library only.

Nothing here does I/O or knows about aiohttp, the store or the configuration format, so
every rule is tested with plain values.
"""
