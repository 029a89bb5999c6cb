"""A streaming reverse proxy per session and upstream (SPEC §11 network, §14), on aiohttp.

The sandbox reaches the model endpoint and its MCP grants only through these: each
listens on loopback (in the host's network, or inside the sandbox's own network
namespace on a socket the runner opened there), forwards every request to its upstream —
`https://` included, so the runner's side speaks TLS — and streams the answer back as it
arrives (SSE unchanged: `Accept-Encoding: identity` upstream, no buffering).

The model's proxy also holds the real API key: Codex is given a per-session token, which
the proxy requires (401 without it) and replaces with the key, so the key never enters
the sandbox. No HTTP is parsed by hand here.
"""

from __future__ import annotations

import hmac
import socket
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 §7.6.1) and what the proxy sets itself.
DROPPED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                     "te", "trailer", "transfer-encoding", "upgrade", "host",
                     "content-length", "accept-encoding"})
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Upstream:
    """Where a proxy forwards, and how it authenticates there."""

    base_url: str  # scheme://host[:port][/prefix]
    token: str | None = None  # what the client must present (Bearer); None: anything
    authorization: str | None = None  # what replaces it upstream (None: passed through)
    extra_headers: Mapping[str, str] = field(default_factory=dict)

    def url_for(self, path_qs: str) -> str:
        """The upstream URL of a request path as the client sent it."""
        base = urlsplit(self.base_url)
        return urlunsplit(base._replace(path="", query="", fragment="")) + path_qs


class SessionProxy:
    """One loopback listener forwarding to one upstream, for one session's life."""

    def __init__(self, upstream: Upstream, *, path_prefix: str = "") -> None:
        self.upstream = upstream
        self.path_prefix = path_prefix
        self._runner: web.ServerRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self.port: int | None = None

    async def start(self, listener: socket.socket | None = None) -> int:
        """Serve on `listener` (a bound socket), else on a free loopback port; the port."""
        server = web.Server(self._forward, access_log=None)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        if listener is None:
            listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        site = web.SockSite(self._runner, listener)
        await site.start()
        self.port = int(listener.getsockname()[1])
        # The system's trust store (SSL_CERT_FILE / SSL_CERT_DIR honoured), as curl would.
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl.create_default_context()),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=30))
        return self.port

    def _authorized(self, request: web.BaseRequest) -> bool:
        if self.upstream.token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.upstream.token}".encode())

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        if not self._authorized(request):
            return web.Response(status=401, text="trialledger proxy: not this session's token")
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        headers["Accept-Encoding"] = "identity"
        if self.upstream.authorization is not None:
            headers["Authorization"] = self.upstream.authorization
        headers.update(self.upstream.extra_headers)
        body = await request.read()
        try:
            upstream = await self._client.request(
                request.method, self.upstream.url_for(request.path_qs), headers=headers,
                data=body, allow_redirects=False)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            return web.Response(status=502, text=f"trialledger proxy: upstream unreachable "
                                                 f"({type(error).__name__})")
        try:
            answer = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in DROPPED:
                    answer.headers.add(key, value)
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer
        except (aiohttp.ClientError, ConnectionError) as error:
            raise web.HTTPBadGateway(text=f"upstream broke off ({type(error).__name__})"
                                     ) from None
        finally:
            upstream.release()

    async def aclose(self) -> None:
        """Stop serving and drop the upstream connections."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()


async def start_all(proxies: Sequence[tuple[SessionProxy, socket.socket | None]]
                    ) -> list[int]:
    """Start several proxies; their ports, in order."""
    return [await proxy.start(listener) for proxy, listener in proxies]
