"""Each required case of SPEC §3, on real Codex 0.171.0 lines (see tests/scenarios.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings

from tests.logs import session_logs
from tests.scenarios import CLEAN, HTTP_429, MCP_STDERR, SCENARIOS, LogBuilder, run
from trialledger.core import Policy, register_policy, replay
from trialledger.core.policy import V1_RULES, Rule, get_policy
from trialledger.core.usage import ZERO

fast = settings(max_examples=60, deadline=None)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_required_case_decides_as_the_spec_says(name: str) -> None:
    builder, expected = SCENARIOS[name]
    view = replay(builder.events)
    decision = view.decision
    assert decision is not None
    assert decision.rule == expected["rule"]
    assert decision.action == expected["action"]
    assert decision.policy == "v1"
    if "state" in expected:
        assert view.state == expected["state"]
    if "cause" in expected:
        assert decision.cause is not None and decision.cause.kind == expected["cause"]
    if "status_code" in expected:
        assert decision.cause is not None and decision.cause.status_code == expected["status_code"]
    if "status" in expected:
        assert decision.status == expected["status"]
    if "incomplete_reason" in expected:
        assert decision.incomplete_reason == expected["incomplete_reason"]
    if "reward_valid" in expected:
        assert decision.reward_valid is expected["reward_valid"]
    if "first_rule" in expected:
        assert view.decisions[0].rule == expected["first_rule"]
    if "gap" in expected:
        assert expected["gap"] in [g.code for g in view.observations.gaps]


def test_clean_run_is_graded_with_usage_and_the_metadata_gap() -> None:
    view = replay(SCENARIOS["clean"][0].events)
    d = view.decision
    assert d is not None
    assert (d.status, d.http_status, d.error, d.cause, d.reward_valid) == (
        "completed", 200, None, None, True)
    assert d.usage is not None and d.usage.total_tokens == 22
    codes = [g.code for g in view.observations.gaps]
    assert codes == ["model_metadata_fallback"]
    assert [m.text for m in view.observations.invocation.conversation] == ["say hi", "hi there"]


@pytest.mark.parametrize("name", ["http_429", "http_500", "stream_cut", "capacity"])
def test_reported_endpoint_failures_keep_their_cause_and_are_retried(name: str) -> None:
    d = replay(SCENARIOS[name][0].events).decision
    assert d is not None
    assert (d.http_status, d.status, d.reward_valid) == (200, "failed", False)
    assert d.cause is not None and d.cause.message == d.error


@pytest.mark.parametrize("name", ["http_429", "http_500", "stream_cut", "capacity"])
def test_endpoint_failure_then_kill_is_retried_without_a_probe(name: str) -> None:
    view = replay(SCENARIOS[f"{name}_killed"][0].events)
    assert [d.action for d in view.decisions] == ["retry"]
    assert view.decision is not None and view.decision.http_status == 502
    assert view.decision.cause is not None
    assert view.decision.cause.kind == "model_endpoint"
    assert "failed-live" not in {view.state}


def test_recovered_retry_then_unrelated_kill_is_probed_then_graded() -> None:
    view = replay(SCENARIOS["recovered_then_killed_probe"][0].events)
    probe, final = view.decisions
    assert (probe.rule, probe.action, probe.http_status, probe.cause) == (
        "probe", "probe", None, None)
    assert probe.error == "Codex exited with code -9"
    assert (final.rule, final.action, final.http_status, final.status) == (
        "probed", "verify", 200, "failed")
    assert final.reward_valid is True


def test_probe_that_finds_the_sandbox_dead_retries() -> None:
    builder, _ = SCENARIOS["bad_request_killed"]
    events = [*builder.events, {"type": "sandbox.probed", "at": "2026-11-29T09:00:00Z",
                                "data": {"alive": False, "detail": "true timed out"}}]
    final = replay(events).decision
    assert final is not None
    assert (final.rule, final.action, final.http_status) == ("probed", "retry", 502)
    assert final.cause is not None and final.cause.kind == "sandbox_unresponsive"
    assert final.cause.status_code is None


def test_bad_request_after_turn_started_is_not_an_endpoint_error() -> None:
    view = replay(SCENARIOS["bad_request_killed"][0].events)
    assert view.decision is not None and view.decision.action == "probe"
    opted_out = replay(SCENARIOS["bad_request_killed_opt_out"][0].events).decision
    assert opted_out is not None and opted_out.cause is not None
    assert opted_out.cause.kind == "model_request"


def test_required_mcp_failure_is_a_startup_failure_carrying_the_stderr_tail() -> None:
    view = replay(SCENARIOS["required_mcp_down"][0].events)
    d = view.decision
    assert d is not None and d.error == f"Codex exited with code 1: {MCP_STDERR}"
    assert d.cause is not None and d.cause.status_code is None and d.cause.message == d.error
    gaps = {g.code: g.detail for g in view.observations.gaps}
    assert gaps["agent_startup_failed"] == MCP_STDERR
    assert d.usage is not None and d.usage.total_tokens == 0  # Codex never reached the model


def test_timeout_before_any_turn_is_a_startup_failure() -> None:
    d = replay(SCENARIOS["timeout_before_turn"][0].events).decision
    assert d is not None and d.error == "Codex started no turn"
    assert d.status == "incomplete" and d.incomplete_reason == "timeout"


def test_timeout_keeps_the_partial_tool_call() -> None:
    view = replay(SCENARIOS["timeout"][0].events)
    (call,) = view.observations.tool_calls
    assert (call.name, call.status, call.completed_at) == ("exec_command", "incomplete", None)
    assert view.usage is None
    assert "partial_model_usage_unavailable" in [g.code for g in view.observations.gaps]


def test_cleanup_unconfirmed_names_the_error() -> None:
    d = replay(SCENARIOS["cleanup_unconfirmed"][0].events).decision
    assert d is not None and d.error == "cleanup unconfirmed: 2 processes still running"
    assert (d.http_status, d.status, d.reward_valid) == (502, "failed", False)


def test_lost_sandbox_decides_at_once() -> None:
    view = replay(SCENARIOS["sandbox_lost"][0].events)
    assert view.decision is not None
    assert view.decision.error == "sandbox lost: container vanished"
    assert view.events[-1].type == "outcome.decided"
    assert view.events[-1].at == view.events[-2].at  # the trigger's `at`


def test_rerouted_model_is_retried_with_its_message() -> None:
    d = replay(SCENARIOS["rerouted"][0].events).decision
    assert d is not None and d.error is not None and d.error.startswith("model rerouted:")
    assert d.status == "completed" and d.http_status == 502


def test_opt_in_off_keeps_the_execution_error() -> None:
    view = replay(SCENARIOS["killed_opt_out"][0].events)
    assert [d.action for d in view.decisions] == ["retry"]
    assert view.decision is not None and view.decision.http_status == 502


def test_clean_run_ends_graded_and_any_exit_code_is_taken_as_given() -> None:
    d = replay(run(CLEAN, 3).events).decision
    assert d is not None and d.error == "Codex exited with code 3" and d.status == "failed"


# --- R0 `scripted_agent` (SPEC §15): an oracle's or nop's run, graded by its exit alone ----

def scripted(agent: str, rc: int | None, *, lines: tuple[str, ...] = (),
             lost: str | None = None, **finish: Any) -> list[dict[str, Any]]:
    """A log of `agent` (oracle or nop; model null) that printed `lines` and ended `rc`."""
    log = LogBuilder()
    log.events[0]["data"].update(agent={"name": agent, "version": "1.0.0"}, model=None)
    log.launched().codex(list(lines))
    if lost is not None:
        return log.add("sandbox.lost", {"detail": lost}).events
    return log.finish(rc, **finish).events


# (agent, rc, options) → (rule, action, http, status, error, incomplete_reason, reward_valid)
R0_ROWS: list[tuple[str, int | None, dict[str, Any], tuple[Any, ...]]] = [
    ("oracle", 0, {}, ("scripted_agent", "verify", 200, "completed", None, None, True)),
    ("nop", 0, {}, ("scripted_agent", "verify", 200, "completed", None, None, True)),
    ("oracle", 3, {}, ("scripted_agent", "verify", 200, "failed",
                       "oracle exited with code 3", None, True)),
    ("oracle", None, {}, ("scripted_agent", "verify", 200, "failed",
                          "oracle exit status unknown", None, True)),
    ("nop", -9, {}, ("scripted_agent", "verify", 200, "failed", "nop exited with code -9",
                     None, True)),
    ("oracle", -15, {"timed_out": True}, ("scripted_agent", "verify", 200, "incomplete", None,
                                          "timeout", True)),
    # a Codex-like failure in its output changes nothing: no Codex rule is evaluated
    ("oracle", 1, {"lines": tuple(HTTP_429)}, ("scripted_agent", "verify", 200, "failed",
                                                "oracle exited with code 1", None, True)),
    ("oracle", 0, {"confirmed": False, "error": "1 process left"}, (
        "cleanup_unconfirmed", "retry", 502, "failed", "cleanup unconfirmed: 1 process left",
        None, False)),
    ("oracle", None, {"lost": "init died"}, ("sandbox_lost", "retry", 502, "failed",
                                             "sandbox lost: init died", None, False)),
]
NO_R0 = register_policy(Policy(name="test-custom-rules", rules=V1_RULES[:2]))


@pytest.mark.parametrize("policy", ["v1", "v2", "v3", NO_R0.name])
@pytest.mark.parametrize("agent, rc, options, expected", R0_ROWS)
def test_r0_decides_a_scripted_agent_by_its_exit(agent: str, rc: int | None,
                                                 options: dict[str, Any],
                                                 expected: tuple[Any, ...], policy: str) -> None:
    d = replay(scripted(agent, rc, **options), policy=policy).decision
    assert d is not None and d.policy == policy
    assert (d.rule, d.action, d.http_status, d.status, d.error, d.incomplete_reason,
            d.reward_valid) == expected
    if d.rule == "scripted_agent":
        assert d.cause is None and d.usage is not None
        assert d.usage.model_dump() == ZERO.model_dump()


@fast
@given(log=session_logs())
def test_a_codex_log_never_reaches_r0(log: list[dict[str, Any]]) -> None:
    """Any legal Codex log decides as if the scripted table did not exist."""
    for name in ("v1", "v2", "v3"):
        base = get_policy(name)
        trap = replace(base, name=f"{name}-trap", scripted_rules=(
            Rule(name="trap", when=lambda f: True, action="retry", http_status=None,
                 status="failed", cause=None, reward_valid=False),))
        assert [d.rule for d in replay(log, policy=trap).decisions] == [
            d.rule for d in replay(log, policy=base).decisions]
        assert "scripted_agent" not in [d.rule for d in replay(log, policy=base).decisions]
