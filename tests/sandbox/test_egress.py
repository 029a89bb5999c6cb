"""SPEC §15 "Network modes", `allowlist`, with real parts only: a bwrap sandbox with its own
network namespace, slirp4netns, the runner's nftables rules (`adapters/sandbox/egress.py`)
and the egress proxy listening inside, probed from inside against real servers on the host.
(The allowlist's forms and the first-bytes parser: tests/tasks/test_allowlist.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import select
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.test_slirp import DEADLINE_S, Sandbox, banner, host_address
from tests.sandbox.test_slirp import sandbox as slirp_sandbox
from trialledger.adapters.sandbox import hostside
from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.egress import (
    NO_RULES,
    EgressFailed,
    EgressProxy,
    apply_rules,
    egress_problem,
    egress_rules,
    open_ping,
)
from trialledger.adapters.sandbox.identity import libc
from trialledger.adapters.sandbox.network import CLONE_NEWNET, listen_inside
from trialledger.adapters.sandbox.slirp import slirp_problem, start_slirp
from trialledger.adapters.sandbox.sniff import Sniffed, sniff

PROXY_PORT = 15001  # inside the session's namespace: every port is free there


# Run inside the sandbox once the rules and the proxy are in place: each step, what
# happened (JSON). Every socket has a timeout.
PROBE = r"""
import json, socket, ssl, struct, sys
from contextlib import suppress

def receive(s):
    got = b""
    try:
        while len(got) < 65536:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:
        return got.decode(errors="replace") + "<reset>"
    except (TimeoutError, socket.timeout):
        return got.decode(errors="replace") + "<timeout>"
    return got.decode(errors="replace")

def tcp(step, data):
    s = socket.socket(socket.AF_INET6 if ":" in step["to"] else socket.AF_INET)
    s.settimeout(10)
    try:
        s.connect((step["to"], step["port"]))
        if data:
            s.sendall(data)
        return receive(s)
    except OSError as error:
        return f"error: {type(error).__name__}"
    finally:
        s.close()

def hello(sni):
    context = ssl.create_default_context()
    outgoing, incoming = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()

def udp(step):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    try:
        s.connect((step["to"], step["port"]))
        s.send(bytes.fromhex(step["send"]))
        answer = s.recv(4096)
        return f"answered {answer[:2].hex()}"
    except OSError as error:
        return f"error: {type(error).__name__}"
    finally:
        s.close()

def ping(step):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except OSError as error:
        return f"error: {type(error).__name__}"
    s.settimeout(5)
    try:
        s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"trialledger", (step["to"], 0))
        answer = s.recv(4096)
        return f"answered type {answer[0]}"
    except OSError as error:
        return f"error: {type(error).__name__}"
    finally:
        s.close()

out = []
for step in json.loads(sys.argv[1]):
    if step["kind"] == "http":
        out.append(tcp(step, f"GET / HTTP/1.0\r\nHost: {step['host']}\r\n\r\n".encode()))
    elif step["kind"] == "tls":
        out.append(tcp(step, hello(step["sni"])))
    elif step["kind"] == "silent":
        out.append(tcp(step, b""))
    elif step["kind"] == "raw":
        out.append(tcp(step, bytes.fromhex(step["send"])))
    elif step["kind"] == "halfclose":
        s = socket.socket()
        s.settimeout(10)
        try:
            s.connect((step["to"], step["port"]))
            s.sendall(b"x" * step["size"])
            s.shutdown(socket.SHUT_WR)
            out.append(receive(s))
        except OSError as error:
            out.append(f"error: {type(error).__name__}")
        finally:
            s.close()
    elif step["kind"] == "udp":
        out.append(udp(step))
    elif step["kind"] == "ping":
        out.append(ping(step))
