"""The session proxy (SPEC §11, §14): only the session's token passes, the real key is
added by the proxy, and answers stream through byte for byte."""

from __future__ import annotations

import urllib.error
import urllib.request

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


async def test_an_unreachable_upstream_is_a_502_from_the_proxy() -> None:
    proxy = SessionProxy(Upstream("http://127.0.0.1:9/v1", token="t"))
    port = await proxy.start()
    try:
        code, body = await anyio.to_thread.run_sync(
            post, f"http://127.0.0.1:{port}/v1/responses", "t")
    finally:
        await proxy.aclose()
    assert code == 502 and b"upstream unreachable" in body
