"""A dripping endpoint (docs/SPEC.md §5, §14): a model call not completed
`model_call_max_s` after its request was sent is ended by the proxy, `error: deadline`; it
confirms an endpoint claim as an upstream failure does, and R5b treats a session whose last
call ended so as one timed out with the call open. A real endpoint dripping a byte a
second, the real proxy, and a real Codex run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.core.test_policy_v3 import STARTED, call, failing, gaps, session
from tests.runs import make_task, run_task
from trialledger.adapters.demo.endpoint import Reply, ScriptedEndpoint, drip, hang
from trialledger.adapters.proxy.server import MODEL_ROUTES, SessionProxy, Upstream
from trialledger.core.events import SCHEMA_VERSION

pytestmark = pytest.mark.anyio
BODY = b'{"model": "m", "input": "hi", "stream": true}'
REQUEST = (b"POST /v1/responses HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer tl-tok\r\n"
           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
           % (len(BODY), BODY))
CLAIM = "stream disconnected before completion: error decoding response body"


@pytest.mark.parametrize("reply", [drip(30), hang(30)], ids=["dripping", "no-headers"])
async def test_the_proxy_ends_an_unfinished_call_at_its_deadline(reply: Reply) -> None:
    calls: list[dict[str, Any]] = []

    async def sink(_at: str, data: dict[str, Any]) -> None:
        calls.append(data)

    with ScriptedEndpoint([reply]) as endpoint:
        proxy = SessionProxy(Upstream(endpoint.url, token="tl-tok", routes=MODEL_ROUTES,
                                      call_max_s=2.0), sink=sink)
        port = await proxy.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST)
            await writer.drain()
            # Codex sees the endpoint break off: the answer ends, cut, well before 30 s.
            answer = await asyncio.wait_for(reader.read(), timeout=20)
            writer.close()
        finally:
            await proxy.aclose()
    (recorded,) = calls
    assert (recorded["error"], recorded["completed"]) == ("deadline", False)
    if reply.kind == "hang":  # no answer at all: the connection just closes
        assert answer == b"" and recorded["http_status"] is recorded["last_byte_at"] is None
    else:
        assert answer.startswith(b"HTTP/1.1 200") and b"response.created" in answer
        assert recorded["http_status"] == 200
        assert recorded["started_at"] < recorded["last_byte_at"] < recorded["ended_at"]


async def test_real_codex_on_a_dripping_endpoint_is_the_endpoints_r5b(tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [drip(60)],
                         settings={"timeout_s": 120, "model_call_max_s": 3,
                                   "stream_max_retries": 0, "request_max_retries": 0},
                         grace_s=1.0)
    stored = [e for e in ran.view.events if e.type == "model.call"]
    assert stored and stored[-1].schema_ == SCHEMA_VERSION["model.call"] == 2
    last = stored[-1].data
    assert (last.error, last.completed, last.http_status) == ("deadline", False, 200)
    assert last.last_byte_at is not None  # it dripped: never silent for 60 s
    d = ran.view.decision
    assert (d.policy, d.rule, d.action, d.cause.kind) == (
        "v3", "endpoint_unreachable", "retry", "model_endpoint")
    assert "verification.recorded" not in [e.type for e in ran.view.events]


# --- the policy, case by case (recorded calls, no endpoint) ---------------------------------

DRIPPED = {"http_status": 200, "completed": False, "error": "deadline",
           "started_at": "2026-11-29T08:00:03Z", "last_byte_at": "2026-11-29T08:00:07Z",
           "ended_at": "2026-11-29T08:00:08Z"}


@pytest.mark.parametrize("lines, rc, timed_out", [
    (failing(CLAIM), 1, False),  # Codex gave up on the dropped stream
    (STARTED, -15, True),  # timed out after the proxy ended the call
], ids=["codex-gave-up", "timed-out"])
def test_r5b_takes_a_last_call_ended_by_deadline_as_a_hung_one(
        lines: list[str], rc: int, timed_out: bool) -> None:
    view = session(lines, [call(1), call(2, **DRIPPED)], rc=rc, timed_out=timed_out)
    d = view.decision
    assert (d.rule, d.action, d.cause.kind, d.reward_valid) == (
        "endpoint_unreachable", "retry", "model_endpoint", False)
    assert "endpoint_claim_unconfirmed" not in gaps(view)
