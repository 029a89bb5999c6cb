"""SPEC §15 "Network modes", `allowlist`: Harbor's `allowed_hosts` forms, as
`adapters/sandbox/allowlist.py` validates and matches them, and what a connection's first
bytes name (`adapters/sandbox/sniff.py`), hostile bytes included."""

from __future__ import annotations

import random
import ssl
from contextlib import suppress
from typing import Any

import pytest

from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.sniff import Sniffed, sniff
from trialledger.adapters.tasks.config import TaskInvalid

# --- allowed_hosts, as Harbor 0.25 validates and normalises them ------------------------

ACCEPTED = [  # (as written, as normalised)
    ("example.com", "example.com"),
    ("  API.Example.COM.  ", "api.example.com"),
    ("*.Example.com", "*.example.com"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("a-b.c1", "a-b.c1"),
    ("192.0.2.1", "192.0.2.1"),
    ("2001:DB8:0:0::1", "2001:db8::1"),
    ("::ffff:192.0.2.1", "::ffff:c000:201"),
    ("10.0.0.0/8", "10.0.0.0/8"),
    ("2001:DB8::/32", "2001:db8::/32"),
    ("192.0.2.7/32", "192.0.2.7/32"),
    ("1.2.3", "1.2.3"),  # not an address Python reads: a hostname, as in Harbor
]
REFUSED = [  # (as written, what the message says)
    ("", "must be non-empty hostnames"),
    ("  . ", "must be non-empty hostnames"),
    ("https://example.com", "not URLs, ports, or paths"),
    ("example.com/path", "not URLs, ports, or paths"),
    ("example.com:443", "not URLs, ports, or paths"),
    ("192.0.2.1:80", "not URLs, ports, or paths"),
    ("[2001:db8::1]", "not URLs, ports, or paths"),
    ("[example.com]", "not URLs, ports, or paths"),
    ("fe80::1%eth0", "not URLs, ports, or paths"),
    ("10.0.0.1/8", "not URLs, ports, or paths"),  # host bits set (strict)
    ("10.0.0.0/33", "not URLs, ports, or paths"),
    ("*.", "must use a leading '*.' prefix"),  # "*." is "*" once the dot is dropped
    ("*.192.0.2.1", "not IP address literals"),
    ("*example.com", "must use a leading '*.' prefix"),
    ("api.*.example.com", "must use a leading '*.' prefix"),
    ("**.example.com", "must use a leading '*.' prefix"),
    ("-bad.example.com", "only letters, digits, hyphens, and dots"),
    ("bad-.example.com", "only letters, digits, hyphens, and dots"),
    ("under_score.example", "only letters, digits, hyphens, and dots"),
    ("a..b", "only letters, digits, hyphens, and dots"),
    ("bücher.example", "only letters, digits, hyphens, and dots"),
    ("a" * 64 + ".example", "only letters, digits, hyphens, and dots"),
    ("ok.example\n.evil", "only letters, digits, hyphens, and dots"),
]


@pytest.mark.parametrize(("written", "normalised"), ACCEPTED)
def test_harbors_accepted_forms_are_normalised_as_harbor_does(written: str,
                                                               normalised: str) -> None:
    assert AllowList.parse([written], "task").entries == (normalised,)


@pytest.mark.parametrize(("written", "says"), REFUSED)
def test_harbors_refused_forms_are_task_invalid_naming_the_entry(written: str,
                                                                 says: str) -> None:
    with pytest.raises(TaskInvalid) as caught:
        AllowList.parse(["example.org", written], "tasks/t: [agent]")
    message = str(caught.value)
    assert message.startswith(f"tasks/t: [agent]: allowed_hosts entry {written!r}: ")
    assert says in message and "\n" not in message.replace(repr(written), "")


@pytest.mark.parametrize("entries", ["example.com", [1], [None], {"a": 1}])
def test_allowed_hosts_must_be_an_array_of_strings(entries: Any) -> None:
    with pytest.raises(TaskInvalid, match=r"^task: allowed_hosts"):
        AllowList.parse(entries, "task")


def test_entries_are_kept_once_in_order() -> None:
    allow = AllowList.parse(["B.example", "a.example", "b.example."], "task")
    assert allow.entries == ("b.example", "a.example")


NAMES = AllowList.parse(["api.example.com", "*.cdn.example.net", "192.0.2.1",
                         "198.51.100.0/24", "2001:db8::/32", "1.2.3"], "task")


@pytest.mark.parametrize(("host", "allowed"), [
    ("api.example.com", True),
    ("API.Example.COM.", True),
    ("www.example.com", False),
    ("example.com", False),
    ("evil-api.example.com", False),
    ("api.example.com.evil", False),
    ("img.cdn.example.net", True),
    ("a.b.cdn.example.net", True),
    ("cdn.example.net", False),  # *.suffix is a proper suffix, as in Harbor
    ("xcdn.example.net", False),
    ("192.0.2.1", False),  # an address literal is no name: allowed only as an address
    ("198.51.100.7", False),
    ("1.2.3", True),  # a hostname entry that looks numeric stays a name
    ("", False),
    ("api.example.com\x00.evil", False),
    ("api.example.com\n", True),  # surrounding whitespace is stripped, as the entries'
    ("img.cdn.example.net\n.x", False),
])
def test_names_match_hostnames_and_wildcard_suffixes(host: str, allowed: bool) -> None:
    assert NAMES.allows_name(host) is allowed


@pytest.mark.parametrize(("ip", "allowed"), [
    ("192.0.2.1", True),
    ("192.0.2.2", False),
    ("198.51.100.255", True),
    ("::ffff:198.51.100.9", True),  # IPv4-mapped IPv6, normalised first
    ("::ffff:192.0.2.2", False),
    ("2001:db8:1::5", True),
    ("2001:db9::5", False),
    ("1.2.3", False),  # not an address
    ("not an address", False),
])
def test_addresses_match_ip_and_cidr_entries(ip: str, allowed: bool) -> None:
    assert NAMES.allows_address(ip) is allowed


@pytest.mark.parametrize(("ip", "allowed"), [
    ("93.184.215.14", True),
    ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True),
    ("127.0.0.1", False), ("127.8.9.10", False), ("::1", False),
    ("::ffff:127.0.0.1", False),
    ("169.254.169.254", False), ("fe80::1", False),
    ("0.0.0.0", False), ("::", False),
    ("224.0.0.251", False), ("ff02::1", False), ("255.255.255.255", False),
    ("10.1.2.3", False), ("172.16.0.1", False), ("172.31.255.255", False),
    ("172.32.0.1", True), ("192.168.1.1", False),
    ("100.64.0.1", False), ("100.127.255.255", False), ("100.128.0.1", True),
    ("fc00::1", False), ("fd12:3456::1", False),
])
def test_a_name_never_leads_to_a_local_or_private_address(ip: str, allowed: bool) -> None:
    assert AllowList.parse(["example.com"], "task").may_connect(ip) is allowed


