"""Which addresses an image link an upstream answered with may be fetched from (docs/api.md, Images).

The upstream's answer chooses the link, so whoever controls that answer (a third-party provider, a compromised
upstream) would otherwise choose where the gateway connects: the cloud metadata service, the gateway's own metrics
or Envoy's admin port, anything on the gateway's network, learning from each 502 whether it answered. A link is
fetched only from a public address, or from an address of the class the upstream's own `base_url` host is in
(loopback, or private): a vLLM on 127.0.0.1 may link its images on 127.0.0.1, a provider on the internet may not
link into the gateway's network. Link-local (cloud metadata), unspecified, multicast and reserved addresses never.
The check is on the addresses a link's host resolves to, made before any connection (server/providers/http_client.py
Pool), so names resolving inward and odd spellings of an address (2130706433, 0x7f.1) are judged by where they lead.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

PUBLIC, PRIVATE, LOOPBACK = "public", "private", "loopback"
# The classes a link may lead to when the base URL's host is in them (public ones always may).
SAME_CLASS = frozenset({PRIVATE, LOOPBACK})

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def address_class(address: str) -> str:
    """"public", "private", "loopback", or the class of an address never fetched from ("link-local",
    "unspecified", "multicast", "reserved"). IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4) are judged
    by it. Python's is_global is not trusted alone: before 3.12.4 it calls NAT64 and IPv4-compatible forms global."""
    ip = ipaddress.ip_address(address.partition("%")[0])  # a link-local IPv6 address's scope (fe80::1%eth0)
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
        elif ip.teredo is not None or ip.is_site_local:
            return "reserved"
    if ip.is_unspecified or ip in _THIS_NETWORK:
        return "unspecified"
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_reserved:  # 240.0.0.0/4 and the broadcast address; IPv6's ::/8 (IPv4-compatible) and the like
        return "reserved"
    return PUBLIC if ip.is_global else PRIVATE


def allowed_classes(base_classes: frozenset[str]) -> frozenset[str]:
    """The classes of address a link may lead to, for an upstream whose base URL's host resolves to `base_classes`."""
    return frozenset({PUBLIC}) | (base_classes & SAME_CLASS)


async def link_classes(host: str, port: int, timeout: float | None) -> frozenset[str] | None:
    """The classes links of an upstream whose base URL is on `host` may lead to; None when the host does not resolve
    here (a name only a proxy resolves): public links only, for now."""
    try:
        async with asyncio.timeout(timeout):
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError, TimeoutError):
        return None
    return allowed_classes(frozenset(address_class(info[4][0]) for info in infos))
