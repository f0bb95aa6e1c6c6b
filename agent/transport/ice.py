"""Pin the host addresses ICE gathers; the STUN/TURN servers peers use (`--ice-server`).

aioice gathers every interface's address except 127.0.0.1 and then sends connectivity
checks to all of them. A deployment behind NAT wants to advertise one chosen address,
and tests must keep every packet on loopback, so we replace aioice's address lookup.
It is process-wide by nature (aioice reads a module function); call it once at start-up.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

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


@dataclass(frozen=True)
class IceServer:
    """One STUN or TURN server the agent's peers may use (`--ice-server`)."""

    url: str
    username: str = ""
    credential: str = field(default="", repr=False)


_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")


def parse_ice_server(text: str) -> IceServer:
    """`URL` or `URL,USERNAME,CREDENTIAL`, e.g. `turn:turn.example.com:3478?transport=udp,alice,s3cret`.
    A TURN URL alone is accepted here: its credentials are then minted per call from
    `--turn-secret`, and Config refuses it when no secret is given. Raises ValueError."""
    url, *rest = text.split(",", 2)
    if not url.startswith(_SCHEMES) or len(url) <= len(url.split(":", 1)[0]) + 1:
        raise ValueError(f"ICE server URL must start with one of {', '.join(_SCHEMES)}: {url!r}")
    if rest and len(rest) != 2:
        raise ValueError("give both USERNAME and CREDENTIAL: URL,USERNAME,CREDENTIAL")
    username, credential = rest if rest else ("", "")
    if rest and not (username and credential):
        raise ValueError(f"USERNAME and CREDENTIAL may not be empty: {url},USERNAME,CREDENTIAL")
    return IceServer(url, username, credential)


def rtc_configuration(servers: tuple[IceServer, ...]) -> RTCConfiguration:
    """The peer configuration: exactly these servers. None at all by default, since aiortc's
    own default is a public STUN server that a loopback or LAN agent neither needs nor may reach."""
    return RTCConfiguration(
        iceServers=[
            RTCIceServer(urls=s.url, username=s.username or None, credential=s.credential or None) for s in servers
        ]
    )
