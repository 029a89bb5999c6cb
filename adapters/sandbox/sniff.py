"""The host a connection's first bytes name: a TLS ClientHello's SNI or an HTTP/1 request's
`Host` (docs/SPEC.md §15 "Network modes", `allowlist`; read by `egress.py`'s proxy).

Everything here is the agent's and hostile: every length is checked against what was
read, nothing is decoded but ASCII, and whatever does not parse is `unknown` (never an
exception). `sniff` takes the bytes read so far; it answers None while more could decide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Literal

HANDSHAKE = 0x16  # TLS record type
CLIENT_HELLO = 0x01
SERVER_NAME = 0x0000  # extension type (RFC 6066)
HOST_NAME = 0x00  # server_name entry type
RECORD_HEADER = 5
# An HTTP/1 request line: a method token, a target, the version.
REQUEST_LINE = re.compile(rb"\A[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32} [^\x00-\x20\x7f]+ HTTP/1\.[01]\Z")
METHOD_START = re.compile(rb"\A[A-Z]{1,32}(?: |\Z)")  # the start of one, perhaps cut short
LABEL = re.compile(r"\A[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")  # Harbor's host label ($ there)
PORT = re.compile(r"\A[0-9]{1,5}\Z")


@dataclass(frozen=True)
class Sniffed:
    """What a connection's first bytes are, and the host they name (lowercase, no trailing
    dot; None when they name none, or one that is not a valid hostname or address)."""

    protocol: Literal["tls", "http", "unknown"]
    host: str | None = None


UNKNOWN = Sniffed("unknown")


def sniff(data: bytes, *, final: bool = False) -> Sniffed | None:
    """The protocol and host of a connection's first bytes; None while more bytes could
    tell (never with `final`: nothing more will come)."""
    if not data:
        return None if not final else UNKNOWN
    if data[0] == HANDSHAKE:
        return _tls(data, final)
    if METHOD_START.match(data[:33]):
        return _http(data, final)
    return UNKNOWN


def hostname(text: str) -> str | None:
    """`text` as a host name Harbor's allowlist could hold (lowercase, trailing dot
    dropped; labels of letters, digits and hyphens), or an IP address literal; else None."""
    name = text.strip().lower().rstrip(".")
    if "%" in name:  # an IPv6 scope: never a host the allowlist names
        return None
    if _is_address(name):
        return name
    if not 0 < len(name) <= 253 or not all(LABEL.match(label) for label in name.split(".")):
        return None
    return name


def _is_address(text: str) -> bool:
    try:
        ip_address(text)
    except ValueError:
        return False
    return True


class _Cut(Exception):
    """A length points past the bytes read."""


class _Reader:
    """A bounds-checked cursor over bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, count: int) -> bytes:
        if self.at + count > len(self.data):
            raise _Cut
        taken = self.data[self.at:self.at + count]
        self.at += count
        return taken

    def number(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def vector(self, length_size: int) -> _Reader:
        return _Reader(self.take(self.number(length_size)))

    @property
    def left(self) -> int:
        return len(self.data) - self.at


def _tls(data: bytes, final: bool) -> Sniffed | None:
    """A ClientHello, reassembled from the handshake records read so far."""
    if data[1:2] not in (b"", b"\x03"):
        return UNKNOWN  # not TLS's record version
    handshake = bytearray()
    records = _Reader(data)
    while records.left:
        try:
            header = records.take(RECORD_HEADER)
            if header[0] != HANDSHAKE or header[1] != 0x03:
                return Sniffed("tls") if handshake else UNKNOWN
            handshake += records.take(int.from_bytes(header[3:5], "big"))
        except _Cut:
            break
        found = _client_hello(bytes(handshake))
        if found is not None:
            return found
    return Sniffed("tls") if final else None


def _client_hello(handshake: bytes) -> Sniffed | None:
    """The SNI of a whole ClientHello message; None while it is incomplete."""
    if len(handshake) < 4:
        return None
    if handshake[0] != CLIENT_HELLO:
        return Sniffed("tls")
    length = int.from_bytes(handshake[1:4], "big")
    if len(handshake) < 4 + length:
        return None
    try:
        return Sniffed("tls", _server_name(_Reader(handshake[4:4 + length])))
    except _Cut:
        return Sniffed("tls")


def _server_name(hello: _Reader) -> str | None:
    hello.take(2 + 32)  # legacy_version, random
    hello.vector(1)  # legacy_session_id
    hello.vector(2)  # cipher_suites
    hello.vector(1)  # legacy_compression_methods
    if not hello.left:
        return None  # no extensions
    extensions = hello.vector(2)
    names: list[str | None] = []
    while extensions.left:
        kind, body = extensions.number(2), extensions.vector(2)
        if kind == SERVER_NAME:
            names.append(_host_name_entry(body.vector(2)))
    return names[0] if len(names) == 1 else None  # a repeated extension is malformed


def _host_name_entry(entries: _Reader) -> str | None:
    found: list[bytes] = []
    while entries.left:
        kind, name = entries.number(1), entries.vector(2).data
        if kind == HOST_NAME:
            found.append(name)
    if len(found) != 1 or not found[0].isascii():
        return None
    named = hostname(found[0].decode("ascii"))
    return None if named is None or _is_address(named) else named  # SNI is never an IP


def _http(data: bytes, final: bool) -> Sniffed | None:
    """The `Host` of an HTTP/1 request whose head has been read whole."""
    end = data.find(b"\r\n\r\n")
    if end == -1:
        first_line_end = data.find(b"\r\n")
        if first_line_end != -1 and not REQUEST_LINE.match(data[:first_line_end]):
            return UNKNOWN
        return Sniffed("http") if final else None
    lines = data[:end].split(b"\r\n")
    if not REQUEST_LINE.match(lines[0]):
        return UNKNOWN
    hosts: list[bytes] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in b" \t":
            return Sniffed("http")  # malformed, or obsolete line folding: named nothing
        if name.lower() == b"host":
            hosts.append(value.strip(b" \t"))
    if len(hosts) != 1 or not hosts[0].isascii():
        return Sniffed("http")  # none, or more than one (which would the server read?)
    return Sniffed("http", _host_header(hosts[0].decode("ascii")))


def _host_header(value: str) -> str | None:
    """The host of a `Host` value (`name`, `name:port`, `[v6]`, `[v6]:port`)."""
    if value.startswith("["):
        literal, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest[:1] == ":" and PORT.match(rest[1:]))):
            return None
        if ":" not in literal or "%" in literal or not _is_address(literal):
            return None
        return literal.lower()
    name, colon, port = value.partition(":")
    if colon and not PORT.match(port):
        return None
    return hostname(name)
