"""`allowlist` networking (docs/SPEC.md §15 "Network modes"): the nftables rules that send a
session's TCP to the runner's egress proxy, and that proxy (which hosts it admits:
`allowlist.py`).

The session's namespace is connected outward by slirp4netns as for `public`
(`slirp.py`); the runner loads `egress_rules` into it (the agent holds no NET_ADMIN), so
TCP to any address that is not the namespace's own is redirected to the proxy's socket,
opened inside the namespace on 127.0.0.1 (`network.listen_inside`) and served from the
runner's. As Harbor's egress sidecar (gost, sniffing), the proxy reads the original
destination (`SO_ORIGINAL_DST`) and the first bytes (`sniff.py`: TLS SNI, else HTTP
`Host`), admits a connection whose name is allowed — connecting to an address it resolved
itself, so a forged SNI reaches only the allowed host — or whose original destination an
IP/CIDR entry holds, and relays it; everything else is closed (plain HTTP gets a 403) and
reported to `on_refused`. DNS to slirp's resolver and ICMP pass; any other packet is
rejected.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from ipaddress import IPv4Address, IPv6Address, ip_address

from trialledger.adapters.sandbox.allowlist import Address, AllowList, as_address
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.hostside import has_program, host_env, program
from trialledger.adapters.sandbox.identity import libc
from trialledger.adapters.sandbox.slirp import RESOLVER
from trialledger.adapters.sandbox.sniff import UNKNOWN, Sniffed, sniff

log = logging.getLogger(__name__)

TABLE = "trialledger"  # the nftables table (family inet) the rules own in the namespace
NO_RULES = f"add table inet {TABLE}\ndelete table inet {TABLE}\n"  # `apply_rules`: remove
PING_RANGE = "0 2147483647"  # every group may open ICMP echo sockets, as Docker sets it
CLONE_NEWNET = 0x40000000
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
IP6T_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv6/ip6_tables.h
NFT_TIMEOUT_S = 10.0

PEEK_LIMIT = 16 * 1024  # bytes read to find the name
PEEK_S = 5.0  # and how long they may take (gost's sniffing.timeout)
CHUNK = 64 * 1024  # relayed at a time each way (also each stream's buffer bound)
RESOLVE_S = 10.0
CONNECT_S = 10.0
ADDRESSES_TRIED = 4  # of a name's resolved addresses
IDLE_S = 600.0  # a relayed connection silent both ways this long is closed
LINGER_S = 1.0  # a closing connection's last bytes may take this long
CONNECTION_LIMIT = 256  # open at once; more are closed as they come
FORBIDDEN = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: 34\r\n"
             b"Connection: close\r\n\r\nthis host is not in allowed_hosts\n")
BAD_GATEWAY = (b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: 27\r\n"
               b"Connection: close\r\n\r\nthe host cannot be reached\n")


# --- the namespace's rules -------------------------------------------------------------


class EgressFailed(SandboxRefused):
    """The egress rules or the ping range could not be set in a session's namespace (the
    message says why)."""


def egress_problem() -> str | None:
    """Why `allowlist` cannot be set up here (None: it can): a tool it needs is missing."""
    for tool, package in (("nft", "nftables"), ("nsenter", "util-linux")):
        if not has_program(tool):
            return f"{tool} is not installed (apt-get install {package})"
    return None


def egress_rules(proxy_port: int) -> str:
    """The nftables ruleset (`nft -f`) for a session's namespace: TCP to any address that
    is not local is redirected to the proxy's port on loopback; loopback, DNS (udp/tcp 53)
    to slirp's resolver and ICMP pass; every other outgoing packet is rejected. Loading it
    again replaces it; `NO_RULES` removes it."""
    if not 0 < proxy_port < 65536:
        raise ValueError(f"not a port: {proxy_port}")
    return f"""{NO_RULES}table inet {TABLE} {{
\tchain to_proxy {{
\t\ttype nat hook output priority -100; policy accept;
\t\tfib daddr type local return
\t\tip daddr {RESOLVER} tcp dport 53 return
\t\tmeta l4proto tcp redirect to :{proxy_port}
\t}}
\tchain outgoing {{
\t\ttype filter hook output priority 0; policy accept;
\t\toifname "lo" accept
\t\tfib daddr type local accept
\t\tip daddr {RESOLVER} meta l4proto {{ tcp, udp }} th dport 53 accept
\t\tmeta l4proto {{ icmp, ipv6-icmp }} accept
\t\treject with icmpx type admin-prohibited
\t}}
}}
"""


def _open_namespace(pid: int, net_namespace: int | None) -> tuple[int, int]:
    """The network namespace of `pid`, opened and checked (never the runner's own; with
    `net_namespace`, that inode): its fd (to close) and inode."""
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise EgressFailed(f"cannot open the network namespace of pid {pid}: "
                           f"{error.strerror}") from None
    inode = os.fstat(fd).st_ino
    why = None
    if inode == os.stat("/proc/self/ns/net").st_ino:
        why = "it is the runner's own (the host's network)"
    elif net_namespace is not None and inode != net_namespace:
        why = f"it is not the sandbox's (inode {inode}, expected {net_namespace})"
    if why is not None:
        os.close(fd)
        raise EgressFailed(f"refusing to change the network namespace of pid {pid}: {why}")
    return fd, inode


async def apply_rules(pid: int, rules: str, *, net_namespace: int | None = None) -> None:
    """Load `rules` (`egress_rules(port)`, or `NO_RULES`) into the network namespace of
    `pid` with `nft -f -`, atomically; `EgressFailed` quotes nft when it refuses them."""
    if (problem := egress_problem()) is not None:
        raise EgressFailed(problem)
    fd, _ = _open_namespace(pid, net_namespace)
    try:
        process = await asyncio.create_subprocess_exec(
            program("nsenter"), f"--net=/proc/self/fd/{fd}", "--", program("nft"), "-f", "-",
            env=host_env(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, pass_fds=(fd,))
    finally:
        os.close(fd)
    try:
        _, err = await asyncio.wait_for(process.communicate(rules.encode()), NFT_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise EgressFailed(f"nft did not load the egress rules within {NFT_TIMEOUT_S:g} s"
                           ) from None
    except BaseException:  # cancelled: nft is not left running
        if process.returncode is None:
            process.kill()
        raise
    if process.returncode != 0:
        said = "; ".join(line.strip() for line in err.decode(errors="replace").splitlines()
                         if line.strip())[-300:]
        raise EgressFailed(f"nft could not load the egress rules into the network namespace "
                           f"of pid {pid}: {said or f'exit {process.returncode}'}")


def open_ping(pid: int, *, net_namespace: int | None = None) -> None:
    """Let every group open ICMP echo sockets in the network namespace of `pid`
    (`net.ipv4.ping_group_range`), so `ping` works without NET_RAW. Written from a thread
    that entered that namespace (and checked it did); never the host's own."""
    fd, inode = _open_namespace(pid, net_namespace)
    failure: list[BaseException] = []

    def enter_and_write() -> None:  # in its own thread: setns changes only this thread
        try:
            if libc().setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the sandbox's network")
            if os.stat("/proc/thread-self/ns/net").st_ino != inode:
                raise OSError(0, "the thread is not in the sandbox's network")
            with open("/proc/sys/net/ipv4/ping_group_range", "w") as sysctl:
                sysctl.write(PING_RANGE)
        except BaseException as error:  # handed to the caller's thread
            failure.append(error)

    try:
        worker = threading.Thread(target=enter_and_write, name="sandbox-netns-ping")
        worker.start()
        worker.join()
    finally:
        os.close(fd)
    if failure:
        error = failure[0]
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise EgressFailed(f"cannot open ping in the network namespace of pid {pid}: "
                           f"{reason}")


