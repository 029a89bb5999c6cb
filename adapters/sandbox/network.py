"""`allow_internet = false` (SPEC §11): the sandbox gets a private network namespace whose
only reachable addresses are loopback forwarders to the model endpoint and the granted
MCP servers.

bwrap starts with `--unshare-net --block-fd`: before the agent runs, a short-lived thread
of the runner enters that namespace (`setns`, which changes only the calling thread),
opens one listening socket per route on `127.0.0.1`, and leaves; the sockets stay in the
sandbox's namespace while the runner serves them from the host's, copying bytes to the
real upstream. Nothing runs inside the sandbox for this, and nothing else is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from trialledger.adapters.sandbox.base import SandboxRefused

CLONE_NEWNET = 0x40000000
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Route:
    """A loopback port inside the sandbox and the upstream it reaches."""

    inside_port: int
    host: str
    port: int


class Routes:
    """The upstreams a network-less sandbox may reach, and how their URLs read inside."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.routes: list[Route] = []
        self._inside: dict[tuple[str, int], int] = {}
        for url in urls:
            self._add(url)

    def _add(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise SandboxRefused(
                f"allow_internet = false forwards plain http:// upstreams only; {url!r} "
                "needs the model proxy (SPEC §14), which is not built yet")
        key = (parts.hostname, parts.port or 80)
        if key in self._inside:
            return
        taken = {r.inside_port for r in self.routes}
        inside = key[1]
        while inside in taken:
            inside += 1
        self._inside[key] = inside
        self.routes.append(Route(inside, *key))

    def inside_url(self, url: str) -> str:
        """`url` as the sandbox reaches it: through its loopback forwarder."""
        parts = urlsplit(url)
        port = self._inside[(parts.hostname or "", parts.port or 80)]
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


_libc: ctypes.CDLL | None = None


def listen_inside(namespace_pid: int, ports: Sequence[int]) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1 in the network namespace of `namespace_pid`."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc = _libc
    made: list[socket.socket] = []
    failure: list[BaseException] = []

    def enter_and_listen() -> None:  # in its own thread: setns changes only this thread
        try:
            fd = os.open(f"/proc/{namespace_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the sandbox's network")
            finally:
                os.close(fd)
            for port in ports:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", port))
                listener.listen(64)
                listener.setblocking(False)
                made.append(listener)
        except BaseException as error:  # handed to the caller's thread
            failure.append(error)

    worker = threading.Thread(target=enter_and_listen, name="sandbox-netns")
    worker.start()
    worker.join()
    if failure:
        for listener in made:
            listener.close()
        raise failure[0]
    return made


class Forwarders:
    """Serves the sandbox's listening sockets, each connection copied to its upstream."""

    def __init__(self) -> None:
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, namespace_pid: int, routes: Sequence[Route]) -> None:
        """Open the routes' ports inside the namespace and start forwarding."""
        listeners = listen_inside(namespace_pid, [r.inside_port for r in routes])
        for route, listener in zip(routes, listeners, strict=True):
            self._servers.append(await asyncio.start_server(
                lambda r, w, route=route: self._connect(r, w, route), sock=listener))

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       route: Route) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(route.host, route.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))
        finally:
            for side in (writer, up_writer):
                side.close()
            if task is not None:
                self._tasks.discard(task)

    async def aclose(self) -> None:
        """Stop listening and drop every forwarded connection."""
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)
        self._servers.clear()


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(CHUNK):
            sink.write(chunk)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except (ConnectionError, OSError):
        sink.close()
