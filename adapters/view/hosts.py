"""Which `Host` a served view answers (docs/SPEC.md §10): loopback's names, the address it
is bound to and the names the operator allowed, each bare or with the port it listens on.
A page whose own name an attacker rebinds to 127.0.0.1 (DNS rebinding) still sends its own
name as `Host`, so it is answered 421 and reads nothing of the store."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Iterable

from trialledger.core import TrialLedgerError

LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
# a DNS name: dot-separated labels, no empty one (so no trailing dot), no port, no wildcard
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
EXPOSED = ("every job, session and tool output of the store is readable from the network, by "
           "anyone who can reach this port")


class BadAllowedHost(TrialLedgerError, ValueError):
    """An `--allowed-host` that is not a host name or an address."""


def host_form(name: str) -> str | None:
    """`name` as a browser writes it in `Host` (lower case; an IPv6 address compressed, in
    brackets), or None when it is neither a DNS name nor an address."""
    if not name.isascii():  # before lower(): it maps the Kelvin sign (U+212A) onto "k"
        return None
    name = name.lower()
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return name if bare == name and _NAME.fullmatch(name) else None
    if address.version == 6:
        return f"[{address.compressed}]"
    return str(address) if bare == name else None


def is_loopback(address: str) -> bool:
    """Whether a bound address is reachable from this machine only."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class AllowedHosts:
    """The `Host` values a served view answers; none until it knows the port it listens
    on (`listening`), so nothing is answered before then."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.names = set(LOOPBACK)
        for given in allowed:
            form = host_form(given)
            if form is None:
                raise BadAllowedHost(f"--allowed-host {given!r} is not a host name or an "
                                     f"address (give it without a port, scheme or wildcard)")
            self.names.add(form)
        self.accepted: frozenset[str] = frozenset()

    def listening(self, host: str, bound: Iterable[str], ports: Collection[int]) -> None:
        """Answer the names, `host` as given and the addresses bound, bare or with a port
        listened on."""
        names = self.names | {f for f in (host_form(h) for h in (host, *bound)) if f}
        self.accepted = frozenset({*names, *(f"{n}:{p}" for n in names for p in ports)})

    def allows(self, host: str | None) -> bool:
        """Whether a request whose `Host` header is `host` (None: absent) is answered."""
        # ASCII only, as in host_form
        return host is not None and host.isascii() and host.lower() in self.accepted