def test_an_ip_or_cidr_entry_opens_a_private_address_to_names_too() -> None:
    allow = AllowList.parse(["example.com", "10.9.0.0/16", "127.0.0.1"], "task")
    assert allow.may_connect("10.9.8.7") and allow.may_connect("127.0.0.1")
    assert not allow.may_connect("10.8.0.1") and not allow.may_connect("127.0.0.2")


# --- what the first bytes name --------------------------------------------------------


def client_hello(sni: str | None) -> bytes:
    """A real ClientHello (Python's TLS) naming `sni`."""
    context = ssl.create_default_context()
    context.check_hostname = sni is not None
    outgoing, incoming = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def records(hello: bytes, size: int) -> bytes:
    """`hello`'s handshake message split into TLS records of `size` bytes."""
    message = hello[5:]
    return b"".join(hello[:3] + len(part).to_bytes(2, "big") + part
                    for part in (message[i:i + size] for i in range(0, len(message), size)))


def test_a_client_hello_names_its_sni() -> None:
    hello = client_hello("API.Example.com")
    assert sniff(hello) == Sniffed("tls", "api.example.com")
    assert sniff(records(hello, 50)) == Sniffed("tls", "api.example.com")  # reassembled
    assert sniff(hello[:-1]) is None  # more could decide
    assert sniff(hello[:-1], final=True) == Sniffed("tls")
    assert sniff(client_hello(None)) == Sniffed("tls")  # no SNI


