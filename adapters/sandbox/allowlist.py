"""Which hosts an `allowlist` phase may reach (docs/SPEC.md §15 "Network modes"): its
`allowed_hosts`, validated and normalised as Harbor 0.25 does (`models/task/config.py`
`_validate_allowed_host_names`: hostnames, `*.suffix` patterns, IP addresses, CIDR
ranges), and the questions the egress proxy (`egress.py`) asks of them.

One deliberate difference: a label must end where the text ends; Harbor's `$` also lets
one end in a newline (its check accepts "a" + newline + ".com", this one does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from trialledger.adapters.sandbox.sniff import LABEL, hostname
from trialledger.adapters.tasks.config import TaskInvalid

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network

INVALID = ("allowed_hosts entries must be hostnames, IP addresses, or IP CIDR ranges, not "
           "URLs, ports, or paths.")  # Harbor's words, as each message below
# Never connected to for a name unless an IP/CIDR entry holds the address: loopback,
# link-local, unspecified ("this network"), multicast, broadcast, RFC 1918, CGNAT, ULA.
UNROUTED = tuple(ip_network(n) for n in (
    "127.0.0.0/8", "::1/128", "169.254.0.0/16", "fe80::/10", "0.0.0.0/8", "::/128",
    "224.0.0.0/4", "ff00::/8", "255.255.255.255/32", "10.0.0.0/8", "172.16.0.0/12",
    "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))


def _plain(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _normalised(entry: object) -> str:
    """One `allowed_hosts` entry as Harbor 0.25 normalises it (`models/task/config.py`
    `_validate_allowed_host_names`); ValueError with Harbor's message when it refuses it."""
    if not isinstance(entry, str):
        raise ValueError("allowed_hosts entries must be strings.")
    host = entry.strip().lower().rstrip(".")
    if not host:
        raise ValueError("allowed_hosts entries must be non-empty hostnames.")
    if "/" in host or ":" in host:
        try:
            if "%" in host:
                raise ValueError(INVALID)
            if "/" in host:
                return ip_network(host, strict=True).compressed
            if (address := ip_address(host)).version != 6:
                raise ValueError(INVALID)
            return address.compressed
        except ValueError:
            raise ValueError(INVALID) from None
    if "[" in host or "]" in host:
        raise ValueError(INVALID)
    name = host
    if host.startswith("*."):
        name = host[2:]
        if not name:
            raise ValueError("allowed_hosts wildcard entries must include a hostname suffix.")
        if as_address(name) is not None:
            raise ValueError("allowed_hosts wildcard entries must target hostnames, not IP "
                             "address literals.")
    elif "*" in host:
        raise ValueError("allowed_hosts wildcard entries must use a leading '*.' prefix.")
    if not all(LABEL.match(label) for label in name.split(".")):
        raise ValueError("allowed_hosts entries must be IP addresses, IP CIDR ranges, or valid "
                         "hostnames or leading wildcard host patterns containing only letters, "
                         "digits, hyphens, and dots.")
    return host


def as_address(text: str | Address) -> Address | None:
    """`text` as an IP address (an IPv4-mapped IPv6 one as IPv4); None: not an address."""
    if not isinstance(text, str):
        return _plain(text)
    try:
        return _plain(ip_address(text))
    except ValueError:
        return None


@dataclass(frozen=True)
class AllowList:
    """A phase's `allowed_hosts`, normalised as Harbor does: exact hostnames, `*.suffix`
    patterns, and IP addresses and CIDR ranges."""

    entries: tuple[str, ...]  # normalised, in order, each once
    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com" for "*.example.com"
    networks: tuple[Network, ...]  # an address entry is its /32 or /128

    @classmethod
    def parse(cls, entries: Sequence[str], where: str) -> AllowList:
        """Validate and normalise `entries`; `TaskInvalid` (`where` first) names a bad one."""
        if isinstance(entries, str | bytes) or not isinstance(entries, Sequence):
            raise TaskInvalid(f"{where}: allowed_hosts must be an array of strings")
        kept: dict[str, None] = {}
        for entry in entries:
            try:
                kept[_normalised(entry)] = None
            except ValueError as error:
                raise TaskInvalid(f"{where}: allowed_hosts entry {entry!r}: {error}") from None
        names: set[str] = set()
        suffixes: list[str] = []
        networks: list[Network] = []
        for entry in kept:
            if entry.startswith("*."):
                suffixes.append(entry[1:])
            elif (address := as_address(entry)) is not None or "/" in entry:
                networks.append(ip_network(address or entry))
            else:
                names.add(entry)
        return cls(tuple(kept), frozenset(names), tuple(suffixes), tuple(networks))

    def allows_name(self, host: str) -> bool:
        """Whether `host` (a name from SNI or `Host`) equals a hostname entry or ends in the
        `.suffix` of a `*.suffix` one (lowercase, trailing dot dropped). An address literal
        is no name: it is allowed only as an address."""
        name = hostname(host)
        if name is None or as_address(name) is not None:
            return False
        return name in self.names or name.endswith(self.suffixes)

    def allows_address(self, ip: str | Address) -> bool:
        """Whether an IP/CIDR entry holds `ip` (an IPv4-mapped IPv6 address as IPv4)."""
        address = as_address(ip)
        return address is not None and any(
            address in network for network in self.networks if network.version ==
            address.version)

    def may_connect(self, ip: str | Address) -> bool:
        """Whether the proxy may connect to `ip` for an allowed name: a `routable` address,
        or one an IP/CIDR entry holds."""
        address = as_address(ip)
        return address is not None and (routable(address) or self.allows_address(address))


def routable(ip: str | Address) -> bool:
    """Whether `ip` may be routed beyond this machine and its networks: not loopback,
    link-local, unspecified, multicast, private, CGNAT, ULA, nor reserved (`240.0.0.0/4`;
    for IPv6, outside the unicast and ULA blocks). Documentation ranges pass: a test
    network's resolver may hand them out as public addresses."""
    address = as_address(ip)
    if address is None or address.is_multicast or address.is_reserved:
        return False
    return not any(address in network for network in UNROUTED
                   if network.version == address.version)
