"""The session proxy (SPEC §11, §14): only the session's token passes, the real key is
added by the proxy, and answers stream through byte for byte."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

import anyio
import pytest

from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, status
from trialledger.adapters.proxy import SessionProxy, Upstream

pytestmark = pytest.mark.anyio
BODY = b'{"model": "m", "input": "hi", "stream": true}'


def post(url: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=BODY, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


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
