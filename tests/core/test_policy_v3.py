"""Policy v3 (SPEC §14): Codex's claims about the endpoint need the proxy's word."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.scenarios import LogBuilder
from trialledger.core import replay

STARTED = ['{"type":"thread.started","thread_id":"t"}', '{"type":"turn.started"}']
RATE = "exceeded retry limit, last status: 429 Too Many Requests"
REFUSED = "Reconnecting... waiting for network (Connection failed: error sending request)"
MESSAGE = '{"type":"item.completed","item":{"id":"m","type":"agent_message","text":"hi"}}'
DONE = '{"type":"turn.completed","usage":{"input_tokens":12,"cached_input_tokens":2,' \
       '"output_tokens":10,"reasoning_output_tokens":3}}'


def call(n: int, **fields: Any) -> dict[str, Any]:
    data = {"call": n, "method": "POST", "path": "/v1/responses",
            "started_at": "2026-11-29T08:00:03Z", "ended_at": "2026-11-29T08:00:04Z",
            "http_status": 200, "error": None, "completed": True, "response_id": f"r{n}",
            "model": "gpt-test", "usage": None, "output": ["message"], **fields}
    return {"type": "model.call", "at": data["ended_at"], "data": data}


def session(lines: list[str], calls: list[dict[str, Any]], *, rc: int | None = 1,
            timed_out: bool = False, proxy: bool = True, native: bool = False,
            vaae: bool = False) -> Any:
    builder = LogBuilder().launched().codex(lines)
    log = builder.events
    log[0]["data"]["settings"]["policy"] = "v3"
    log[0]["data"]["settings"]["verify_after_agent_error"] = vaae
    log[0]["data"]["model"] = "gpt-test"
    launched = next(e for e in log if e["type"] == "agent.launched")
    if proxy:
        launched["schema"] = 2
        launched["data"]["model_proxy"] = True
    log[2:2] = calls  # the calls came while Codex ran
    if native:
        builder.native((20, 8, 28))
    builder.finish(rc, timed_out=timed_out)
    return replay(log)


def failing(message: str) -> list[str]:
    return [*STARTED, json.dumps({"type": "error", "message": message}),
            json.dumps({"type": "turn.failed", "error": {"message": message}})]


def gaps(view: Any) -> list[str]:
    return [g.code for g in view.observations.gaps]


def test_a_429_the_proxy_saw_is_retried() -> None:
    view = session(failing(RATE), [call(1, http_status=429, completed=False)])
    d = view.decision
    assert (d.policy, d.rule, d.action, d.cause.kind) == ("v3", "reported", "retry",
                                                          "model_endpoint")


def test_a_429_the_proxy_never_saw_is_probed_not_retried() -> None:
    # The agent wrote a fake 429 onto Codex's stdout; every real call succeeded.
    view = session(failing(RATE), [call(1)])
    d = view.decision
    assert (d.rule, d.action, d.cause.kind) == ("probe", "probe", "agent_error")
    assert "endpoint_claim_unconfirmed" in gaps(view)
    assert view.state == "failed-live"  # the sandbox is probed, then graded if it lives


def test_a_claim_naming_another_status_than_the_proxy_saw_is_unconfirmed() -> None:
    view = session(failing(RATE), [call(1, http_status=503, completed=False)])
    assert view.decision.rule == "probe"


@pytest.mark.parametrize("upstream", [
    {"http_status": 500, "completed": False},
    {"http_status": None, "error": "reset", "completed": False},
    {"http_status": 200, "completed": False},  # the stream ended before response.completed
])
def test_each_kind_of_upstream_failure_confirms_a_stream_claim(upstream: dict[str, Any]
                                                               ) -> None:
    claim = "stream disconnected before completion: error decoding response body"
    view = session(failing(claim), [call(1, **upstream)])
    assert (view.decision.rule, view.decision.action) == ("reported", "retry")


def test_client_closed_confirms_nothing() -> None:
    claim = "stream disconnected before completion: error decoding response body"
    view = session(failing(claim), [call(1, http_status=None, error="client_closed",
                                         completed=False)])
    assert view.decision.rule == "probe"


@pytest.mark.parametrize("refusal", [
    {"path": "/v1/x/responses", "http_status": 403, "error": "refused_path"},
    {"http_status": 413, "error": "refused_size"},
    {"http_status": 503, "error": "refused_concurrency"},
])
def test_a_call_the_proxy_refused_itself_is_no_evidence(refusal: dict[str, Any]) -> None:
    # A tool holding the token: the refused call is the last POST …/responses by number,
    # yet the proxy answered it itself, so it neither confirms a claim nor is weighed.
    claim = "stream disconnected before completion: error decoding response body"
    view = session(failing(claim), [call(1), call(2, completed=False, response_id=None,
                                                  model=None, output=[], **refusal)])
    assert (view.decision.rule, view.decision.action) == ("probe", "probe")
    assert "endpoint_claim_unconfirmed" in gaps(view)


def test_a_reconnect_the_proxy_backs_is_r5b_one_it_does_not_is_graded() -> None:
    lines = [*STARTED, json.dumps({"type": "error", "message": REFUSED})]
    backed = session(lines, [call(1, http_status=None, error="refused", completed=False)],
                     rc=-15, timed_out=True)
    assert backed.decision.rule == "endpoint_unreachable"
    forged = session(lines, [call(1)], rc=-15, timed_out=True)
    assert (forged.decision.rule, forged.decision.action) == ("incomplete", "verify")


def test_a_hung_endpoint_is_the_endpoints() -> None:
    open_call = call(1, http_status=200, completed=False, error="client_closed",
                     started_at="2026-11-29T08:00:03Z", ended_at="2026-11-29T08:01:30Z")
    view = session(STARTED, [open_call], rc=-15, timed_out=True)
    assert (view.decision.rule, view.decision.cause.kind) == ("endpoint_unreachable",
                                                              "model_endpoint")
    talking = call(1, http_status=200, completed=False, error="client_closed",
                   started_at="2026-11-29T08:00:03Z", ended_at="2026-11-29T08:01:30Z",
                   last_byte_at="2026-11-29T08:01:29Z")
    assert session(STARTED, [talking], rc=-15, timed_out=True).decision.rule == "incomplete"


def test_a_reroute_needs_the_proxy() -> None:
    warning = ('{"type":"item.completed","item":{"id":"w","type":"error",'
               '"message":"model rerouted: gpt-test -> gpt-mini"}}')
    lines = [*STARTED, warning, MESSAGE, DONE]
    assert session(lines, [call(1)], rc=0).decision.rule == "completed"  # a forged warning
    assert session([*STARTED, MESSAGE, DONE], [call(1, model="gpt-mini")],
                   rc=0).decision.rule == "rerouted"


def test_usage_is_the_proxys_sum_and_a_mismatch_is_a_gap() -> None:
    usage = {"input_tokens": 10, "cached_input_tokens": 4, "output_tokens": 5,
             "reasoning_output_tokens": 1, "total_tokens": 15}
    calls = [call(1, usage=usage), call(2, http_status=429, completed=False),
             call(3, usage=usage)]
    view = session([*STARTED, MESSAGE, DONE], calls, rc=0, native=True)
    assert view.usage.model_dump() == {"input_tokens": 20, "cached_input_tokens": 8,
                                       "output_tokens": 10, "reasoning_output_tokens": 2,
                                       "total_tokens": 30}
    mismatch = next(g for g in view.observations.gaps if g.code == "usage_mismatch")
    assert json.loads(mismatch.detail)["native"]["total_tokens"] == 28


def test_an_unfinished_2xx_call_makes_usage_unknown_and_no_call_is_zero() -> None:
    partial = session([*STARTED, MESSAGE, DONE], [call(1, completed=False)], rc=0)
    assert partial.usage is None and "partial_model_usage_unavailable" in gaps(partial)
    nothing = session([*STARTED], [], rc=1)
    assert nothing.usage is not None and nothing.usage.total_tokens == 0


def test_without_the_proxy_v3_decides_as_v2() -> None:
    view = session(failing(RATE), [], proxy=False)
    assert (view.decision.policy, view.decision.rule) == ("v3", "reported")
    assert view.decision.action == "retry"


def test_a_schema_1_launch_is_stored_as_written() -> None:
    log = LogBuilder().launched().events
    view = replay(log)
    launched = view.events[1].model_dump(mode="json")
    assert "model_proxy" not in launched["data"] and launched["schema"] == 1


USAGE = {"input_tokens": 10, "cached_input_tokens": 4, "output_tokens": 5,
         "reasoning_output_tokens": 1, "total_tokens": 15}


@pytest.mark.parametrize(("quiet_since", "rule"), [
    ("2026-11-29T08:00:30Z", "endpoint_unreachable"),  # exactly 60 s quiet: the endpoint's
    ("2026-11-29T08:00:31Z", "incomplete"),  # 59 s: it was still talking
])
def test_the_hung_boundary_is_sixty_seconds_of_quiet(quiet_since: str, rule: str) -> None:
    open_call = call(1, http_status=200, completed=False, error="client_closed",
                     started_at="2026-11-29T08:00:03Z", ended_at="2026-11-29T08:01:30Z",
                     last_byte_at=quiet_since)
    assert session(STARTED, [open_call], rc=-15, timed_out=True).decision.rule == rule


def test_usage_counts_post_responses_calls_only() -> None:
    others = [call(2, method="GET", path="/v1/responses", usage=USAGE),
              call(3, path="/v1/chat/completions", usage=USAGE),
              call(4, path="/v1/responses/r1/cancel", usage=USAGE)]
    view = session([*STARTED, MESSAGE, DONE], [call(1, usage=USAGE), *others], rc=0)
    assert view.usage is not None and view.usage.model_dump() == USAGE


def test_an_incomplete_2xx_call_makes_usage_null_even_with_a_usage_it_reported() -> None:
    calls = [call(1, usage=USAGE), call(2, completed=False, usage=USAGE)]
    view = session([*STARTED, MESSAGE, DONE], calls, rc=0)
    assert view.usage is None and "partial_model_usage_unavailable" in gaps(view)