def test_a_client_hello_is_read_warily() -> None:
    hello = bytearray(client_hello("api.example.com"))
    at = bytes(hello).index(b"api.example.com")
    forged = bytearray(hello)
    forged[at:at + 3] = b"a\x00i"
    assert sniff(bytes(forged)) == Sniffed("tls")  # not a hostname: names nothing
    server_hello = bytes([0x16, 3, 3, 0, 4, 2, 0, 0, 0])
    assert sniff(server_hello) == Sniffed("tls")
    assert sniff(b"\x16\x03\x01\xff\xff" + b"\x01\xff\xff\xff") is None  # lengths unmet
    assert sniff(b"\x16\x03\x01\x00\x04\x01\x00\x00\x00", final=True) == Sniffed("tls")
    assert sniff(b"\x16\x02\x00") == Sniffed("unknown")  # not TLS's record version


def test_fuzzed_first_bytes_never_raise() -> None:
    rng = random.Random(15)
    seeds = [client_hello("api.example.com"), records(client_hello("a.example"), 7),
             b"GET / HTTP/1.1\r\nHost: a.example:80\r\nX: y\r\n\r\n"]
    for _ in range(4000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(data))
            data[at] = rng.randrange(256)
        cut = bytes(data[:rng.randint(0, len(data))])
        for final in (False, True):
            found = sniff(cut, final=final)
            assert found is not None or not final
            if found is not None and found.host is not None:
                assert found.host == found.host.strip().lower() and found.host.isascii()


@pytest.mark.parametrize(("data", "found"), [
    (b"GET / HTTP/1.1\r\nHost: API.example.com\r\n\r\n", Sniffed("http", "api.example.com")),
    (b"GET / HTTP/1.0\r\nhost:a.example:8080\r\nAccept: */*\r\n\r\n",
     Sniffed("http", "a.example")),
    (b"POST /x HTTP/1.1\r\nHost: a.example.\r\n\r\nbody", Sniffed("http", "a.example")),
    (b"GET / HTTP/1.1\r\nHost: [2001:DB8::1]:443\r\n\r\n", Sniffed("http", "2001:db8::1")),
    (b"GET / HTTP/1.1\r\nHost: 192.0.2.1\r\n\r\n", Sniffed("http", "192.0.2.1")),
    (b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nX: 1\r\n\r\n", Sniffed("http")),  # no Host
    (b"GET / HTTP/1.1\r\nHost: a.example:99999x\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nHost: a_b.example\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nHost: a.example\x00.b\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nX: 1\r\n Host: a.example\r\n\r\n", Sniffed("http")),  # folding
    (b"GET / HTTP/1.1\r\nHost : a.example\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nHost: \xc3\xa9.example\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nHost: [fe80::1%25eth0]\r\n\r\n", Sniffed("http")),
    (b"GET / HTTP/1.1\r\nHost: a.exa", None),  # more could decide
    (b"GE", None),
    (b"GET / HTTP/2.0\r\n\r\n", Sniffed("unknown")),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Sniffed("unknown")),
    (b"SSH-2.0-OpenSSH_9.2\r\n", Sniffed("unknown")),
    (b"get / HTTP/1.1\r\n", Sniffed("unknown")),
    (b"\x00\x01binary", Sniffed("unknown")),
])
def test_an_http_request_names_its_host(data: bytes, found: Sniffed | None) -> None:
    assert sniff(data) == found
