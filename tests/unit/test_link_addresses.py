"""The address classes image links are judged by (server/providers/link_addresses.py): where a link an upstream
answered with may lead, whatever spelling or IPv6 wrapping the address comes in."""

from __future__ import annotations

import pytest

from server.providers.link_addresses import address_class, allowed_classes

CLASSES = {
    "public": ["8.8.8.8", "93.184.215.14", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808",
               "2002:808:808::1"],
    "private": ["10.0.0.1", "172.16.0.1", "172.31.255.255", "192.168.1.10", "100.64.0.1", "fd00::1", "fc00::5",
                "::ffff:10.1.2.3", "64:ff9b::a01:203"],
    "loopback": ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1"],
    "link-local": ["169.254.169.254", "169.254.0.1", "fe80::1", "fe80::1%2", "::ffff:169.254.169.254",
                   "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1"],
    "unspecified": ["0.0.0.0", "::", "0.1.2.3", "::ffff:0.0.0.0"],
    "multicast": ["224.0.0.1", "239.255.255.250", "ff02::1", "::ffff:224.0.0.1"],
    "reserved": ["240.0.0.1", "255.255.255.255", "::7f00:1", "fec0::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2"],
}


@pytest.mark.parametrize(("address", "expected"), [(a, c) for c, addresses in CLASSES.items() for a in addresses])
def test_each_address_is_judged_by_where_it_leads(address, expected):
    assert address_class(address) == expected


@pytest.mark.parametrize(("base", "allowed"), [
    ({"public"}, {"public"}),
    ({"loopback"}, {"public", "loopback"}),
    ({"private"}, {"public", "private"}),
    ({"loopback", "private"}, {"public", "loopback", "private"}),
    ({"link-local"}, {"public"}),  # an upstream on a metadata-like address does not open that class to its links
    (set(), {"public"}),  # a base URL whose host did not resolve
])
def test_a_link_may_lead_to_public_addresses_and_to_its_upstreams_own_class(base, allowed):
    assert allowed_classes(frozenset(base)) == allowed
