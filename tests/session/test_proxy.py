"""The session proxy (SPEC §11, §14): only the session's token passes, the real key is
added by the proxy, and answers stream through byte for byte."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, status
from trialledger.adapters.proxy import server as proxy_module
from trialledger.adapters.proxy.server import (
    CONCURRENT_LIMIT,
    MODEL_ROUTES,
    SessionProxy,
    StreamObserver,
    Upstream,
)

pytestmark = pytest.mark.anyio
BODY = b'{"model": "m", "input": "hi", "stream": true}'


def send(url: str, method: str, body: bytes | None = None, token: str | None = "t"
         ) -> tuple[int, bytes]:
    """One request (with the bearer `token`, none when None): its status and body."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def post(url: str, token: str | None) -> tuple[int, bytes]:
    return send(url, "POST", BODY, token)


async def test_the_proxy_requires_the_token_and_adds_the_real_key() -> None:
    with ScriptedEndpoint([message(), message(), status(429)]) as endpoint:
        direct = await anyio.to_thread.run_sync(post, endpoint.url + "/responses", "x")
        proxy = SessionProxy(Upstream(endpoint.url, token="tl-session-abc",
                                      authorization="Bearer sk-real"))
        port = await proxy.start()
        inside = f"http://127.0.0.1:{port}/v1/responses"
        try:
            refused = await anyio.to_thread.run_sync(post, inside, "tl-session-wrong")
            missing = await anyio.to_thread.run_sync(post, inside, None)
            passed = await anyio.to_thread.run_sync(post, inside, "tl-session-abc")
            limited = await anyio.to_thread.run_sync(post, inside, "tl-session-abc")
        finally:
            await proxy.aclose()
    assert refused[0] == missing[0] == 401
    assert len(endpoint.requests) == 3  # the refused ones never reached the endpoint
    assert [h.get("Authorization") for h in endpoint.headers] == [
        "Bearer x", "Bearer sk-real", "Bearer sk-real"]
    # The same SSE answer, byte for byte, but for the response counter in it.
    assert passed[0] == 200 and passed[1].replace(b"_2", b"_1") == direct[1]
    assert limited[0] == 429  # an upstream status passes through as it is


async def test_an_unreachable_upstream_looks_unreachable_and_is_recorded_refused() -> None:
    calls: list[dict[str, Any]] = []

    async def sink(_at: str, data: dict[str, Any]) -> None:
        calls.append(data)

    proxy = SessionProxy(Upstream("http://127.0.0.1:9/v1", token="t"), sink=sink)
    port = await proxy.start()
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            await anyio.to_thread.run_sync(post, f"http://127.0.0.1:{port}/v1/responses", "t")
    finally:
        await proxy.aclose()
    (call,) = calls
    assert (call["error"], call["http_status"], call["completed"]) == ("refused", None, False)


async def test_every_call_is_recorded_from_the_stream_without_body_or_headers() -> None:
    calls: list[dict[str, Any]] = []

    async def sink(_at: str, data: dict[str, Any]) -> None:
        calls.append(data)

    with ScriptedEndpoint([message(usage=(12, 2, 10, 3)), status(429)]) as endpoint:
        proxy = SessionProxy(Upstream(endpoint.url, token="sess-Qz9"), sink=sink)
        port = await proxy.start()
        url = f"http://127.0.0.1:{port}/v1/responses"
        try:
            for _ in range(2):
                await anyio.to_thread.run_sync(post, url, "sess-Qz9")
        finally:
            await proxy.aclose()
    first, second = sorted(calls, key=lambda c: c["call"])
    assert (first["http_status"], first["completed"], first["response_id"]) == (
        200, True, "resp_1")
    assert first["usage"] == {"input_tokens": 12, "cached_input_tokens": 2,
                              "output_tokens": 10, "reasoning_output_tokens": 3,
                              "total_tokens": 22}
    assert first["output"] == ["message"] and first["path"] == "/v1/responses"
    assert (second["http_status"], second["completed"]) == (429, False)
    shown = json.dumps(calls)
    assert "sess-Qz9" not in shown and "stream" not in shown  # no header, no body