print(json.dumps({"seen": out}))
"""


@dataclass
class Server:
    """A TCP server on the host: it reads a request head (or a TLS record), keeps it, and
    answers with an HTTP response carrying its name."""

    host: str
    name: str
    port: int = 0
    received: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        self.listener.bind((self.host, self.port))
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self.port = int(self.listener.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                peer, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with peer:
                peer.settimeout(5)
                self.received.append(self._head(peer))
                body = f"{self.name}\n".encode()
                with suppress(OSError):
                    peer.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))

    @staticmethod
    def _head(peer: socket.socket) -> bytes:
        data = b""
        with suppress(OSError):
            while b"\r\n\r\n" not in data and len(data) < 65536:
                if data[:1] == b"\x16" and len(data) >= 5 + int.from_bytes(data[3:5], "big"):
                    break
                chunk = peer.recv(65536)
                if not chunk:
                    break
                data += chunk
        return data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()


@contextmanager
def servers() -> Iterator[tuple[Server, Server]]:
    """Two servers on one port: `outside` on the host's network address (where the probes
    connect), `named` on the host's loopback (where `localhost` leads the proxy)."""
    for _ in range(20):
        outside = Server(host_address(), "outside")
        try:
            named = Server("127.0.0.1", "named", outside.port)
        except OSError:  # that port is taken on loopback: try another
            outside.close()
            continue
        try:
            yield outside, named
        finally:
            outside.close()
            named.close()
        return
    raise AssertionError("no port free on both of the host's addresses")


def sandbox(steps: list[dict[str, Any]] | None
            ) -> contextlib.AbstractAsyncContextManager[Sandbox]:
    """tests/sandbox/test_slirp.py's sandbox, running this file's probe."""
    return slirp_sandbox(steps, script=PROBE)


@dataclass
class Session:
    box: Sandbox
    proxy: EgressProxy
    refused: list[str]

    async def run(self) -> list[str]:
        """Let the probe run: what each step saw."""
        return list((await self.box.run())["seen"])


@asynccontextmanager
async def allowlisted(entries: list[str], steps: list[dict[str, Any]] | None = None,
                      *, ping: bool = False, **options: float) -> AsyncIterator[Session]:
    """A sandbox connected by slirp4netns with the egress rules loaded and the proxy
    serving inside; `refused` is complete once the context has ended."""
    refused: list[str] = []

    async def on_refused(detail: str) -> None:
        refused.append(detail)

    async with sandbox(steps) as box:
        slirp = await start_slirp(box.pid, net_namespace=box.info["net-namespace"])
        proxy = EgressProxy(AllowList.parse(entries, "test"), on_refused, **options)
        try:
            await apply_rules(box.pid, egress_rules(PROXY_PORT),
                              net_namespace=box.info["net-namespace"])
            if ping:
                open_ping(box.pid, net_namespace=box.info["net-namespace"])
            await proxy.start(listen_inside(box.pid, [PROXY_PORT])[0])
            yield Session(box, proxy, refused)
        finally:
            await proxy.aclose()
            await slirp.stop()


@pytest.fixture(autouse=True)
def _tools_usable(request: pytest.FixtureRequest) -> None:
    if "anyio_backend" in request.fixturenames:  # .ci/run installs them: never a skip
        assert slirp_problem() is None, slirp_problem()
        assert egress_problem() is None, egress_problem()


@pytest.mark.anyio
async def test_http_reaches_an_allowed_name_at_the_address_the_proxy_resolved() -> None:
    """`Host: localhost` sent to the host's network address reaches the server where the
    proxy resolved `localhost` (loopback, opened by the CIDR entry), never the original
    destination; any other name gets a 403 and is reported; so does a connection to the
    proxy itself."""
    with servers() as (outside, named):
        address, port = outside.host, outside.port
        steps = [{"kind": "http", "to": address, "port": port, "host": f"localhost:{port}"},
                 {"kind": "http", "to": address, "port": port, "host": "LocalHost."},
                 {"kind": "http", "to": address, "port": port, "host": "elsewhere.example"},
                 {"kind": "http", "to": "127.0.0.1", "port": PROXY_PORT, "host": "localhost"}]
        async with allowlisted(["localhost", "127.0.0.1/32"], steps) as session:
            seen = await session.run()
        assert seen[0].startswith("HTTP/1.0 200 OK") and seen[0].endswith("named\n")
        assert seen[1].endswith("named\n")
        assert seen[2].startswith("HTTP/1.1 403 Forbidden")
        assert seen[3] in ("", "<reset>")  # not redirected: closed before it is read
        assert session.refused == ["elsewhere.example", "127.0.0.1"]
        assert outside.received == []
        assert named.received[0].startswith(b"GET / HTTP/1.0\r\nHost: localhost:")


