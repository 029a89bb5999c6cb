"""Hypothesis properties of replay, close and the hash chain over random legal logs."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.logs import sample, session_logs
from trialledger.core import BadEvent, replay
from trialledger.core.canonical import canonical_text, chain, first_broken_link
from trialledger.core.parsing import event_dict, parse_event, parse_events, parse_stored
from trialledger.store import rederive

Log = list[dict[str, Any]]
CLOSE_AT = "2026-11-29T23:59:59Z"
fast = settings(max_examples=80, deadline=None)


@fast
@given(log=session_logs())
def test_replay_is_deterministic(log: Log) -> None:
    assert replay(log).model_dump(mode="json") == replay(log).model_dump(mode="json")


@fast
@given(log=session_logs())
def test_replaying_a_rederived_log_gives_the_same_view(log: Log) -> None:
    view = replay(log)
    again = replay([event_dict(e) for e in view.events])
    assert again.model_dump(mode="json") == view.model_dump(mode="json")
    evidence_only = [event_dict(e) for e in view.events if e.type != "outcome.decided"]
    assert replay(evidence_only).model_dump(mode="json") == view.model_dump(mode="json")


@fast
@given(log=session_logs())
def test_an_event_read_back_from_its_stored_text_is_the_event(log: Log) -> None:
    for event in replay(log).events:  # the store's fast path agrees with the checked one
        text = canonical_text(event_dict(event))
        assert parse_stored(text) == parse_event(event_dict(event)) == event


def _one_by_one(log: Log) -> list[Any] | str:
    """The reference: each event parsed alone, the first bad one named by its index."""
    parsed = []
    for index, raw in enumerate(log):
        try:
            parsed.append(parse_event(raw))
        except BadEvent as error:
            return str(error.at(index=index))
    return parsed


def _at_once(log: Log) -> list[Any] | str:
    try:
        return list(parse_events(log))
    except BadEvent as error:
        return str(error)


BREAKAGES: list[dict[str, Any]] = [
    {"schema": 99}, {"schema": 1}, {"type": "no.such"}, {"at": "yesterday"},
    {"position": 7}, {"data": 5}, {"seq": "x"}]


@fast
@given(log=session_logs(), data=st.data())
def test_a_log_parsed_at_once_is_the_log_parsed_event_by_event(
        log: Log, data: st.DataObject) -> None:
    assert _at_once(log) == _one_by_one(log)
    index = data.draw(st.integers(0, len(log) - 1))
    changed = data.draw(st.lists(st.sampled_from(BREAKAGES), min_size=1, max_size=2))
    bad = [*log[:index], {**log[index], **{k: v for c in changed for k, v in c.items()}},
           *log[index + 1:]]
    assert _at_once(bad) == _one_by_one(bad)  # the same events, or the same error


@fast
@given(log=session_logs())
def test_every_prefix_of_a_valid_log_folds(log: Log) -> None:
    for end in range(1, len(log) + 1):
        view = replay(log[:end])
        assert view.events[-1].seq == len(view.events)


@fast
@given(log=session_logs(), data=st.data())
def test_closing_after_any_prefix_keeps_every_observation(log: Log, data: st.DataObject) -> None:
    end = data.draw(st.integers(1, len(log)))
    before = replay(log[:end])
    assume(before.state != "closed")
    after = replay([*log[:end], sample("session.closed", CLOSE_AT)])
    kept, now = before.observations, after.observations
    assert now.invocation.conversation == kept.invocation.conversation
    assert now.tool_calls == kept.tool_calls
    gaps_now = [g.model_dump() for g in now.gaps]
    assert all(g.model_dump() in gaps_now for g in kept.gaps)
    assert [e.model_dump() for e in after.events[: len(before.events)]] == [
        e.model_dump() for e in before.events
    ]


def _links(log: Log) -> tuple[list[tuple[int, str, str]], int, str]:
    events = replay(log).events
    texts = [canonical_text(event_dict(e)) for e in events]
    hashes = chain(texts)
    return [(e.seq or 0, t, h) for e, t, h in zip(events, texts, hashes, strict=True)], len(
        events), hashes[-1]


@fast
@given(log=session_logs(), data=st.data())
def test_chain_detects_any_single_tampering(log: Log, data: st.DataObject) -> None:
    links, head_seq, head_hash = _links(log)
    assert first_broken_link(links, head_seq=head_seq, head_hash=head_hash) is None
    i = data.draw(st.integers(0, len(links) - 1))
    how = data.draw(st.sampled_from(["alter", "remove", "insert", "swap"]))
    tampered = list(links)
    seq, text, digest = links[i]
    if how == "alter":
        tampered[i] = (seq, text.replace('"at":"2026', '"at":"2027', 1), digest)
    elif how == "remove":
        del tampered[i]
    elif how == "insert":
        tampered.insert(i, links[i])
    else:
        j = data.draw(st.integers(0, len(links) - 1).filter(lambda j: j != i)) if len(
            links) > 1 else i
        assume(i != j)  # a one-event log has nothing to swap with
        tampered[i], tampered[j] = tampered[j], tampered[i]
    assert first_broken_link(tampered, head_seq=head_seq, head_hash=head_hash) is not None


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@fast
@given(data=JSON_VALUES, at=st.text(), kind=st.text(), seq=st.integers(1, 10**9))
def test_canonical_text_is_sorted_compact_json(data: Any, at: str, kind: str, seq: int) -> None:
    fields = {"session_id": "s", "seq": seq, "event_id": "e", "type": kind, "at": at,
              "data": data, "schema": 1, "position": 3}  # a store field is left out
    expected = json.dumps({k: v for k, v in fields.items() if k != "position"},
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    assert canonical_text(fields) == expected


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_text_refuses_what_json_cannot_say(bad: float) -> None:
    fields = {"session_id": "s", "seq": 1, "event_id": "e", "type": "t", "at": "a",
              "data": {"x": [bad]}, "schema": 1}
    with pytest.raises(ValueError, match="not JSON compliant"):
        canonical_text(fields)


@fast
@given(sessions=st.integers(0, 5000), processes=st.integers(1, 16))
def test_runs_of_chunks_cover_every_session_once_in_order(sessions: int, processes: int
                                                          ) -> None:
    ids = [f"{n:08d}" for n in range(sessions)]
    parts = rederive.chunks(ids, processes)
    batches = rederive.runs(parts, processes)
    assert [sid for batch in batches for part in batch for sid in part] == ids
    assert len(batches) <= processes * rederive.CHUNKS_PER_PROCESS
    assert all(batch and all(part for part in batch) for batch in batches)
    assert all(len(part) <= rederive.MAX_CHUNK for part in parts)


LOOSE_TIMESTAMP = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|\+00:00)"  # any digits


def _with_at(at: str) -> dict[str, Any]:
    return {"type": "session.closed", "at": at, "data": {"reason": "normal"}}


@settings(max_examples=300, deadline=None)
@given(at=st.from_regex(LOOSE_TIMESTAMP, fullmatch=True))
def test_every_time_an_event_takes_is_a_real_instant(at: str) -> None:
    """What `show`, the view and policy v3 read back with `datetime.fromisoformat` (an
    imported `2026-02-30` once crashed `show`): accepted only when it is a real instant."""
    try:
        real = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError:
        real = None
    if real is None or not at.isascii():
        with pytest.raises(BadEvent, match="is not an RFC 3339 UTC timestamp"):
            parse_event(_with_at(at))
    else:
        assert parse_event(_with_at(at)).at == at


@settings(max_examples=300, deadline=None)
@given(moment=st.datetimes(min_value=datetime(1, 1, 1), timezones=st.just(UTC)),
       digits=st.integers(0, 9), suffix=st.sampled_from(["Z", "+00:00"]))
def test_every_real_instant_is_taken(moment: datetime, digits: int, suffix: str) -> None:
    fraction = f".{moment.microsecond:06d}000"[: digits + 1] if digits else ""
    at = moment.strftime("%Y-%m-%dT%H:%M:%S").rjust(19, "0") + fraction + suffix
    assert parse_event(_with_at(at)).at == at
