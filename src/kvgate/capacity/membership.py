"""Which discovered addresses may join a pool, and how big a budget an endpoint may claim.

A pool's members get real requests with the backend's own API key, and each is scraped by
kvgate: so an address a DNS name resolves to is a destination kvgate will connect to on an
attacker's behalf if the name (or the Service behind it) can be made to point elsewhere. The
loopback interface, link-local addresses (the cloud metadata service at 169.254.169.254) and
anything outside the operator's ranges are refused here. Pure: no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# The refusal reasons (the `reason` label of kvgate_pool_refused_addresses_total).
REASON_UNSPECIFIED = "unspecified"
REASON_MULTICAST = "multicast"
REASON_LOOPBACK = "loopback"
REASON_LINK_LOCAL = "link_local"
REASON_PUBLIC = "public"
REASON_NOT_ALLOWED = "not_allowed"

# Blocks an address of which is admitted only by a range written inside the block itself
# (127.0.0.0/8, 169.254.169.0/24, ...), never by a wider one such as 0.0.0.0/0: those
# destinations are this host and its cloud's control plane, not a pod.
_EXPLICIT_ONLY: tuple[tuple[str, tuple[IpNetwork, ...]], ...] = (
    (
        REASON_LOOPBACK,
        (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")),
    ),
    (
        REASON_LINK_LOCAL,
        (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10")),
    ),
)


def _as_ip(host: str) -> IpAddress:
    """The address an endpoint's host part names; an IPv4-mapped IPv6 address is judged as
    the IPv4 address it carries (::ffff:169.254.169.254 is the metadata service too)."""
    ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """The ranges a pool's discovered members must fall in (`allowed_cidrs`)."""

    allowed: tuple[IpNetwork, ...]

    @classmethod
    def from_cidrs(cls, cidrs: Iterable[str]) -> AddressPolicy:
        return cls(tuple(ipaddress.ip_network(cidr) for cidr in cidrs))

    def refusal(self, host: str) -> str | None:
        """None when `host` (an IP literal) may be a member, else why not (a reason above)."""
        try:
            ip = _as_ip(host)
        except ValueError:
            return REASON_NOT_ALLOWED
        # Never a unicast destination, whatever the ranges say.
        if ip.is_unspecified:
            return REASON_UNSPECIFIED
        if ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
            return REASON_MULTICAST
        for reason, blocks in _EXPLICIT_ONLY:
            block = next((b for b in blocks if ip in b), None)
            if block is not None:
                explicit = any(ip in net and net.subnet_of(block) for net in self.allowed)  # type: ignore[arg-type]
                return None if explicit else reason
        if any(ip in net for net in self.allowed):
            return None
        return REASON_PUBLIC if ip.is_global else REASON_NOT_ALLOWED