@pytest.mark.anyio
async def test_an_allowed_name_that_resolves_only_to_loopback_is_refused() -> None:
    with servers() as (outside, named):
        steps = [{"kind": "http", "to": outside.host, "port": outside.port,
                  "host": "localhost"}]
        async with allowlisted(["localhost"], steps) as session:
            seen = await session.run()
        assert seen[0].startswith("HTTP/1.1 403 Forbidden")
        assert session.refused == ["localhost"]
        assert outside.received == [] and named.received == []


@pytest.mark.anyio
async def test_a_forged_sni_reaches_only_the_allowed_hosts_address() -> None:
    """A ClientHello naming `localhost` sent to the host's network address is relayed to
    where `localhost` resolves; one naming another host is closed and reported."""
    with servers() as (outside, named):
        address, port = outside.host, outside.port
        steps = [{"kind": "tls", "to": address, "port": port, "sni": "localhost"},
                 {"kind": "tls", "to": address, "port": port, "sni": "elsewhere.example"}]
        async with allowlisted(["localhost", "127.0.0.1/32"], steps) as session:
            seen = await session.run()
        assert seen[0].endswith("named\n")
        assert seen[1] in ("", "<reset>")  # closed, nothing relayed
        assert session.refused == ["elsewhere.example"]
        assert outside.received == []
        assert len(named.received) == 1 and named.received[0][:1] == b"\x16"
        assert sniff(named.received[0]) == Sniffed("tls", "localhost")


@pytest.mark.anyio
async def test_an_ip_entry_admits_by_original_destination_without_a_name() -> None:
    """The original destination in a CIDR entry is enough: a server that speaks first
    answers a client that sends nothing, and any `Host` passes to it."""
    with banner(host_address(), "speaks-first") as first, servers() as (outside, _):
        steps = [{"kind": "silent", "to": first.host, "port": first.port},
                 {"kind": "http", "to": outside.host, "port": outside.port,
                  "host": "anything.example"}]
        async with allowlisted([f"{host_address()}/32"], steps) as session:
            seen = await session.run()
        assert seen[0] == "speaks-first\n"
        assert seen[1].endswith("outside\n")
        assert session.refused == []


def dns_query(name: str) -> str:
    """A DNS query (id 0x7e57) for `name`'s A record, hex."""
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return (bytes.fromhex("7e57 0100 0001 0000 0000 0000") + question + b"\0\1\0\1").hex()


