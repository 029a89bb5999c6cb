"""A streaming reverse proxy per session and upstream (SPEC §11 network, §14), on aiohttp.

The sandbox reaches the model endpoint and its MCP grants only through these: each
listens on loopback (in the host's network, or inside the sandbox's own network
namespace on a socket the runner opened there), forwards every request to its upstream —
`https://` included, so the runner's side speaks TLS — and streams the answer back as it
arrives (SSE unchanged: `Accept-Encoding: identity` upstream, no buffering).

The model's proxy also holds the real API key: Codex is given a per-session token, which
the proxy requires (401 without it, nothing recorded) and replaces with the key (with no
key, no `Authorization` goes upstream), so the key never enters the sandbox nor the token
leaves it. A call still open when Codex goes away or the proxy closes is `client_closed`
(unless its `response.completed` event had passed: Codex may close once it reads it),
whatever stage it was in. It forwards only the routes Codex uses (`MODEL_ROUTES`); what it
refuses itself — another route (403), a body over `REQUEST_LIMIT` (413), more than
`CONCURRENT_LIMIT` calls at once (503) — is recorded with an error of
`core.events.PROXY_REFUSALS`, which no policy reads as the endpoint's failure. A call not
completed `Upstream.call_max_s` after it was forwarded (the `model_call_max_s` setting) is
ended by the proxy, `deadline`, and shown to Codex as a dropped connection: an endpoint
that drips a byte now and then is never silent long enough to look hung. Request
bodies stream upstream as they arrive (never buffered whole), and each proxy has its own
upstream connection pool. No HTTP is parsed by hand here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hmac
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import ResolveResult
from aiohttp.resolver import ThreadedResolver

# Where a proxy forwards (upstream.py, which needs no aiohttp), named here too.
from trialledger.adapters.proxy.upstream import MODEL_ROUTES as MODEL_ROUTES
from trialledger.adapters.proxy.upstream import CallSink as CallSink
from trialledger.adapters.proxy.upstream import Upstream as Upstream
from trialledger.adapters.sandbox.allowlist import routable
from trialledger.core.boundedjson import UnsafeJSON, bounded_loads
from trialledger.core.events import DEADLINE, MAX_TOKENS
from trialledger.core.usage import token_count

REQUEST_LIMIT = 256 * 2**20  # bytes of one request body
CONCURRENT_LIMIT = 8  # calls one proxy forwards at once (Codex itself makes one or two)

# Hop-by-hop headers (RFC 9110 §7.6.1) and what the proxy sets itself.
DROPPED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                     "te", "trailer", "transfer-encoding", "upgrade", "host",
                     "content-length", "accept-encoding"})


class StreamObserver:
    """What a model call's answer says, read as it passes: from its server-sent events
    (`response.completed`), or with `streamed=False` from a whole JSON body (a response
    whose `status` is `completed`); the response's id, model, usage and output item types
    alike. Bounded: an event or a whole body over `EVENT_LIMIT` bytes is skipped, never
    buffered further, and JSON over `core.boundedjson`'s limits is ignored."""

    EVENT_LIMIT = 4 * 2**20

    def __init__(self, *, streamed: bool = True) -> None:
        self.streamed = streamed
        self._pending = bytearray()
        self._skipping = False
        self.completed = False
        self.response_id: str | None = None
        self.model: str | None = None
        self.usage: dict[str, int | None] | None = None
        self.output: list[str] = []

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the answer."""
        if not self.streamed:
            if not self._skipping:
                self._pending += chunk
            if len(self._pending) > self.EVENT_LIMIT:
                self._pending.clear()
                self._skipping = True
            return
        self._pending += chunk.replace(b"\r\n", b"\n")
        while (end := self._pending.find(b"\n\n")) != -1:
            block = bytes(self._pending[:end])
            del self._pending[:end + 2]
            if self._skipping:
                self._skipping = False
                continue
            self._event(block)
        if len(self._pending) > self.EVENT_LIMIT:
            self._pending.clear()
            self._skipping = True

    def finish(self) -> None:
        """The answer ended cleanly: a whole body is read now."""
        if self.streamed or self._skipping:
            return
        body = _json_object(bytes(self._pending))
        self._pending.clear()
        if body is None:
            return
        self._response(body)
        items = body.get("output")
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict):
                self._item(item)
        if body.get("status") == "completed":
            self._completed(body)

    WANTED = (b"response.completed", b"response.output_item.done", b"response.created")

    def _event(self, block: bytes) -> None:
        if not any(kind in block for kind in self.WANTED):
            return  # the bulk (text deltas) passes unparsed
        event = _json_object(b"\n".join(line[5:].lstrip() for line in block.split(b"\n")
                                        if line.startswith(b"data:")))
        if event is None:
            return
        kind = event.get("type")
        found = event.get("response")
        response: dict[str, Any] = found if isinstance(found, dict) else {}
        self._response(response)
        item = event.get("item")
        if kind == "response.output_item.done" and isinstance(item, dict):
            self._item(item)
        if kind == "response.completed":
            self._completed(response)

    def _response(self, response: dict[str, Any]) -> None:
        if isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if isinstance(response.get("model"), str):
            self.model = response["model"]

    def _item(self, item: dict[str, Any]) -> None:
        name = item.get("name")
        self.output.append(f"function_call:{name}" if item.get("type") == "function_call"
                           and isinstance(name, str) else str(item.get("type")))

    def _completed(self, response: dict[str, Any]) -> None:
        self.completed = True
        self.usage = _usage(response.get("usage"))


def _json_object(data: bytes) -> dict[str, Any] | None:
    """A JSON object within `StreamObserver`'s limit and `bounded_loads`' depth, or None
    for anything else (hostile JSON is refused cheaply, never parsed deep)."""
    try:
        found = bounded_loads(data, limit=StreamObserver.EVENT_LIMIT)
    except UnsafeJSON:
        return None
    return found if isinstance(found, dict) else None


def _usage(raw: object) -> dict[str, int | None] | None:
    """The Responses API's usage in SPEC §4's fields (None when it has none usable)."""
    if not isinstance(raw, dict):
        return None
    inputs, outputs = token_count(raw.get("input_tokens")), token_count(raw.get("output_tokens"))
    if inputs is None or outputs is None or inputs + outputs > MAX_TOKENS:
        return None
    details_in = raw.get("input_tokens_details") or {}
    details_out = raw.get("output_tokens_details") or {}
    return {"input_tokens": inputs,
            "cached_input_tokens": token_count(details_in.get("cached_tokens"))
            if isinstance(details_in, dict) else None,
            "output_tokens": outputs,
            "reasoning_output_tokens": token_count(details_out.get("reasoning_tokens"))
            if isinstance(details_out, dict) else None,
            "total_tokens": inputs + outputs}


class PublicResolver(ThreadedResolver):
    """The system's resolver keeping only globally routable addresses: the connector
    connects to an address checked here, so a name cannot rebind between check and use."""

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        """`host`'s routable addresses; OSError (connection refused) when there are none."""
        found = [r for r in await super().resolve(host, port, family) if routable(r["host"])]
        if not found:
            raise OSError(errno.ECONNREFUSED, f"{host} resolves to no globally routable "
                          "address")
        return found


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _transport_error(error: BaseException) -> str:
    """The upstream transport failure as SPEC §14 names it."""
    if isinstance(error, aiohttp.ClientConnectorDNSError):
        return "dns"
    if isinstance(error, aiohttp.ClientSSLError | ssl.SSLError):
        return "tls"
    if isinstance(error, TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(error, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "refused"
    return "reset"


# What happens to a call is its `model.call` record; aiohttp's own report of a handler
# cancelled at shutdown (a call Codex left open) would only be noise on the console.
_QUIET = logging.getLogger("trialledger.proxy.server")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def _refusal(status: int, text: str) -> web.Response:
    """The proxy's own answer; the connection closes, so an unread body is never drained."""
    answer = web.Response(status=status, text=f"trialledger proxy: {text}")
    answer.force_close()
    return answer


class _BodyCut(Exception):
    """The request body was cut: past the limit, or the client went away mid-body."""


def _drop(request: web.BaseRequest) -> None:
    """Close the client's connection without an answer (what a dead endpoint does)."""
    if request.transport is not None:
        request.transport.abort()


@functools.lru_cache(maxsize=4)
def trust(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """The system's trust store (SSL_CERT_FILE / SSL_CERT_DIR honoured, as curl would),
    loaded once per process and shared: loading it for every session costs CPU each time."""
    del cert_file, cert_dir  # the cache key: create_default_context reads them itself
    return ssl.create_default_context()


class SessionProxy:
    """One loopback listener forwarding to one upstream, for one session's life; with a
    `sink`, every request is reported as a `model.call` (never its body or headers). Each
    instance has its own upstream connection pool: sessions never share a connection."""

    def __init__(self, upstream: Upstream, *, sink: CallSink | None = None) -> None:
        self.upstream = upstream
        self.sink = sink
        self._runner: web.ServerRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self._calls = 0
        self._open = 0  # calls being forwarded now
        self._closing = False  # aclose has begun: what ends an open call now is ours
        self._reports: set[asyncio.Task[None]] = set()
        self.port: int | None = None

    async def start(self, listener: socket.socket | None = None) -> int:
        """Serve on `listener` (a bound socket), else on a free loopback port; the port."""
        # (bodies are streamed, never read whole: aiohttp's client_max_size does not apply)
        # handler_cancellation: a call whose client went away ends (`client_closed`) then,
        # not when the upstream finally answers or the proxy closes its own connections.
        server = web.Server(self._forward, access_log=None, logger=_QUIET,
                            handler_cancellation=True)
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        if listener is None:
            listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        site = web.SockSite(self._runner, listener)
        await site.start()
        self.port = int(listener.getsockname()[1])
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=trust(os.environ.get("SSL_CERT_FILE"),
                                                     os.environ.get("SSL_CERT_DIR")),
                                           limit=CONCURRENT_LIMIT,
                                           resolver=(PublicResolver()
                                                     if self.upstream.public_only else None)),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=30))
        return self.port

    def _authorized(self, request: web.BaseRequest) -> bool:
        if self.upstream.token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.upstream.token}".encode())

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        if not self._authorized(request):  # weighs nothing: no record, no upstream
            return _refusal(401, "not this session's token")
        self._calls += 1
        call = {"call": self._calls, "method": request.method, "path": request.path_qs,
                "started_at": _utc_now(), "http_status": None, "error": None,
                "last_byte_at": None}
        observer = StreamObserver()
        refused = self._refused(request)
        if refused is not None:
            status, call["error"], text = refused
            call["http_status"] = status
            self._report(call, observer)
            return _refusal(status, text)
        self._open += 1
        answered: list[web.StreamResponse] = []  # the answer, once its headers went out
        try:
            async with asyncio.timeout(self.upstream.call_max_s):
                return await self._relay(request, call, observer, answered)
        except TimeoutError:  # the deadline: the endpoint's, shown as it breaking off
            call["error"] = call["error"] or DEADLINE
            _drop(request)
            return answered[0] if answered else web.Response(status=504)
        except asyncio.CancelledError:  # Codex went away: after `response.completed`, the
            # call had its whole answer (Codex may close as soon as it reads that event)
            call["error"] = call["error"] or (None if observer.completed else "client_closed")
            raise
        finally:
            self._open -= 1
            self._report(call, observer)

    def _refused(self, request: web.BaseRequest) -> tuple[int, str, str] | None:
        """What the proxy answers itself, before anything goes upstream: (status, the
        recorded error, text), or None to forward."""
        if not self.upstream.admits(request.method, request.raw_path):
            return 403, "refused_path", "not a route Codex uses"
        if (request.content_length or 0) > REQUEST_LIMIT:
            return 413, "refused_size", f"a request body is at most {REQUEST_LIMIT} bytes"
        if self._open >= CONCURRENT_LIMIT:
            return 503, "refused_concurrency", f"at most {CONCURRENT_LIMIT} calls at once"
        return None

    @staticmethod
    async def _body(request: web.BaseRequest, call: dict[str, Any]) -> AsyncIterator[bytes]:
        """The request body as it arrives, cut (and the call marked) past the limit or
        when the client goes away mid-body."""
        sent = 0
        while True:
            try:
                chunk = await request.content.readany()
            except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as error:
                call["error"] = "client_closed"
                raise _BodyCut from error
            if not chunk:
                return
            sent += len(chunk)
            if sent > REQUEST_LIMIT:
                call["error"] = "refused_size"
                raise _BodyCut
            yield chunk

    async def _relay(self, request: web.BaseRequest, call: dict[str, Any],
                     observer: StreamObserver, answered: list[web.StreamResponse]
                     ) -> web.StreamResponse:
        assert self._client is not None
        # With a session token, the client's Authorization is that token: never upstream.
        private = DROPPED | {"authorization"} if self.upstream.token is not None else DROPPED
        headers = {k: v for k, v in request.headers.items() if k.lower() not in private}
        headers["Accept-Encoding"] = "identity"
        if self.upstream.authorization is not None:
            headers["Authorization"] = self.upstream.authorization
        headers.update(self.upstream.extra_headers)
        if request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        if self.upstream.unreachable():  # as an upstream that refuses the connection
            call["error"] = "refused"
            _drop(request)
            return web.Response(status=502)
        body = self._body(request, call) if request.body_exists else None
        try:
            upstream = await self._client.request(
                request.method, self.upstream.url_for(request.path_qs), headers=headers,
                data=body, allow_redirects=False)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            if call["error"] == "refused_size":  # ours: the upstream only saw a cut body
                call["http_status"] = 413
                return _refusal(413, f"a request body is at most {REQUEST_LIMIT} bytes")
            call["error"] = call["error"] or self._upstream_error(error)
            _drop(request)  # as if the endpoint itself were unreachable
            return web.Response(status=502)
        try:
            call["http_status"] = upstream.status
            observer.streamed = upstream.content_type == "text/event-stream"
            answer = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in DROPPED:
                    answer.headers.add(key, value)
            await answer.prepare(request)
            answered.append(answer)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, OSError, TimeoutError) as error:
                    call["error"] = call["error"] or self._upstream_error(error)
                    _drop(request)  # the endpoint broke off: so does our answer
                    return answer
                if not chunk:
                    if self._closing:  # our own connection closed under it, not the end
                        call["error"] = call["error"] or "client_closed"
                        return answer
                    break
                call["last_byte_at"] = _utc_now()
                observer.feed(chunk)
                try:
                    await answer.write(chunk)
                except (ConnectionError, RuntimeError):
                    if not observer.completed:  # (after it: the answer was whole)
                        call["error"] = "client_closed"
                    return answer
            if 200 <= upstream.status < 300:
                observer.finish()  # a whole response body, read once it is all here
            # Codex gone just before the stream's last chunk: everything the endpoint sent
            # was relayed, so the call stands as it was (never client_closed: the endpoint
            # did not hang), and nothing is raised in the handler
            with contextlib.suppress(ConnectionError, RuntimeError):
                await answer.write_eof()
            return answer
        except asyncio.CancelledError:  # Codex went away: a whole body it had still counts
            if upstream.content.at_eof() and 200 <= upstream.status < 300:
                observer.finish()
            raise
        finally:
            upstream.release()

    def _upstream_error(self, error: BaseException) -> str:
        """The transport error of a call, or `client_closed` once the proxy is closing: then
        the connection was broken by us (the call was still open), not by the endpoint."""
        return "client_closed" if self._closing else _transport_error(error)

    def _report(self, call: dict[str, Any], observer: StreamObserver) -> None:
        if self.sink is None:
            return
        ended = _utc_now()
        data = {**call, "ended_at": ended, "completed": observer.completed,
                "response_id": observer.response_id, "model": observer.model,
                "usage": observer.usage, "output": observer.output}
        task = asyncio.ensure_future(self.sink(ended, data))  # survives the handler's end
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def aclose(self) -> None:
        """Stop serving (open calls end `client_closed`), report every call, disconnect."""
        self._closing = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._reports:
            await asyncio.gather(*self._reports, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None


async def start_all(proxies: Sequence[tuple[SessionProxy, socket.socket | None]]
                    ) -> list[int]:
    """Start several proxies; their ports, in order."""
    return [await proxy.start(listener) for proxy, listener in proxies]