# --- the proxy ------------------------------------------------------------------------


def _original_destination(sock: socket.socket) -> tuple[Address, int] | None:
    """Where a redirected connection was going (None: it was not redirected)."""
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, IP6T_SO_ORIGINAL_DST, 28)
            found: tuple[Address, int] = (IPv6Address(raw[8:24]), int.from_bytes(raw[2:4], "big"))
        else:
            raw = sock.getsockopt(socket.IPPROTO_IP, SO_ORIGINAL_DST, 16)
            found = (IPv4Address(raw[4:8]), int.from_bytes(raw[2:4], "big"))
        own = sock.getsockname()
    except (OSError, ValueError):
        return None
    if found == (ip_address(own[0]), own[1]):
        return None  # a connection to the proxy itself
    return as_address(found[0]) or found[0], found[1]


async def _peek(reader: asyncio.StreamReader, within_s: float) -> tuple[bytes, Sniffed]:
    """The first bytes (at most `PEEK_LIMIT`, within `within_s`) and what they name."""
    data = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while len(data) < PEEK_LIMIT:
        if (found := sniff(data)) is not None:
            return data, found
        try:
            chunk = await asyncio.wait_for(reader.read(PEEK_LIMIT - len(data)),
                                           deadline - loop.time())
        except (TimeoutError, OSError):
            break
        if not chunk:
            break
        data += chunk
    return data, sniff(data, final=True) or UNKNOWN


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close gracefully within `LINGER_S` (what is written goes first), else abort."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), LINGER_S)
    except (TimeoutError, OSError):
        writer.transport.abort()


async def _drain_input(reader: asyncio.StreamReader) -> None:
    """Read what the client still sends (bounded) so closing does not reset the answer."""
    loop = asyncio.get_running_loop()
    deadline, left = loop.time() + LINGER_S, CHUNK
    while left > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(left), deadline - loop.time())
        except (TimeoutError, OSError):
            return
        if not chunk:
            return
        left -= len(chunk)


