"""SPEC §1: the transition table, decisions emitted by the machine, replay divergence."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings

from tests.logs import sample, session_logs
from tests.scenarios import CLEAN, SCENARIOS, LogBuilder, run
from trialledger.core import IllegalTransition, replay
from trialledger.core.canonical import event_id_for
from trialledger.core.events import EVENT_TYPES
from trialledger.core.machine import STATES, TRANSITIONS, Session, State
from trialledger.core.parsing import parse_event
from trialledger.core.policy import POLICIES, V2, Policy, register_policy

# A log prefix that leaves a session in each state.
REACH = {
    "seeded": LogBuilder().events,
    "starting": LogBuilder().launched().events,
    "running": LogBuilder().launched().codex(CLEAN[:3]).events,
    "failed-live": SCENARIOS["bad_request_killed"][0].events,
    "graded": SCENARIOS["clean"][0].events,
    "lost": SCENARIOS["http_429"][0].events,
    "closed": LogBuilder().add("session.closed", {"reason": "cancelled"}).events,
}


def _session(events: list[dict[str, Any]]) -> Session:
    session = Session("s-1")
    for e in events:
        session.apply(parse_event(e))
    return session


def test_every_state_is_reached_by_its_prefix() -> None:
    assert {s: _session(e).state for s, e in REACH.items()} == {s: s for s in STATES}


PREFIXES = [*REACH.values(), *(b.events for b, _ in SCENARIOS.values())]


@pytest.mark.parametrize("state", STATES)
def test_every_table_entry_is_live(state: State) -> None:
    """Each (state, type) entry accepts its event from at least one reachable log."""
    prefixes = [p for p in PREFIXES if _session(p).state == state]
    for kind in TRANSITIONS[state]:
        if kind == "outcome.decided":
            continue
        accepted = 0
        for prefix in prefixes:
            try:
                _session(prefix).apply(parse_event(sample(kind)))
                accepted += 1
            except IllegalTransition:
                pass
        assert accepted, f"{state} + {kind} is a dead entry"


def test_decisions_reach_every_target_state() -> None:
    sources = {(SCENARIOS[n][0].events and _session(SCENARIOS[n][0].events).state)
               for n in SCENARIOS}
    assert {"graded", "lost", "failed-live"} <= sources
    seeded_lost = _session(LogBuilder().add("sandbox.lost", {"detail": "gone"}).events)
    assert seeded_lost.state == "lost" and seeded_lost.decisions[0].rule == "sandbox_lost"


@pytest.mark.parametrize("kind", ["agent.exited", "cleanup.reported"])
def test_once_only_events_are_refused_the_second_time(kind: str) -> None:
    session = _session(LogBuilder().launched().codex(CLEAN[:3]).events)
    event = parse_event(sample(kind))
    session.apply(event)
    before = list(session.events)
    with pytest.raises(IllegalTransition, match="only once"):
        session.apply(event)
    assert session.events == before


@pytest.mark.parametrize("first, second", [
    ("verification.recorded", "verification.failed"),
    ("verification.failed", "verification.recorded"),
    ("verification.recorded", "verification.recorded"),
])
def test_a_graded_session_takes_one_verification(first: str, second: str) -> None:
    session = _session(SCENARIOS["clean"][0].events)
    session.apply(parse_event(sample(first)))
    before = list(session.events)
    with pytest.raises(IllegalTransition, match="only once"):
        session.apply(parse_event(sample(second)))
    assert session.events == before


def test_illegal_transition_names_state_type_and_allowed_and_appends_nothing() -> None:
    session = _session(LogBuilder().events)
    with pytest.raises(IllegalTransition) as caught:
        session.apply(parse_event({"type": "turn.started", "at": "2026-11-29T10:00:00Z",
                                   "data": {}}))
    message = str(caught.value)
    assert "'turn.started'" in message and "'seeded'" in message
    assert "agent.launched" in message and caught.value.state == "seeded"
    assert session.head_seq == 1


def test_a_harness_never_writes_outcome_decided() -> None:
    events = SCENARIOS["clean"][0].events
    decided = replay(events).events[-1]
    session = _session(events[:-1])
    with pytest.raises(IllegalTransition, match="written by the machine"):
        session.apply(decided)


def test_decision_is_emitted_with_the_trigger_at_and_a_reproducible_id() -> None:
    view = replay(SCENARIOS["clean"][0].events)
    decided, trigger = view.events[-1], view.events[-2]
    assert decided.type == "outcome.decided" and trigger.type == "cleanup.reported"
    assert decided.at == trigger.at
    assert decided.event_id == event_id_for(view.session_id, decided.seq or 0)
    assert view.events == replay(SCENARIOS["clean"][0].events).events


def test_exited_and_cleanup_may_come_in_either_order() -> None:
    b = LogBuilder().launched().codex(CLEAN)
    b.add("cleanup.reported", {"confirmed": True}).add(
        "agent.exited", {"return_code": 0, "timed_out": False})
    view = replay(b.events)
    assert view.decision is not None and view.decision.rule == "completed"


def test_replay_divergence_keeps_later_events_unapplied() -> None:
    # Recorded under a policy that probed; v1 re-derives retry (the opt-in is off).
    recorded = replay(SCENARIOS["bad_request_killed"][0].events)
    log = [e.model_dump(mode="json") for e in recorded.events]
    log[0]["data"]["settings"]["verify_after_agent_error"] = False
    log[0]["session_id"] = recorded.session_id
    log.append({"type": "sandbox.probed", "at": "2026-11-29T10:00:00Z",
                "data": {"alive": True, "detail": "ok"}})
    log.append({"type": "session.closed", "at": "2026-11-29T10:00:01Z",
                "data": {"reason": "normal"}})
    view = replay(log)
    assert view.diverged_at is not None and view.diverged_at.recorded is not None
    assert view.diverged_at.recorded.action == "probe"
    assert view.diverged_at.derived is not None and view.diverged_at.derived.action == "retry"
    assert view.diverged_at.seq == recorded.events[-1].seq
    assert [e.type for e in view.unapplied] == ["sandbox.probed"]
    assert view.state == "closed" and view.outcome == "retry"


def test_before_divergence_an_illegal_event_raises() -> None:
    # Before any decision: the machine refuses exactly as a live append would.
    log = [*SCENARIOS["http_429"][0].events[:2],
           {"type": "sandbox.probed", "at": "2026-11-29T10:00:00Z", "data": {"alive": True}}]
    with pytest.raises(IllegalTransition) as caught:
        replay(log)
    assert caught.value.index == len(log) - 1


@pytest.fixture
def no_probe() -> Iterator[str]:
    """A registered policy that never probes, removed after the test."""
    policy = register_policy(Policy(name="test-no-probe",
                                    rules=tuple(r for r in V2.rules if r.name != "probe")))
    yield policy.name
    del POLICIES[policy.name]


def test_an_evidence_only_log_under_another_policy_diverges_with_nothing_recorded(
        no_probe: str) -> None:
    # Recorded without decisions by a harness whose policy probed; the replay's own
    # decision (retry) makes the probe inapplicable: a divergence, not an error (SPEC §3).
    log = [e for e in SCENARIOS["recovered_then_killed_probe"][0].events
           if e["type"] != "outcome.decided"]
    assert "sandbox.probed" in [e["type"] for e in log]
    view = replay(log, policy=no_probe)
    assert view.diverged_at is not None and view.diverged_at.recorded is None
    assert view.diverged_at.derived is not None and view.diverged_at.derived.action == "retry"
    assert "sandbox.probed" in [e.type for e in view.unapplied]
    assert view.outcome == "retry"


def test_outcomes() -> None:
    graded = SCENARIOS["clean"][0]
    close = {"type": "session.closed", "at": "2026-11-29T10:00:00Z", "data": {"reason": "normal"}}
    assert replay(graded.events).outcome == "pending"
    assert replay([*graded.events, close]).outcome == "unverified"
    rec = {"type": "verification.recorded", "at": "2026-11-29T10:00:00Z",
           "data": {"rewards": {"reward": 1}, "detail": None}}
    view = replay([*graded.events, rec, close])
    assert (view.outcome, view.rewards) == ("verify", {"reward": 1.0})
    assert replay(SCENARIOS["http_429"][0].events).outcome == "retry"
    assert replay([*LogBuilder().events, close]).outcome == "interrupted"
    probing = SCENARIOS["bad_request_killed"][0].events
    assert replay([*probing, close]).outcome == "interrupted"
    gaps = [g.code for g in replay([*probing, close]).observations.gaps]
    assert "agent_activation_interrupted" in gaps


@settings(max_examples=40, deadline=None)
@given(log=session_logs())
def test_nothing_folds_after_closed(log: list[dict[str, Any]]) -> None:
    if replay(log).state != "closed":
        log = [*log, sample("session.closed", "2026-11-29T11:00:00Z")]
    session = _session(log)
    for kind in EVENT_TYPES:
        with pytest.raises(IllegalTransition):
            session.apply(parse_event(sample(kind, "2026-11-29T11:00:01Z")))


def test_run_helper_is_consistent() -> None:
    assert replay(run(CLEAN, 0).events).state == "graded"


def test_a_log_without_session_ids_gets_uuid5_of_its_seed_data() -> None:
    import json
    import uuid

    from trialledger.core.canonical import NS

    log = SCENARIOS["clean"][0].events
    seed_data = log[0]["data"]
    expected = uuid.uuid5(NS, json.dumps(seed_data, sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=False))
    assert "session_id" not in log[0]
    assert replay(log).session_id == str(expected)
    partial = {k: v for k, v in seed_data.items() if k not in ("settings", "grants")}
    bare = [{**log[0], "data": partial}, *log[1:]]  # defaults left out, as a user writes it
    assert replay(bare).session_id == str(uuid.uuid5(NS, json.dumps(
        partial, sort_keys=True, separators=(",", ":"), ensure_ascii=False)))