@pytest.mark.anyio
async def test_udp_is_rejected_but_dns_to_the_resolver_and_icmp_pass() -> None:
    """UDP other than DNS to slirp's resolver is rejected at once (EACCES, no timeout); DNS to
    10.0.2.3 is answered; with ping opened, an unprivileged echo to the gateway is."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listening:
        listening.bind((host_address(), 0))
        udp_port = listening.getsockname()[1]
        steps = [{"kind": "udp", "to": host_address(), "port": udp_port, "send": "00"},
                 {"kind": "udp", "to": "10.0.2.3", "port": 54, "send": dns_query("a.test")},
                 {"kind": "udp", "to": "10.0.2.3", "port": 53,
                  "send": dns_query("trialledger.test")},
                 {"kind": "ping", "to": "10.0.2.2"}]
        host_range = Path("/proc/sys/net/ipv4/ping_group_range").read_text()
        async with allowlisted([host_address()], steps, ping=True) as session:
            seen = await session.run()
        assert Path("/proc/sys/net/ipv4/ping_group_range").read_text() == host_range
        assert seen[0] == "error: PermissionError"  # ICMP administratively prohibited
        assert seen[1] == "error: PermissionError"
        assert seen[2] == "answered 7e57"
        assert seen[3] == "answered type 0"  # echo reply
        assert select.select([listening], [], [], 0)[0] == []  # nothing reached the host
        assert session.refused == []


@pytest.mark.anyio
async def test_without_open_ping_no_echo_socket_can_be_opened() -> None:
    async with allowlisted([], [{"kind": "ping", "to": "10.0.2.2"}]) as session:
        seen = await session.run()
    assert seen == ["error: PermissionError"]


@pytest.mark.anyio
async def test_the_hosts_own_namespace_is_never_changed() -> None:
    before = Path("/proc/sys/net/ipv4/ping_group_range").read_text()
    with pytest.raises(EgressFailed, match="it is the runner's own"):
        open_ping(os.getpid())
    with pytest.raises(EgressFailed, match="it is the runner's own"):
        await apply_rules(os.getpid(), egress_rules(PROXY_PORT))
    assert Path("/proc/sys/net/ipv4/ping_group_range").read_text() == before
    async with sandbox(None) as box:
        with pytest.raises(EgressFailed, match="not the sandbox's"):
            open_ping(box.pid, net_namespace=box.info["net-namespace"] + 1)


def nft_tables(pid: int) -> str:
    return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "nft", "list", "tables"],
                          capture_output=True, text=True, check=True, timeout=DEADLINE_S).stdout


@pytest.mark.anyio
async def test_rules_load_again_and_are_removed_and_a_bad_ruleset_is_quoted() -> None:
    async with sandbox(None) as box:
        await apply_rules(box.pid, egress_rules(PROXY_PORT))
        await apply_rules(box.pid, egress_rules(PROXY_PORT + 1))  # replaces
        assert nft_tables(box.pid) == "table inet trialledger\n"
        listed = subprocess.run(["nsenter", f"--net=/proc/{box.pid}/ns/net", "nft", "list",
                                 "ruleset"], capture_output=True, text=True, check=True,
                                timeout=DEADLINE_S).stdout
        assert f"redirect to :{PROXY_PORT + 1}" in listed and f":{PROXY_PORT}\n" not in listed
        await apply_rules(box.pid, NO_RULES)
        await apply_rules(box.pid, NO_RULES)  # idempotent
        assert nft_tables(box.pid) == ""
        with pytest.raises(EgressFailed) as caught:
            await apply_rules(box.pid, "table inet trialledger { chain x { nonsense; } }\n")
        assert str(caught.value).startswith(f"nft could not load the egress rules into the "
                                            f"network namespace of pid {box.pid}: ")
        assert "\n" not in str(caught.value) and "Error" in str(caught.value)
    assert "trialledger" not in subprocess.run(["nft", "list", "tables"], capture_output=True,
                                               text=True, timeout=DEADLINE_S).stdout


@contextmanager
def counting_server(host: str) -> Iterator[socket.socket]:
    """A server that reads each connection to its end, then answers how much came."""
    listener = socket.create_server((host, 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                peer, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with peer:
                peer.settimeout(5)
                size = 0
                with suppress(OSError):
                    while chunk := peer.recv(65536):
                        size += len(chunk)
                    peer.sendall(f"got {size}\n".encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        stop.set()
        thread.join(5)
        listener.close()


@pytest.mark.anyio
async def test_a_half_close_passes_through_and_the_answer_comes_back() -> None:
    """The client's end of sending reaches the server (which answers only then), and the
    server's answer still reaches the client; 300 KiB pass within the proxy's bounds."""
    with counting_server(host_address()) as server:
        port = server.getsockname()[1]
        steps = [{"kind": "halfclose", "to": host_address(), "port": port, "size": 300 * 1024}]
        async with allowlisted([host_address()], steps) as session:
            seen = await session.run()
    assert seen == [f"got {300 * 1024}\n"]


@pytest.mark.anyio
async def test_a_relayed_connection_idle_both_ways_is_closed() -> None:
    """The upstream accepts (its backlog) but never speaks; nor does the client: the proxy
    closes the connection after `idle_s`, long before the client's own 10 s timeout."""
    with socket.create_server((host_address(), 0)) as mute:
        steps = [{"kind": "silent", "to": host_address(), "port": mute.getsockname()[1]}]
        async with allowlisted([host_address()], steps, idle_s=0.5) as session:
            seen = await session.run()
    assert seen == [""]


@pytest.mark.anyio
async def test_first_bytes_are_read_within_bounds() -> None:
    """A request head that never ends (too slow, or past 16 KiB) names no host: a 403 and
    the original destination reported; bytes of no protocol are closed at once."""
    address = host_address()
    slow = b"GET / HTTP/1.1\r\nHost: local"
    endless = b"GET /" + b"a" * (20 * 1024)
    steps = [{"kind": "raw", "to": address, "port": 80, "send": slow.hex()},
             {"kind": "raw", "to": address, "port": 81, "send": endless.hex()},
             {"kind": "raw", "to": address, "port": 82, "send": (b"\0" * 20000).hex()}]
    async with allowlisted(["localhost", "127.0.0.1/32"], steps, peek_s=0.5) as session:
        seen = await session.run()
    assert seen[0].startswith("HTTP/1.1 403 Forbidden")
    assert seen[1].startswith("HTTP/1.1 403 Forbidden")
    assert seen[2] in ("", "<reset>")
    assert session.refused == [address] * 3