class EgressProxy:
    """The runner's transparent egress proxy for one session's namespace: admits by name
    (SNI, else `Host`) or by original destination, refuses the rest (`on_refused` gets the
    name, else the address), relays what it admits."""

    def __init__(self, allow: AllowList, on_refused: Callable[[str], Awaitable[None]], *,
                 peek_s: float = PEEK_S, idle_s: float = IDLE_S) -> None:
        self.allow = allow
        self.on_refused = on_refused
        self.peek_s = peek_s  # how long the first bytes may take to name a host
        self.idle_s = idle_s  # a relayed connection silent both ways this long is closed
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self._reports: set[asyncio.Task[None]] = set()

    async def start(self, listener: socket.socket) -> None:
        """Serve `listener` (listening, opened inside the namespace: 127.0.0.1, or ::1 where
        the namespace routes IPv6); may be called again for another."""
        listener.setblocking(False)
        self._servers.append(await asyncio.start_server(self._serve, sock=listener,
                                                        limit=CHUNK))

    async def aclose(self) -> None:
        """Stop serving, end every connection, deliver every report. Idempotent."""
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        await asyncio.gather(*self._reports, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) <= CONNECTION_LIMIT:
                await self._admit(reader, writer)
        except Exception as error:  # hostile input or a broken peer: never the proxy's end
            log.debug("egress connection ended: %r", error)
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        destination = _original_destination(writer.get_extra_info("socket"))
        if destination is None:  # not redirected: a connection to the proxy's own port
            own = writer.get_extra_info("sockname")
            await self._refuse(reader, writer, UNKNOWN, str(own[0]))
            return
        address, port = destination
        if self.allow.allows_address(address):
            await self._forward(reader, writer, b"", UNKNOWN, [address], port)
            return
        first, sniffed = await _peek(reader, self.peek_s)
        if sniffed.host is None or not self.allow.allows_name(sniffed.host):
            await self._refuse(reader, writer, sniffed, sniffed.host or str(address))
            return
        addresses = await self._resolve(sniffed.host, port)
        if addresses is not None and not addresses:  # resolved only to refused addresses
            await self._refuse(reader, writer, sniffed, sniffed.host)
            return
        await self._forward(reader, writer, first, sniffed, addresses or [], port)

    async def _resolve(self, name: str, port: int) -> list[Address] | None:
        """The addresses the proxy may connect to for `name`, in the resolver's order (None:
        it does not resolve)."""
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(loop.getaddrinfo(
                name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), RESOLVE_S)
        except (OSError, TimeoutError, UnicodeError):
            return None
        addresses = _unique(a for a in (as_address(str(info[4][0])) for info in found)
                            if a is not None)
        return [a for a in addresses if self.allow.may_connect(a)][:ADDRESSES_TRIED]

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      sniffed: Sniffed, detail: str) -> None:
        if sniffed.protocol == "http":
            writer.write(FORBIDDEN)
            await self._last_words(reader, writer)
        else:
            await _close(writer)
        report = asyncio.ensure_future(self._report(detail))  # outlives the connection
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)

    async def _report(self, detail: str) -> None:
        try:
            await self.on_refused(detail)
        except Exception:  # the caller's failure must not end the proxy
            log.exception("recording a refused egress connection (%s) failed", detail)

    @staticmethod
    async def _last_words(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Send what was written, then close once the client is done (bounded)."""
        if writer.can_write_eof():
            writer.write_eof()
        await _drain_input(reader)
        await _close(writer)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       first: bytes, sniffed: Sniffed, addresses: list[Address],
                       port: int) -> None:
        for address in addresses:
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(str(address), port, limit=CHUNK), CONNECT_S)
            except (OSError, TimeoutError):
                continue
            try:
                up_writer.write(first)
                if await self._relay((reader, writer), (up_reader, up_writer)):
                    await asyncio.gather(_close(writer), _close(up_writer))
            finally:
                up_writer.transport.abort()
            return
        if sniffed.protocol == "http":  # allowed, but unreachable
            writer.write(BAD_GATEWAY)
            await self._last_words(reader, writer)

    async def _relay(self, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                     upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
        """Copy both ways (half-closes passed on) until both ends are done (True), or either
        breaks or nothing moved for `idle_s` (False: abort both)."""
        loop = asyncio.get_running_loop()
        moved = [loop.time()]

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while chunk := await source.read(CHUNK):
                moved[0] = loop.time()
                sink.write(chunk)
                await sink.drain()
            if sink.can_write_eof() and not sink.is_closing():
                sink.write_eof()

        pumps = {asyncio.ensure_future(pump(client[0], upstream[1])),
                 asyncio.ensure_future(pump(upstream[0], client[1]))}
        try:
            while pumps:
                left = moved[0] + self.idle_s - loop.time()
                if left <= 0:
                    return False
                done, pumps = await asyncio.wait(pumps, timeout=left,
                                                 return_when=asyncio.FIRST_COMPLETED)
                # every finished pump's exception retrieved (both ends may break at once:
                # one left unretrieved is logged as never retrieved)
                if [error for task in done if (error := task.exception()) is not None]:
                    return False
            return True
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


def _unique(addresses: Iterable[Address]) -> list[Address]:
    return list(dict.fromkeys(addresses))
