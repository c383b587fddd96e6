"""The SSRF guard judges an IPv6 address that carries an IPv4 one by the IPv4 address it
reaches (issue 36, row 12): ``ipaddress`` calls ``64:ff9b::a00:1`` (NAT64 of 10.0.0.1)
and ``2002:a00:1::`` (6to4 of 10.0.0.1) global."""
from __future__ import annotations

import ipaddress

import pytest
from triptych.api.media.decode import MediaError, MediaLimits, load_image
from triptych.api.media.sources import is_public, plan_hop

PRIVATE = [
    "64:ff9b::a00:1",          # NAT64 (RFC 6052) of 10.0.0.1
    "64:ff9b::7f00:1",         # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",      # NAT64 of 169.254.169.254 (cloud metadata)
    "2002:a00:1::",            # 6to4 of 10.0.0.1
    "2002:a9fe:a9fe::1",       # 6to4 of 169.254.169.254
    "::ffff:10.0.0.1",         # IPv4-mapped
    "::10.0.0.1",              # IPv4-compatible (deprecated)
    "64:ff9b:1::808:808",      # local-use NAT64 prefix (RFC 8215): a site's own
    "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo (client 10.0.0.1)
    "::1", "fe80::1", "fc00::1",
]
PUBLIC = ["64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8", "2606:4700::1111"]


@pytest.mark.parametrize("addr", PRIVATE)
def test_embedded_private_ipv4_is_refused(addr):
    assert not is_public(ipaddress.ip_address(addr))
    with pytest.raises(MediaError, match="private or reserved"):
        plan_hop(f"http://[{addr}]:8080/img.png", MediaLimits())


@pytest.mark.parametrize("addr", PUBLIC)
def test_embedded_public_ipv4_still_fetches(addr):
    url, headers, _ = plan_hop(f"http://[{addr}]:8080/img.png", MediaLimits())
    assert ipaddress.ip_address(url.split("[")[1].split("]")[0]) == ipaddress.ip_address(addr)
    assert headers["Host"].startswith("[")


def test_ipaddress_alone_calls_them_global():
    """What the guard corrects: without unwrapping, these pass ``is_global``."""
    assert ipaddress.ip_address("64:ff9b::a00:1").is_global
    assert ipaddress.ip_address("2002:a00:1::").is_global


def test_the_fetch_path_refuses_them_too():
    for addr in ("64:ff9b::7f00:1", "2002:7f00:1::"):
        with pytest.raises(MediaError, match="private or reserved"):
            load_image(f"http://[{addr}]:9/img.png", MediaLimits())
