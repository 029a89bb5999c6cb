"""How the sandbox reaches the model endpoint and its MCP grants (SPEC §11, §14).

The model endpoint is always reached through the session's proxy (`adapters/proxy/server.py`),
which holds the real API key. With `allow_internet = false` the sandbox gets a private
network namespace: bwrap starts with `--unshare-net --block-fd`; before the agent runs, a
short-lived thread of the runner enters that namespace (`setns`, which changes only the
calling thread), opens one listening socket per route on `127.0.0.1`, and leaves; the
sockets stay in the sandbox's namespace while the runner's proxies serve them from the
host's, speaking TLS upstream where the upstream is https. Nothing runs inside the
sandbox for this, and nothing else is reachable.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from trialledger.adapters.proxy.upstream import CallSink, Upstream
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.identity import libc

if TYPE_CHECKING:
    from trialledger.adapters.proxy.server import SessionProxy

CLONE_NEWNET = 0x40000000
LOOPBACK_WAIT_S = 10.0  # how long a proxy waits for the sandbox's loopback to be up


@dataclass(frozen=True)
class Route:
    """A loopback port the sandbox reaches and the upstream behind it."""

    port: int
    upstream: Upstream


class Network:
    """How a session's sandbox reaches the outside: the model endpoint always through its
    proxy (which holds the real key); with `isolated` (allow_internet = false) a private
    network namespace where those proxies, and one per MCP grant, are all there is. Without
    a `model` (an oracle or nop session, SPEC §15) there is no proxy at all."""

    def __init__(self, model: Upstream | None, grants: Sequence[Upstream] = (), *,
                 isolated: bool = False, outward: bool = False) -> None:
        self.isolated = isolated
        # A private namespace connected outward by slirp4netns (`public` for an image's
        # container, docs/SPEC.md §15): the proxies still listen inside it.
        self.outward = outward and isolated
        self.routes: list[Route] = []
        self._ports: dict[tuple[str, int], int] = {}
        if model is not None:
            self._add(model)
        for grant in grants if isolated else ():  # shared: Codex reaches them itself
            self._add(grant)
        self._proxies: list[SessionProxy] = []
        self.model_sink: CallSink | None = None  # records the model's calls (SPEC §14)

    @staticmethod
    def _key(url: str) -> tuple[str, int]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SandboxRefused(f"cannot route the sandbox to {url!r}: an http(s) URL is "
                                 "needed")
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)

    def _add(self, upstream: Upstream) -> None:
        key = self._key(upstream.base_url)
        if key in self._ports:
            return
        # Inside a private namespace every port is free: keep the upstream's where we can.
        port = key[1] if self.isolated else 0
        taken = {r.port for r in self.routes}
        while self.isolated and port in taken:
            port += 1
        self._ports[key] = port
        self.routes.append(Route(port, upstream))

    @property
    def model_token(self) -> str | None:
        """The token Codex presents to the model's proxy (in place of the real key)."""
        return self.routes[0].upstream.token if self.routes else None

    def inside_url(self, url: str) -> str:
        """`url` as the sandbox reaches it: through its loopback proxy."""
        parts = urlsplit(url)
        port = self._ports.get(self._key(url))
        if port is None:
            return url  # not routed: reached directly (the host's network)
        return urlunsplit(parts._replace(scheme="http", netloc=f"127.0.0.1:{port}"))

    async def open_on_host(self) -> None:
        """Shared network: start the proxies on loopback ports of the host now."""
        for index, route in enumerate(self.routes):
            port = await self._proxy(index, route).start()
            self._ports[self._key(route.upstream.base_url)] = port
            self.routes[index] = Route(port, route.upstream)

    async def open_inside(self, namespace_pid: int) -> None:
        """Isolated: start the proxies on sockets opened inside the sandbox's network."""
        listeners = listen_inside(namespace_pid, [r.port for r in self.routes])
        for index, (route, listener) in enumerate(zip(self.routes, listeners, strict=True)):
            await self._proxy(index, route).start(listener)

    def _proxy(self, index: int, route: Route) -> SessionProxy:
        # Imported here, not at the top: aiohttp's import (~0.2 s of every run's start) is
        # paid only by a session that has a proxy — an oracle's or nop's has none.
        from trialledger.adapters.proxy.server import SessionProxy

        proxy = SessionProxy(route.upstream, sink=self.model_sink if index == 0 else None)
        self._proxies.append(proxy)
        return proxy

    async def aclose(self) -> None:
        """Stop every proxy of the session (each reports its open calls first)."""
        for proxy in self._proxies:
            await proxy.aclose()
        self._proxies.clear()


def _bind_when_up(listener: socket.socket, port: int) -> None:
    """Bind `listener` to 127.0.0.1:`port` in the namespace this thread is in, waiting (at
    most `LOOPBACK_WAIT_S`) while the address is not there (EADDRNOTAVAIL): bwrap reports
    its child's pid while that child is still setting up the namespace's loopback (a
    session on a busy machine was lost with "Cannot assign requested address")."""
    deadline = time.monotonic() + LOOPBACK_WAIT_S
    while True:
        try:
            listener.bind(("127.0.0.1", port))
            return
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL or time.monotonic() >= deadline:
                raise
        time.sleep(0.002)


def listen_inside(namespace_pid: int, ports: Sequence[int]) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1 in the network namespace of `namespace_pid`."""
    c = libc()
    made: list[socket.socket] = []
    failure: list[BaseException] = []

    def enter_and_listen() -> None:  # in its own thread: setns changes only this thread
        try:
            fd = os.open(f"/proc/{namespace_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if c.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the sandbox's network")
            finally:
                os.close(fd)
            for port in ports:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                made.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                _bind_when_up(listener, port)
                listener.listen(64)
                listener.setblocking(False)
        except OSError as error:  # handed to the caller's thread, saying where it was
            failure.append(OSError(error.errno, f"listening inside the sandbox's network: "
                                                f"{error.strerror or error}"))
        except BaseException as error:
            failure.append(error)

    worker = threading.Thread(target=enter_and_listen, name="sandbox-netns")
    worker.start()
    worker.join()
    if failure:
        for listener in made:
            listener.close()
        raise failure[0]
    return made