async def test_a_long_conversation_passes_whole() -> None:
    # A Responses request carries the whole conversation, often megabytes of it.
    with ScriptedEndpoint([message()]) as endpoint:
        proxy = SessionProxy(Upstream(endpoint.url, token="t"))
        port = await proxy.start()
        big = json.dumps({"model": "m", "input": "x" * 5_000_000, "stream": True}).encode()

        def send() -> int:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/responses", data=big, method="POST",
                headers={"Authorization": "Bearer t", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                return int(answer.status)

        try:
            assert await anyio.to_thread.run_sync(send) == 200
        finally:
            await proxy.aclose()
    assert len(endpoint.requests[0]["input"]) == 5_000_000


def sink_into(calls: list[dict[str, Any]]) -> Any:
    async def sink(_at: str, data: dict[str, Any]) -> None:
        calls.append(data)
    return sink


async def test_a_non_streamed_completed_answer_is_recorded_as_completed() -> None:
    # A tool holding the token asks for `"stream": false`: the whole response object is
    # the endpoint's word that the call completed, exactly as `response.completed` is.
    calls: list[dict[str, Any]] = []
    with ScriptedEndpoint([message(usage=(12, 2, 10, 3))]) as endpoint:
        proxy = SessionProxy(Upstream(endpoint.url, token="t", routes=MODEL_ROUTES),
                             sink=sink_into(calls))
        port = await proxy.start()
        body = json.dumps({"model": "gpt-x", "input": "hi", "stream": False}).encode()
        try:
            code, answer = await anyio.to_thread.run_sync(
                send, f"http://127.0.0.1:{port}/v1/responses", "POST", body)
        finally:
            await proxy.aclose()
    assert code == 200 and json.loads(answer)["status"] == "completed"
    (call,) = calls
    assert (call["http_status"], call["error"], call["completed"]) == (200, None, True)
    assert (call["response_id"], call["model"], call["output"]) == ("resp_1", "gpt-x",
                                                                    ["message"])
    assert call["usage"] == {"input_tokens": 12, "cached_input_tokens": 2, "output_tokens": 10,
                             "reasoning_output_tokens": 3, "total_tokens": 22}


@pytest.mark.parametrize("body", [
    b'{"status": "completed", "id": "r", "usage": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    b'{"status": "completed", "output": [' + b'"x",' * 2_000_000 + b'"x"]}',  # > 4 MiB
    b"\xff\xfe not json", b"[1, 2]", b'{"status": "in_progress", "output": 7}',
])
def test_hostile_whole_bodies_are_read_bounded_and_never_crash(body: bytes) -> None:
    observer = StreamObserver(streamed=False)
    for start in range(0, len(body), 65536):
        observer.feed(body[start:start + 65536])
    observer.finish()
    assert not observer.completed and observer.usage is None


async def test_only_codexs_routes_are_forwarded_the_rest_refused_and_recorded() -> None:
    calls: list[dict[str, Any]] = []
    with ScriptedEndpoint([message()]) as endpoint:
        proxy = SessionProxy(Upstream(endpoint.url, token="t", routes=MODEL_ROUTES),
                             sink=sink_into(calls))
        port = await proxy.start()
        base = f"http://127.0.0.1:{port}"
        refused = [("DELETE", "/v1/files/x"), ("POST", "/v1/files"), ("GET", "/v1/responses"),
                   ("POST", "/v1/x/responses"), ("POST", "/v1/./responses"),
                   ("POST", "/v1/responses/../files"), ("POST", "/v1/respons%65s"),
                   ("POST", "/v2/responses"), ("GET", "/v1/models/../files")]
        try:
            codes = [(await anyio.to_thread.run_sync(send, base + path, method, b"{}"))[0]
                     for method, path in refused]
            unauthorized = await anyio.to_thread.run_sync(
                lambda: send(base + "/v1/files/x", "DELETE", token="wrong"))
            models = await anyio.to_thread.run_sync(send, base + "/v1/models?v=1", "GET")
        finally:
            await proxy.aclose()
    assert codes == [403] * len(refused) and unauthorized[0] == 401
    assert endpoint.seen == [("GET", "/v1/models?v=1")]  # nothing refused reached it
    assert models[0] == 501  # the scripted endpoint's own answer, passed through
    recorded = sorted(calls, key=lambda c: c["call"])
    assert [(c["method"], c["http_status"], c["error"]) for c in recorded[:-1]] == [
        (method, 403, "refused_path") for method, _ in refused]
    assert (recorded[-1]["http_status"], recorded[-1]["error"]) == (501, None)
    assert len(recorded) == len(refused) + 1  # the 401 weighs nothing


class HoldingUpstream:
    """A real aiohttp upstream: counts the body bytes it received, notes each request's
    client port (to tell connection pools apart), and holds `?hold=1` calls open."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.first_byte = asyncio.Event()
        self.held = 0
        self.bodies: list[int] = []
        self.ports: list[int] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.ports.append(request.transport.get_extra_info("peername")[1])
        received = 0
        try:
            async for chunk in request.content.iter_any():
                received += len(chunk)
                self.first_byte.set()
        finally:
            self.bodies.append(received)
        if request.query.get("hold"):
            self.held += 1
            await self.release.wait()
        return web.json_response({"ok": True})

    async def __aenter__(self) -> str:
        app = web.Application(client_max_size=2**40)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self._runner.cleanup()


async def declared_too_big(port: int) -> bytes:
    """Announce a 300 MiB body and send 10 bytes of it: the status line of the answer (any
    answer came before the body, which is never sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
                 b"Content-Length: " + str(300 * 2**20).encode() + b"\r\n\r\n0123456789")
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return line


async def test_a_body_streams_upstream_and_one_over_the_limit_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    upstream = HoldingUpstream()
    monkeypatch.setattr(proxy_module, "REQUEST_LIMIT", 2**20)
    async with upstream as url:
        proxy = SessionProxy(Upstream(url, token="t", routes=MODEL_ROUTES),
                             sink=sink_into(calls))
        port = await proxy.start()
        target = f"http://127.0.0.1:{port}/v1/responses"
        headers = {"Authorization": "Bearer t"}
        try:
            # Declared too big: answered at once, before the body is sent.
            assert (await declared_too_big(port)).startswith(b"HTTP/1.1 413")
            async with aiohttp.ClientSession() as client:
                # Streamed: the upstream has the first bytes while the client still holds
                # back the rest — nothing waits for the whole body.
                holder = asyncio.Event()

                async def slow() -> AsyncIterator[bytes]:
                    yield b"a" * 1000
                    await holder.wait()
                    yield b"b" * 1000

                sending = asyncio.ensure_future(client.post(target, headers=headers,
                                                            data=slow()))
                await asyncio.wait_for(upstream.first_byte.wait(), 10)
                holder.set()
                async with await sending as answer:
                    assert answer.status == 200

                # Chunked past the limit: cut mid-stream, 413, recorded as the proxy's.
                async def endless() -> AsyncIterator[bytes]:
                    for _ in range(64):
                        yield b"c" * 65536

                async with client.post(target, headers=headers, data=endless()) as answer:
                    assert answer.status == 413
        finally:
            await proxy.aclose()
    # The refused bodies never reached the upstream whole: the declared one not at all,
    # the chunked one cut at the limit.
    assert len(upstream.bodies) == 2 and upstream.bodies[0] == 2000
    assert upstream.bodies[1] <= 2**20
    recorded = sorted(calls, key=lambda c: c["call"])
    assert [(c["http_status"], c["error"]) for c in recorded] == [
        (413, "refused_size"), (200, None), (413, "refused_size")]


async def test_concurrent_calls_are_capped_and_each_proxy_has_its_own_pool() -> None:
    calls: list[dict[str, Any]] = []
    upstream = HoldingUpstream()
    async with upstream as url:
        first = SessionProxy(Upstream(url, token="t", routes=MODEL_ROUTES),
                             sink=sink_into(calls))
        second = SessionProxy(Upstream(url, token="t", routes=MODEL_ROUTES))
        ports = [await first.start(), await second.start()]
        headers = {"Authorization": "Bearer t"}
        try:
            async with aiohttp.ClientSession() as client:
                held = [asyncio.ensure_future(client.get(
                    f"http://127.0.0.1:{ports[0]}/v1/models?hold=1", headers=headers))
                    for _ in range(CONCURRENT_LIMIT)]
                while upstream.held < CONCURRENT_LIMIT:
                    await asyncio.sleep(0.01)
                async with client.get(f"http://127.0.0.1:{ports[0]}/v1/models",
                                      headers=headers) as over:
                    assert over.status == 503
                upstream.release.set()
                for answer in await asyncio.gather(*held):
                    assert answer.status == 200
                    answer.release()
                before = list(upstream.ports)
                for port in (ports[0], ports[1], ports[0]):
                    async with client.get(f"http://127.0.0.1:{port}/v1/models",
                                          headers=headers) as answer:
                        assert answer.status == 200
        finally:
            await first.aclose()
            await second.aclose()
    # The 9th call never reached the upstream; the proxy answered it and said so.
    assert len(before) == CONCURRENT_LIMIT
    refused = [c for c in calls if c["error"] == "refused_concurrency"]
    assert [(c["http_status"], c["completed"]) for c in refused] == [(503, False)]
    # Sessions never share a connection: the second proxy came from a port of its own,
    # while the first one reused its pooled connections.
    a1, b1, a2 = upstream.ports[-3:]
    assert b1 not in before and b1 != a2 and {a1, a2} <= set(before)


COMPLETED = (b'event: response.completed\ndata: {"type": "response.completed", "response": '
             b'{"id": "resp_c", "model": "m", "status": "completed", "output": []}}\n\n')


@pytest.mark.parametrize("completed", [True, False])
async def test_a_client_gone_after_response_completed_leaves_the_call_whole(
        completed: bool) -> None:
    """Codex may close its connection as soon as it reads `response.completed`, before
    the stream's end reaches it: that call had its whole answer and is not `client_closed`
    (a CI run saw one so). A client gone before that event still is."""
    release = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b'event: response.created\ndata: {"type": "response.created", '
                           b'"response": {"id": "resp_c"}}\n\n')
        if completed:
            await answer.write(COMPLETED)
        await release.wait()  # the stream's end held back until the client has gone
        return answer

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    calls: list[dict[str, Any]] = []
    proxy = SessionProxy(Upstream(f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
                                  token="t"), sink=sink_into(calls))
    port = await proxy.start()
    try:
        async with aiohttp.ClientSession() as client:
            with anyio.fail_after(30):
                async with client.post(f"http://127.0.0.1:{port}/v1/responses", data=BODY,
                                       headers={"Authorization": "Bearer t"}) as answer:
                    wanted = b"response.completed" if completed else b"response.created"
                    seen = b""
                    while wanted not in seen:
                        seen += await answer.content.readany()
                # the connection is closed here, the upstream's stream still open
        with anyio.fail_after(30):
            while not calls:
                await anyio.sleep(0.05)
    finally:
        release.set()
        await proxy.aclose()
        await runner.cleanup()
    (call,) = calls
    assert (call["completed"], call["error"]) == (
        (True, None) if completed else (False, "client_closed")), call
