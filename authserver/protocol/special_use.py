"""Special-use IP addresses (RFC 6890 and the IANA special-purpose address registries it
set up), which the server never connects to on behalf of a request: fetching a Client ID
Metadata Document from one of them would let whoever names the URL reach this machine, the
private network it sits in, or a cloud's metadata service (Server-Side Request Forgery,
draft-ietf-oauth-client-id-metadata-document §"SSRF Attacks").

`special_use(address)` names the block an address falls in, or None for an address the
server may connect to. An IPv6 address that carries an IPv4 one (IPv4-mapped, the
deprecated IPv4-compatible form, NAT64, 6to4, Teredo) is special-use whatever it carries:
connecting to it reaches the IPv4 address through a translator, and no client's document
needs to live behind one. Anything Python's `ipaddress` does not count as global is
special-use too, so a block IANA adds later is refused before this table learns its name.

Pure: standard library only.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# (block, what it is), most specific first where blocks nest; RFC 6890 §2.2.2 and §2.2.3,
# with the registries' later entries.
_IPV4 = tuple(
    (ipaddress.IPv4Network(block), name)
    for block, name in (
        ("0.0.0.0/8", "this network (RFC 1122)"),
        ("10.0.0.0/8", "private (RFC 1918)"),
        ("100.64.0.0/10", "shared address space (RFC 6598)"),
        ("127.0.0.0/8", "loopback (RFC 1122)"),
        ("169.254.169.254/32", "cloud instance metadata (link-local)"),
        ("169.254.0.0/16", "link-local (RFC 3927)"),
        ("172.16.0.0/12", "private (RFC 1918)"),
        ("192.0.0.0/24", "IETF protocol assignments (RFC 6890)"),
        ("192.0.2.0/24", "documentation, TEST-NET-1 (RFC 5737)"),
        ("192.31.196.0/24", "AS112 (RFC 7535)"),
        ("192.52.193.0/24", "AMT (RFC 7450)"),
        ("192.88.99.0/24", "6to4 relay anycast (RFC 7526)"),
        ("192.168.0.0/16", "private (RFC 1918)"),
        ("192.175.48.0/24", "AS112 direct delegation (RFC 7534)"),
        ("198.18.0.0/15", "benchmarking (RFC 2544)"),
        ("198.51.100.0/24", "documentation, TEST-NET-2 (RFC 5737)"),
        ("203.0.113.0/24", "documentation, TEST-NET-3 (RFC 5737)"),
        ("224.0.0.0/4", "multicast (RFC 5771)"),
        ("255.255.255.255/32", "limited broadcast (RFC 919)"),
        ("240.0.0.0/4", "reserved (RFC 1112)"),
    )
)
_IPV6 = tuple(
    (ipaddress.IPv6Network(block), name)
    for block, name in (
        ("::/128", "unspecified (RFC 4291)"),
        ("::1/128", "loopback (RFC 4291)"),
        ("::ffff:0:0/96", "IPv4-mapped (RFC 4291)"),
        ("::/96", "IPv4-compatible, deprecated (RFC 4291)"),
        ("64:ff9b::/96", "IPv4/IPv6 translation (RFC 6052)"),
        ("64:ff9b:1::/48", "local-use IPv4/IPv6 translation (RFC 8215)"),
        ("100::/64", "discard-only (RFC 6666)"),
        ("2001::/32", "Teredo (RFC 4380)"),
        ("2001:2::/48", "benchmarking (RFC 5180)"),
        ("2001:db8::/32", "documentation (RFC 3849)"),
        ("2001:10::/28", "ORCHID (RFC 4843)"),
        ("2001:20::/28", "ORCHIDv2 (RFC 7343)"),
        ("2001::/23", "IETF protocol assignments (RFC 2928)"),
        ("2002::/16", "6to4 (RFC 3056)"),
        ("3fff::/20", "documentation (RFC 9637)"),
        ("5f00::/16", "segment routing SIDs (RFC 9602)"),
        ("fc00::/7", "unique local (RFC 4193)"),
        ("fe80::/10", "link-local (RFC 4291)"),
        ("fec0::/10", "site-local, deprecated (RFC 3879)"),
        ("ff00::/8", "multicast (RFC 4291)"),
    )
)


def special_use(address: str | IPAddress) -> str | None:
    """What special-use block `address` is in, or None when the server may connect to it.
    Text that is not an IP address (or an IPv6 address with a zone) is special-use too:
    only a literal address can be checked."""
    try:
        ip = address if not isinstance(address, str) else ipaddress.ip_address(address)
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        return "scoped IPv6 address"
    table = _IPV4 if isinstance(ip, ipaddress.IPv4Address) else _IPV6
    for network, name in table:
        if ip in network:
            mapped = getattr(ip, "ipv4_mapped", None)
            if mapped is not None:
                inner = special_use(mapped)
                return f"{name} of {mapped}" + (f", {inner}" if inner else "")
            return name
    if not ip.is_global:
        return "not globally reachable (IANA special-purpose registry)"
    return None
