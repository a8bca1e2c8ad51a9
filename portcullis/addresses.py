"""Who the client is, as an address: the socket peer, or what trusted proxies say it was.

`X-Forwarded-For` is written by whoever sends the request, so it is believed only as far as
the proxies that appended to it are trusted: walking the list from the right (the hop
nearest to us), each address is the client of the hop after it, and the first one that is
not a trusted proxy is the client. With no trusted proxies the header is never read.

Shared by the gateway (rate-limit keys, access log) and the authorization server (its
throttles on guessing), with the configuration values both read: a listener's `host:port`
and `trusted_proxies` entries. Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from . import yamlconf
from .sections import accepts

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_MEMO_LIMIT = 4096  # peers remembered as trusted or not; the set of proxies is small


class ClientAddresses:
    def __init__(self, trusted_proxies: Sequence[IPNetwork]) -> None:
        self._trusted = tuple(trusted_proxies)
        self._verdicts: dict[str, bool] = {}

    @property
    def uses_forwarded_for(self) -> bool:
        return bool(self._trusted)

    def is_trusted(self, address: str) -> bool:
        verdict = self._verdicts.get(address)
        if verdict is None:
            try:
                ip = ipaddress.ip_address(address.strip())
            except ValueError:
                verdict = False
            else:
                verdict = any(ip in network for network in self._trusted)
            if len(self._verdicts) < _MEMO_LIMIT:
                self._verdicts[address] = verdict
        return verdict

    def client(self, peer: str | None, forwarded_for: Sequence[str]) -> str:
        """The client's address for a request from `peer` with these X-Forwarded-For values."""
        current = peer or "unknown"
        if not self._trusted or not forwarded_for or not self.is_trusted(current):
            return current
        hops = [hop.strip() for value in forwarded_for for hop in value.split(",")]
        for hop in reversed(hops):
            if not _is_ip(hop):
                # Not an address a proxy would write: the client made it up, and the last
                # trusted hop's view of its peer is all that can be believed.
                return current
            current = hop
            if not self.is_trusted(hop):
                return hop
        return current


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@accepts({"type": "string", "title": "address or network"})
def network(value: Any) -> IPNetwork:
    """A `trusted_proxies` entry of a configuration file: an address or a CIDR network."""
    text = yamlconf.non_empty_string(value)
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address or network (10.0.0.0/8)") from None


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a name or an address, as in a URL) is this machine."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Address:
    """Where a listener listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@accepts({"type": "string", "title": "host:port", "pattern": ":[0-9]+$"})
def address(value: Any) -> Address:
    """A listener's `host:port` in a configuration file (`[::1]:8443` for IPv6)."""
    text = yamlconf.string(value)
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ValueError(f"{text!r} has no host (use 0.0.0.0:{port} for every interface)")
    return Address(host, int(port))


def split_url(value: Any) -> tuple[str, SplitResult]:
    """A configured URL as written and split, for a parser to check its parts."""
    text = yamlconf.non_empty_string(value)
    return text, urlsplit(text)
