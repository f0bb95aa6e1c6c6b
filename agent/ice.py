"""Pin the host addresses ICE gathers.

aioice gathers every interface's address except 127.0.0.1 and then sends connectivity
checks to all of them. A deployment behind NAT wants to advertise one chosen address,
and tests must keep every packet on loopback, so we replace aioice's address lookup.
It is process-wide by nature (aioice reads a module function); call it once at start-up.
"""

from __future__ import annotations

import ipaddress

import aioice.ice

_original = aioice.ice.get_host_addresses


def restrict_ice_hosts(hosts: tuple[str, ...] | list[str]) -> None:
    """Make ICE gather exactly these host addresses (empty: aioice's default lookup)."""
    if not hosts:
        aioice.ice.get_host_addresses = _original
        return
    pinned = list(hosts)

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [h for h in pinned if (":" in h and use_ipv6) or (":" not in h and use_ipv4)]

    aioice.ice.get_host_addresses = get_host_addresses


def loopback_only(hosts: tuple[str, ...] | list[str]) -> bool:
    """True when ICE is pinned to loopback addresses alone."""
    return bool(hosts) and all(ipaddress.ip_address(h).is_loopback for h in hosts)


def keep_loopback_candidates(sdp: str) -> str:
    """Drop remote ICE candidates outside loopback from an SDP.

    A server that advertises only loopback can only ever pair with a loopback peer; probing
    the peer's other candidates would send connectivity checks off this host for nothing.
    """
    kept = []
    for line in sdp.splitlines(keepends=True):
        if line.startswith("a=candidate:"):
            parts = line.split()
            # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ ...
            try:
                if len(parts) < 6 or not ipaddress.ip_address(parts[4]).is_loopback:
                    continue
            except ValueError:  # an mDNS name (*.local) or garbage: not loopback
                continue
        kept.append(line)
    return "".join(kept)