@pytest.mark.anyio
async def test_a_connection_not_redirected_is_refused_and_a_failing_recorder_is_survived(
        caplog: pytest.LogCaptureFixture) -> None:
    """On a listener of the host (nothing redirects to it), every connection is one to the
    proxy itself: refused. A recorder that raises is logged, and the proxy serves on."""
    calls: list[str] = []

    async def on_refused(detail: str) -> None:
        calls.append(detail)
        raise RuntimeError("the ledger is away")

    proxy = EgressProxy(AllowList.parse(["localhost"], "test"), on_refused)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    await proxy.start(listener)
    try:
        for request in (b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n", b"\x16\x03\x01\xff"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            with suppress(ConnectionResetError):  # closed with the request unread
                assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
            writer.close()
    finally:
        await proxy.aclose()
        await proxy.aclose()  # idempotent
    assert calls == ["127.0.0.1", "127.0.0.1"]
    assert "the ledger is away" in caplog.text


def listen_inside6(pid: int, port: int) -> socket.socket:
    """A listening socket on [::1]:port in the network namespace of `pid` (what the runner
    opens where a namespace routes IPv6)."""
    made: list[socket.socket] = []

    def enter_and_listen() -> None:
        with open(f"/proc/{pid}/ns/net") as namespace:
            assert libc().setns(namespace.fileno(), CLONE_NEWNET) == 0
        listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        listener.bind(("::1", port))
        listener.listen(8)
        made.append(listener)

    worker = threading.Thread(target=enter_and_listen)
    worker.start()
    worker.join()
    return made[0]


@pytest.mark.anyio
async def test_ipv6_is_redirected_and_its_original_destination_read() -> None:
    """Where the namespace routes IPv6, TCP to an IPv6 address is redirected to the proxy
    on ::1 (IP6T_SO_ORIGINAL_DST): an allowed name is relayed, another name is refused."""
    with servers() as (outside, named):
        steps = [{"kind": "http", "to": "fd00:e9::2", "port": named.port, "host": "localhost"},
                 {"kind": "http", "to": "fd00:e9::2", "port": named.port, "host": "b.test"},
                 {"kind": "silent", "to": "fd00:e9::3", "port": 22}]
        async with allowlisted(["localhost", "127.0.0.1/32"], steps, peek_s=0.5) as session:
            subprocess.run(["nsenter", f"--net=/proc/{session.box.pid}/ns/net", "ip", "-6",
                            "addr", "add", "fd00:e9::100/64", "dev", "tap0", "nodad"],
                           check=True, timeout=DEADLINE_S)
            await session.proxy.start(listen_inside6(session.box.pid, PROXY_PORT))
            seen = await session.run()
        assert seen[0].endswith("named\n")
        assert seen[1].startswith("HTTP/1.1 403 Forbidden")
        assert seen[2] in ("", "<reset>")
        assert session.refused == ["b.test", "fd00:e9::3"]
        assert outside.received == []


@pytest.mark.anyio
async def test_without_nftables_the_reason_names_the_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostside, "SYSTEM_PATH", str(tmp_path))  # where the runner looks
    assert egress_problem() == "nft is not installed (apt-get install nftables)"
    with pytest.raises(EgressFailed, match=r"^nft is not installed \(apt-get install nftables\)$"):
        await apply_rules(os.getpid(), NO_RULES)


@pytest.mark.anyio
async def test_a_relay_whose_two_ends_break_at_once_retrieves_both_errors() -> None:
    """Both ends reset at once (a CI run saw it): the relay ends (False), and neither
    pump's error is left unretrieved (it would be logged, and fail an anyio test)."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        ends = [asyncio.StreamReader(), asyncio.StreamReader()]
        for end in ends:
            end.set_exception(ConnectionResetError())
        proxy = EgressProxy(AllowList.parse(["example.org"], "test"), _ignore)
        sinks: Any = (None, None)
        assert await proxy._relay((ends[0], sinks[0]), (ends[1], sinks[1])) is False
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(before)
    assert unretrieved == []


async def _ignore(detail: str) -> None:
    del detail
