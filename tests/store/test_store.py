"""The store conformance suite: every case runs on a SQLite file and on a real PostgreSQL."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import text
from sqlalchemy.util import await_

from tests.scenarios import SCENARIOS, run_of, seed_data, seed_of
from trialledger.core import BadEvent, IllegalTransition, SeedRejected, replay
from trialledger.store import (
    ConcurrencyConflict,
    EventIdConflict,
    Ledger,
    SchemaOutOfDate,
    migrate,
)
from trialledger.store.engine import PING_IDLE_S, open_engines
from trialledger.store.writer import Writer

pytestmark = pytest.mark.anyio


async def raw(ledger: Ledger, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    async with ledger._engines.writer.begin() as conn:
        result = await conn.execute(text(sql), params)
        return [tuple(r) for r in result.all()] if result.returns_rows else []


async def test_a_run_is_stored_with_its_decision_in_the_same_append(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        seeded = await ledger.seed(seed_data())
        stored = await ledger.append(seeded.session_id, run_of("clean"), expected_seq=1)
        assert [s.event.seq for s in stored] == list(range(2, 11))
        assert stored[-1].event.type == "outcome.decided"
        positions = [s.position for s in stored]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        view = await ledger.view(seeded.session_id)
        assert (view.state, view.decision.rule if view.decision else None) == (
            "graded", "completed")
        assert view.model_dump() == replay([s.event for s in await ledger.events(
            seeded.session_id)]).model_dump()


async def test_stale_expected_seq_is_a_conflict_and_appends_nothing(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean")[:1], expected_seq=1)
        with pytest.raises(ConcurrencyConflict) as caught:
            await ledger.append(sid, run_of("clean")[1:2], expected_seq=1)
        assert (caught.value.expected, caught.value.actual) == (1, 2)
        assert len(await ledger.events(sid)) == 2


async def test_event_id_is_idempotent_and_conflicts_on_other_content(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        launched = {**run_of("clean")[0], "event_id": "launch-1"}
        (first,) = await ledger.append(sid, [launched])
        (again,) = await ledger.append(sid, [launched], expected_seq=1)  # stale, yet a no-op
        assert (again.position, again.hash) == (first.position, first.hash)
        other = {**launched, "at": "2026-11-29T09:00:00Z"}
        with pytest.raises(EventIdConflict):
            await ledger.append(sid, [other])
        second = (await ledger.seed(seed_data())).session_id
        with pytest.raises(EventIdConflict):
            await ledger.append(second, [launched])
        assert len(await ledger.events(sid)) == 2
        assert len(await ledger.events(second)) == 1


async def test_repeated_events_return_what_was_stored_in_the_order_asked(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        run = [{**event, "event_id": f"e{n}"} for n, event in enumerate(run_of("clean")[:4])]
        first = await ledger.append(sid, run[:3])
        async with await Ledger.open(db) as again:  # nothing cached: read back
            repeated = await again.append(sid, [run[2], run[0]])
            assert [(s.position, s.hash, s.event.seq) for s in repeated] == [
                (s.position, s.hash, s.event.seq) for s in (first[2], first[0])]
        results: list[list[Any]] = []

        async def append() -> None:
            results.append(await ledger.append(sid, [run[3], run[1]]))
        async with anyio.create_task_group() as tg:  # both in one commit
            tg.start_soon(append)
            tg.start_soon(append)
        one, two = ({s.event.seq: (s.position, s.hash) for s in r} for r in results)
        assert one == two and sorted(one) == [3, 5]  # run[3] stored once, as seq 5
        assert len(await ledger.events(sid)) == 5


async def until(condition: Any) -> None:
    """Wait (at most 10 s) until `condition()` holds."""
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.005)


LAUNCH, TURN = run_of("clean")[:2]
DROPPED = {**TURN, "at": "2026-11-29T08:00:09Z"}  # what a cancelled caller appends


@contextlib.asynccontextmanager
async def a_held_commit(tmp_path: Path) -> AsyncIterator[tuple[Ledger, str, Any]]:
    """A seeded store whose next commit waits on a SQLite write lock held elsewhere:
    (the ledger, the session, a function that lets the lock go)."""
    db = str(tmp_path / "s.db")
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            yield ledger, sid, lambda: blocker.execute("ROLLBACK")
        finally:
            blocker.close()


async def after_the_seed(ledger: Ledger, sid: str) -> list[tuple[int | None, str]]:
    return [(s.event.seq, s.event.at) for s in (await ledger.events(sid))[1:]]


async def test_a_cancelled_waiting_append_writes_nothing_and_holds_no_one_up(
        tmp_path: Path) -> None:
    """A caller cancelled while its append waits behind a commit: its event is not written,
    and the callers queued after it are still served (the lead once passed to it stalled)."""
    async with a_held_commit(tmp_path) as (ledger, sid, release):
        writer = ledger._writer
        gone = anyio.Event()
        waiting = anyio.CancelScope()

        async def cancelled() -> None:
            with waiting:
                await ledger.append(sid, [DROPPED])
            gone.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ledger.append, sid, [LAUNCH])
                await until(lambda: writer.queue.leading and not writer.queue.pending)
                tg.start_soon(cancelled)
                await until(lambda: len(writer.queue.pending) == 1)
                waiting.cancel()
                await gone.wait()
                tg.start_soon(ledger.append, sid, [TURN])
                await until(lambda: any(r.events[0].at == TURN["at"] for r in writer.queue.pending))
                release()
        assert await after_the_seed(ledger, sid) == [(2, LAUNCH["at"]), (3, TURN["at"])]


async def test_a_caller_cancelled_just_as_it_is_handed_the_lead_passes_it_on(
        tmp_path: Path) -> None:
    """The leader finishes and hands the lead to the oldest waiter, which is cancelled as
    it takes it (before its batch): its event is not written, and the lead goes on to the
    next waiter (it had handed the lead to itself, and every caller behind it waited)."""
    async with a_held_commit(tmp_path) as (ledger, sid, release):
        writer = ledger._writer
        waiting = anyio.CancelScope()

        async def lead() -> None:
            await ledger.append(sid, [LAUNCH])  # returns in the step that hands the lead on
            waiting.cancel()  # so the next waiter is cancelled as it takes it

        async def cancelled() -> None:
            with waiting:
                await ledger.append(sid, [DROPPED])

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lead)
                await until(lambda: writer.queue.leading and not writer.queue.pending)
                tg.start_soon(cancelled)
                await until(lambda: len(writer.queue.pending) == 1)
                tg.start_soon(ledger.append, sid, [TURN])
                await until(lambda: len(writer.queue.pending) == 2)
                release()
        assert waiting.cancelled_caught
        assert await after_the_seed(ledger, sid) == [(2, LAUNCH["at"]), (3, TURN["at"])]


async def test_an_append_is_all_or_nothing(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        events = run_of("clean")
        with pytest.raises(IllegalTransition):
            await ledger.append(sid, [events[0], events[0]])  # a second launch is illegal
        with pytest.raises(BadEvent) as caught:
            await ledger.append(sid, [events[0], {"type": "agent.exited", "at": "x"}])
        assert caught.value.index == 1
        with pytest.raises(IllegalTransition):
            await ledger.append(sid, [events[-1]])  # one event, refused by `seeded`
        assert len(await ledger.events(sid)) == 1
        await ledger.append(sid, events, expected_seq=1)  # the session is still usable
        assert (await ledger.view(sid)).state == "graded"


async def test_a_rejected_seed_leaves_nothing(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        with pytest.raises(SeedRejected):
            await ledger.seed(seed_data(settings={"timeout_s": -1}))
        with pytest.raises(SeedRejected):
            await ledger.seed(seed_data(attempt=0))
        assert await ledger.sessions() == []
        assert await ledger.tail() == []


async def test_concurrent_appends_are_group_committed(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sids = [(await ledger.seed(seed_data())).session_id for _ in range(20)]

        async def drive(sid: str) -> None:
            for event in run_of("clean"):
                await ledger.append(sid, [event])

        async with anyio.create_task_group() as tg:
            for sid in sids:
                tg.start_soon(drive, sid)
        rows = await raw(ledger, "SELECT count(*), count(DISTINCT recorded_at) FROM events")
        total, commits = rows[0]
        assert total == 20 * 10
        assert commits < total / 2  # many appends shared each transaction
        assert {r["state"] for r in await ledger.sessions()} == {"graded"}
        assert (await ledger.audit()).ok


async def test_tail_reads_every_event_in_position_order(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        a = (await ledger.seed(seed_data())).session_id
        b = (await ledger.seed(seed_data())).session_id
        await ledger.append(a, run_of("clean")[:3])
        await ledger.append(b, run_of("http_429"))
        everything = await ledger.tail()
        assert [e.position for e in everything] == sorted(e.position for e in everything)
        assert len(everything) == 1 + 3 + 1 + len(run_of("http_429")) + 1
        later = await ledger.tail(everything[3].position, limit=2)
        assert [e.position for e in later] == [e.position for e in everything[4:6]]


async def test_projections_fill_the_analyst_views(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("tool_call"))
        await ledger.append(sid, [{"type": "verification.recorded", "at": "2026-11-29T09:00:00Z",
                                   "data": {"rewards": {"reward": 1, "style": 0.5}}}])
        await ledger.close(sid)
        (session,) = await ledger.sessions()
        assert (session["state"], session["outcome"], session["close_reason"]) == (
            "closed", "verify", "normal")
        assert session["head_seq"] == len(await ledger.events(sid))
        outcome = await raw(ledger, "SELECT rule, action, outcome, total_tokens, reward_valid "
                                    "FROM outcomes")
        assert outcome == [("completed", "verify", "verify", 30, True)]
        assert await raw(ledger, "SELECT name, kind, status FROM tool_calls") == [
            ("exec_command", "command_execution", "completed")]
        rewards = await raw(ledger, "SELECT name, value FROM rewards ORDER BY name")
        assert rewards == [("reward", 1.0), ("style", 0.5)]
        gaps = {code for (code,) in await raw(ledger, "SELECT code FROM gaps")}
        assert "cached_token_usage_unavailable" in gaps
        assert await raw(ledger, "SELECT count(*), max(seq) FROM decisions") == [(1, 12)]


async def test_rebuild_projections_gives_identical_rows(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        for name in ("clean", "http_429", "recovered_then_killed_probe", "timeout"):
            sid = (await ledger.seed(seed_of(name))).session_id
            await ledger.append(sid, run_of(name))
        tables = ("sessions", "decision_log", "tool_calls", "gaps", "rewards")

        async def snapshot() -> dict[str, list[tuple[Any, ...]]]:
            return {t: sorted(await raw(ledger, f"SELECT * FROM {t}"), key=repr) for t in tables}

        before = await snapshot()
        assert await ledger.rebuild_projections() == 4
        assert await snapshot() == before


async def test_audit_passes_then_names_the_first_tampered_event(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean"))
        assert (await ledger.audit()).ok
        await raw(ledger, "UPDATE events SET data = replace(data, 'hi there', 'bye') "
                          "WHERE seq = 6")
        report = await ledger.audit()
        assert report.fault is not None and "seq 6" in report.fault and sid in report.fault


@pytest.mark.parametrize("tamper, expected", [
    ("DELETE FROM events WHERE seq = (SELECT max(seq) FROM events)", "head"),
    ("DELETE FROM events WHERE seq = 4", "seq 5"),
    ("UPDATE events SET seq = seq + 100 WHERE seq = 3", "expected seq 3"),
    ("UPDATE events SET seq = 1003 WHERE seq = 3; UPDATE events SET seq = 3 WHERE seq = 4;"
     " UPDATE events SET seq = 4 WHERE seq = 1003", "reordered"),
    ("UPDATE events SET data = (SELECT data FROM events WHERE seq = 4) WHERE seq = 5",
     "seq 5"),
])
async def test_audit_detects_removed_reordered_and_moved_events(
        db: str, tamper: str, expected: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean"))
        for statement in tamper.split(";"):
            await raw(ledger, statement)
        report = await ledger.audit()
        assert report.fault is not None and expected in report.fault


@pytest.mark.parametrize("column, value", [
    ("type", "'verification.recorded'"), ("at", "'2020-01-01T00:00:00Z'"),
    ("event_id", "'forged'"), ("schema", "7"),
])
async def test_audit_names_a_column_altered_outside_the_hash(
        db: str, column: str, value: str) -> None:
    """SQL reads an event's type, time, id and schema from columns of their own, which
    the hash does not cover: a copy that disagrees with the hashed text is a fault."""
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean"))
        await raw(ledger, f"UPDATE events SET {column} = {value} WHERE seq = 3")
        report = await ledger.audit()
        assert report.fault is not None, column
        assert f"{sid}: event at seq 3: its {column} column" in report.fault


@pytest.mark.parametrize("tamper", [
    "DELETE FROM events WHERE seq = (SELECT max(seq) FROM events); "
    "UPDATE sessions SET head_seq = head_seq - 1",  # the last event cut, its head moved back
    "UPDATE sessions SET head_hash = '" + "0" * 64 + "'",  # the head's hash alone altered
])
async def test_audit_compares_the_heads_hash_not_only_its_seq(db: str, tamper: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean"))
        for statement in tamper.split(";"):
            await raw(ledger, statement)
        report = await ledger.audit()
        assert report.fault is not None and f"session {sid}: head" in report.fault


async def test_audit_detects_an_inserted_event(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean"))
        await raw(ledger, "UPDATE events SET seq = seq + 1000 WHERE seq >= 5")
        await raw(ledger, "UPDATE events SET seq = seq - 999 WHERE seq >= 1000")
        await raw(ledger, "INSERT INTO events (session_id, seq, event_id, type, at, recorded_at,"
                          " schema, data, hash) SELECT session_id, 5, 'forged', type, at,"
                          " recorded_at, schema, data, hash FROM events WHERE seq = 4")
        report = await ledger.audit()
        assert report.fault is not None and "seq 5" in report.fault


async def test_recover_closes_only_that_runners_open_sessions(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        mine = (await ledger.seed(seed_data(runner_id="a"))).session_id
        await ledger.append(mine, run_of("clean")[:3])
        graded = (await ledger.seed(seed_data(runner_id="a"))).session_id
        await ledger.append(graded, run_of("clean"))
        theirs = (await ledger.seed(seed_data(runner_id="b"))).session_id
        assert sorted(await ledger.recover("a")) == sorted([mine, graded])
        view = await ledger.view(mine)
        assert (view.state, view.outcome) == ("closed", "retry")
        assert view.decision is not None
        assert view.decision.error == "sandbox lost: harness restarted"
        assert view.observations.invocation.conversation[0].text == "say hi"
        assert (await ledger.view(graded)).outcome == "unverified"
        assert (await ledger.view(theirs)).state == "seeded"
        assert await ledger.recover(None, all_runners=True) == [theirs]


async def test_export_then_import_elsewhere_gives_the_same_view(db: str, tmp_path: Any) -> None:
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_of("recovered_then_killed_probe"))).session_id
        await ledger.append(sid, run_of("recovered_then_killed_probe"))
        exported = await ledger.export(sid)
        assert {"position", "recorded_at", "hash", "event_id", "schema"} <= set(exported[0])
    async with await Ledger.open(str(tmp_path / "other.db")) as other:
        assert await other.import_log(exported) == sid
        assert (await other.view(sid)).model_dump() == replay(exported).model_dump()
        assert await other.import_log(exported) == sid  # the same log again: a no-op
        assert len(await other.events(sid)) == len(exported)


async def test_an_open_imported_session_is_folded_as_the_store_reloads_it(db: str) -> None:
    """A log decided under v2 whose seed names no policy: the import re-derives it under
    v2 (its recorded decisions' policy), but the store folds it under the seed's (v1)
    whenever it reads it back, so the open session it keeps must be folded that way too,
    or later appends would be judged by whichever fold happened to be in memory."""
    log = replay(SCENARIOS["clean"][0].events, policy="v2").model_dump(mode="json")["events"]
    assert log[0]["data"]["settings"].get("policy") is None
    assert "session.closed" not in {e["type"] for e in log}  # open: the writer keeps it
    assert {e["data"]["policy"] for e in log if e["type"] == "outcome.decided"} == {"v2"}
    async with await Ledger.open(db) as ledger:
        sid = await ledger.import_log(log)
        cached = ledger._writer.open[sid].session
        reloaded = await ledger._engines.read(lambda conn: Writer.load(conn, sid).session)
        assert cached.policy.name == reloaded.policy.name
        assert [e.seq for e in cached.events] == [e.seq for e in reloaded.events]


async def test_import_refuses_a_log_whose_decisions_diverge(db: str) -> None:
    log = replay(SCENARIOS["bad_request_killed"][0].events).model_dump(mode="json")["events"]
    log[0]["data"]["settings"]["verify_after_agent_error"] = False
    async with await Ledger.open(db) as ledger:
        with pytest.raises(IllegalTransition, match="is not what policy v1 derives"):
            await ledger.import_log(log)
        assert await ledger.sessions() == []


async def test_another_writer_is_noticed_before_the_next_append(db: str) -> None:
    async with await Ledger.open(db) as first, await Ledger.open(db) as second:
        sid = (await first.seed(seed_data())).session_id
        events = run_of("clean")
        await first.append(sid, events[:2])
        await second.append(sid, events[2:4], expected_seq=3)
        with pytest.raises(ConcurrencyConflict):
            await first.append(sid, events[4:], expected_seq=3)
        await first.append(sid, events[4:], expected_seq=5)
        assert (await first.view(sid)).state == "graded"
        assert (await first.audit()).ok


@contextlib.contextmanager
def after_the_fold(ledger: Ledger, meanwhile: Any) -> Any:
    """Await `meanwhile()` once, as another process would run it, in the gap between the
    writer's fold of its next batch and the writers' lock it writes that batch under."""
    writer, fold = ledger._writer, ledger._writer._prepare
    pending = [meanwhile]

    def folded_then_meanwhile(*args: Any) -> Any:
        prepared = fold(*args)
        while pending:
            job = pending.pop()
            if ledger.dialect == "sqlite":  # the fold ran on a worker thread
                anyio.from_thread.run(job)
            else:  # in SQLAlchemy's greenlet, inside the event loop
                await_(job())
        return prepared

    setattr(writer, "_prepare", folded_then_meanwhile)  # noqa: B010 (mypy: no method assignment)
    try:
        yield
    finally:
        del writer._prepare
    assert not pending  # the gap was reached


def returns_of(obj: Any, name: str) -> list[Any]:
    """What each later call of `obj.<name>` returns, recorded (the method works as before)."""
    method, returned = getattr(obj, name), []

    def recording(*args: Any, **kwargs: Any) -> Any:
        returned.append(method(*args, **kwargs))
        return returned[-1]

    setattr(obj, name, recording)
    return returned


async def test_a_session_moved_between_the_fold_and_the_write_is_folded_again(
        db: str) -> None:
    """A writer folds its batch before it takes the writers' lock; if another process
    appends to the same session in between, the batch is folded again under the lock: an
    append that expected the old head is refused, one that expected nothing follows the
    other's events. (Writing the first fold would give two events one seq.)"""
    async with await Ledger.open(db) as first, await Ledger.open(db) as second:
        sid = (await first.seed(seed_data())).session_id
        events = run_of("clean")
        await first.append(sid, events[:2])
        with after_the_fold(first, lambda: second.append(sid, events[2:3])), \
                pytest.raises(ConcurrencyConflict):
            await first.append(sid, events[3:4], expected_seq=3)
        with after_the_fold(first, lambda: second.append(sid, events[3:4])):
            (stored,) = await first.append(sid, events[4:5])
        assert stored.event.seq == 6
        assert [s.event.type for s in await first.events(sid)] == [
            "session.seeded", *(e["type"] for e in events[:5])]
        assert (await first.audit()).ok


async def test_an_event_id_taken_between_the_fold_and_the_write_is_refused(db: str) -> None:
    """Another process stores an event under the id an append gives, after the append's
    fold found the id free: the batch is folded again under the lock, and the append is
    refused with `EventIdConflict`, writing nothing. Ids the append does not give, stored in
    that gap, leave its fold as it was."""
    async with await Ledger.open(db) as first, await Ledger.open(db) as second:
        mine = (await first.seed(seed_data())).session_id
        theirs = (await second.seed(seed_data())).session_id
        launched, started, item = run_of("clean")[:3]
        await first.append(mine, [launched])
        await second.append(theirs, [launched])
        folds = returns_of(first._writer, "_fold")
        with after_the_fold(first, lambda: second.append(
                theirs, [{**started, "event_id": "taken"}])), pytest.raises(EventIdConflict):
            await first.append(mine, [{**started, "event_id": "taken"}])
        assert len(folds) == 2 and len(await first.events(mine)) == 2
        folds.clear()
        with after_the_fold(first, lambda: second.append(
                theirs, [{**item, "event_id": "theirs"}])):
            (stored,) = await first.append(mine, [{**started, "event_id": "mine"}])
        assert len(folds) == 1 and stored.event.seq == 3
        assert (await first.audit()).ok


async def test_a_writer_that_fell_far_behind_forgets_its_cache_instead_of_listing_it(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer idle while others appended more than `CATCH_UP_ROWS` events does not list
    them under the writers' lock (it could be millions of ids): it forgets every cached
    session and treats every given id as possibly taken, and so still refuses a stale
    expectation and an id taken meanwhile."""
    from trialledger.store import writer as writer_module

    monkeypatch.setattr(writer_module, "CATCH_UP_ROWS", 2)
    async with await Ledger.open(db) as first, await Ledger.open(db) as second:
        mine = (await first.seed(seed_data())).session_id
        shared = (await first.seed(seed_data())).session_id
        launched, started, item = run_of("clean")[:3]
        await first.append(mine, [launched])
        await first.append(shared, [launched])
        caught = returns_of(first._writer, "_catch_up")
        await second.append(shared, [started, item])  # two: listed
        with pytest.raises(ConcurrencyConflict):
            await first.append(shared, [started], expected_seq=2)
        assert caught[0].sessions == {shared} and caught[0].ids is not None  # under the lock
        theirs = (await second.seed(seed_data())).session_id
        await second.append(theirs, [launched, {**started, "event_id": "taken"}])  # three
        caught.clear()
        with pytest.raises(EventIdConflict):
            await first.append(mine, [{**started, "event_id": "taken"}])
        assert caught[0].ids is None and caught[0].sessions == {mine, shared}  # all forgotten
        assert len(await first.events(mine)) == 2 and (await first.audit()).ok


async def test_a_lease_taken_over_between_the_fold_and_the_write_fences_the_append(
        tmp_path: Path) -> None:
    """On SQLite the fold reads a snapshot taken before the write lock: a trial's lease
    taken over after it is still caught, under the lock, and nothing of the old holder's
    is stored. (On PostgreSQL the fold reads the lease `FOR SHARE` in the transaction
    that writes, so a takeover waits for the append's commit instead.)"""
    from trialledger.core.seed import validate_seed
    from trialledger.store import LeaseLost
    from trialledger.store.jobs import Jobs

    db = str(tmp_path / "fenced.db")
    async with await Ledger.open(db) as ledger, await Ledger.open(db) as other:
        config = {"model": "m", "settings": {}, "grants": [], "k": 1, "max_attempts": 1}
        await Jobs(ledger).define("f", config, [("t", "/tasks/t")])
        old = await Jobs(ledger).claim("f", "old-holder", 0.2)
        assert old is not None
        log = run_of("clean")
        seed = seed_data(trial_id=old.trial_id, task="t")
        sid = (await ledger.start(validate_seed(seed), fence=(old.trial_id, old.token))
               ).session_id
        await anyio.sleep(0.5)  # the old holder's lease expires: another runner may take it
        taken = []

        async def take_over() -> None:
            taken.append(await Jobs(other).claim("f", "new-holder", 60))

        with after_the_fold(ledger, take_over), pytest.raises(LeaseLost):
            await ledger.append(sid, log[:2], fence=(old.trial_id, old.token))
        assert taken[0] is not None and taken[0].token != old.token
        assert len(await ledger.events(sid)) == 1


async def test_a_commit_reads_only_what_other_processes_appended_since_its_last(
        tmp_path: Path) -> None:
    """Under SQLite's write lock each commit asks which sessions other processes appended
    to since its last: that read must seek by position, not scan an index of the whole log
    (it did, through `SELECT DISTINCT`: 6 ms a commit at 100k events, growing with the log)."""
    from trialledger.store.log import MOVED_SINCE_SQLITE

    db = tmp_path / "plan.db"
    async with await Ledger.open(str(db)):
        pass
    with contextlib.closing(sqlite3.connect(db)) as conn:
        plan = conn.execute(f"EXPLAIN QUERY PLAN {MOVED_SINCE_SQLITE}", (0,)).fetchall()
    assert [step[-1] for step in plan] == ["SEARCH events USING INTEGER PRIMARY KEY (rowid>?)"]


async def test_the_position_sequence_stays_past_the_log(db: str) -> None:
    """Positions are given by the writer; PostgreSQL's column default (its sequence) must
    still never hand out one already taken, through the batch folded once or again."""
    async with await Ledger.open(db) as first, await Ledger.open(db) as second:
        sid = (await first.seed(seed_data())).session_id
        events = run_of("clean")
        await first.append(sid, events[:2])
        await second.append(sid, events[2:4])
        await first.append(sid, events[4:])  # folded again: `second` moved the session
        if first.dialect == "postgresql":
            [(last, taken)] = await raw(first, "SELECT nextval(pg_get_serial_sequence("
                                               "'events', 'position')), max(position) FROM events")
            assert last > taken
        positions = sorted(p for (p,) in await raw(first, "SELECT position FROM events"))
        assert positions == list(range(1, len(positions) + 1))


async def test_secrets_are_scrubbed_before_they_are_stored(db: str) -> None:
    token = "tok-9f8e7d6c5b4a3210"
    grants = [{"name": "docs", "kind": "mcp", "url": "http://127.0.0.1:1/mcp",
               "headers": {"Authorization": f"Bearer {token}"}}]
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data(grants=grants))).session_id
        await ledger.append(sid, [run_of("clean")[0], {
            "type": "agent.stderr", "at": "2026-11-29T09:00:00Z",
            "data": {"tail": f"auth {token[:10]}… then \"{token}\"", "truncated": False}}])
        stored = await raw(ledger, "SELECT data FROM events")
        assert stored and not any(token[:8] in data for (data,) in stored)
        assert "[redacted]" in stored[-1][0]


async def test_out_of_date_database_is_refused_naming_the_upgrade(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        await raw(ledger, "UPDATE alembic_version SET version_num = '0000'")
    with pytest.raises(SchemaOutOfDate, match="trialledger db upgrade --db"):
        await Ledger.open(db)


async def test_migrations_go_down_and_up(db: str) -> None:
    from trialledger.store.migrate import current_revision, downgrade, head_revision, upgrade

    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        assert [row["session_id"] for row in await ledger.sessions()] == [sid]
    async with open_engines(db) as engines:
        await downgrade(engines.writer, "base")
        assert await current_revision(engines.writer) is None
        await upgrade(engines.writer)
        assert await current_revision(engines.writer) == head_revision()
    async with await Ledger.open(db) as ledger:
        assert await ledger.sessions() == []  # the downgrade to base dropped it


async def test_pooled_connections_that_died_with_a_server_restart_are_replaced(
        postgres: Any) -> None:
    """After a PostgreSQL restart every pooled connection is dead; the next read and the
    next append still succeed at once (each pooled connection is pinged at checkout), with
    no retry of the caller's."""
    db = postgres.create_database()
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        assert len(await ledger.sessions()) == 1  # the reader's pool holds a connection too
        # Down longer than a connection may sit idle unpinged: a restart quicker than that
        # (a checkpoint just taken leaves little to recover) is not what this test asks.
        postgres.restart(down_s=PING_IDLE_S + 0.1)
        assert [row["session_id"] for row in await ledger.sessions()] == [sid]
        stored = await ledger.append(sid, run_of("clean")[:1], expected_seq=1)
        assert stored[0].event.seq == 2


async def test_recover_leaves_a_live_runner_alone_unless_forced(db: str) -> None:
    from tests.scenarios import SCENARIOS
    from trialledger.store.ledger import RunnerAlive

    async with await Ledger.open(db) as ledger:
        for name in ("timeout", "http_429"):  # open sessions of runner-a
            events = [e for e in SCENARIOS[name][0].events
                      if e["type"] not in ("session.closed",)]
            await ledger.import_log(events)
        await ledger.heartbeat("runner-a")
        assert set(await ledger.live_runners()) == {"runner-a"}
        with pytest.raises(RunnerAlive, match="alive"):
            await ledger.recover("runner-a")
        assert await ledger.recover(None, all_runners=True) == []  # its sessions are live
        assert len(await ledger.recover("runner-a", force=True)) >= 1
        assert await ledger.live_runners(within_s=0.0) == {}  # a heartbeat ages


async def test_driver_errors_leave_the_store_as_store_unavailable(tmp_path: Path) -> None:
    import socket

    from trialledger.store import StoreUnavailable

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    try:
        with pytest.raises(StoreUnavailable, match=r"postgresql://u:\*\*\*@127\.0\.0\.1"):
            await Ledger.open(f"postgresql://u:Sekrit-pw@127.0.0.1:{port}/db")
    finally:
        closed.close()
    folder = tmp_path / "a-folder.db"
    folder.mkdir()  # a path that cannot be a database file
    with pytest.raises(StoreUnavailable, match="cannot use the database"):
        await Ledger.open(str(folder))


def test_a_sqlite_store_that_cannot_be_opened_leaves_no_thread_failing_after_its_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed open answers in one line and ends its event loop clean: aiosqlite's worker
    thread, stopped by a failed connect, delivers its stop to that loop — once it has
    closed, the thread died on `RuntimeError: Event loop is closed` (a pytest warning in
    CI, at whichever test ran next). A path that is no file is refused before connecting."""
    import threading

    from trialledger.store import StoreUnavailable

    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: died.append(hook.exc_value))
    folder = tmp_path / "a-folder.db"
    folder.mkdir()

    async def refused(db: Path) -> str:
        with pytest.raises(StoreUnavailable) as error:
            await Ledger.open(str(db))
        return str(error.value)

    for n in range(30):
        assert "is not a regular file" in anyio.run(refused, folder)
        assert "unable to open" in anyio.run(refused, tmp_path / f"no-folder-{n}" / "x.db")
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and "_connection_worker" in thread.name:
            thread.join(timeout=10)
    assert died == []


async def test_new_stores_opened_together_in_one_process_are_each_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """alembic's context is process-global: concurrent builds must not cross connections.
    (In a process that has built no store yet: later ones are built from the kept schema.)"""
    monkeypatch.setattr(migrate, "_sqlite_schema", [])
    opened: list[int] = []

    async def one(n: int) -> None:
        async with await Ledger.open(str(tmp_path / f"s{n}.db")) as ledger:
            seeded = await ledger.seed(seed_data())
            opened.append(seeded.head_seq)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for n in range(4):
                tg.start_soon(one, n)
    assert opened == [1, 1, 1, 1]


async def test_a_batch_larger_than_a_statements_limit_is_asked_in_slices(
        tmp_path: Path) -> None:
    """800 sessions imported while the writer waits for a lock land in one batch that names
    ~8,800 event ids — more than one statement may hold once SQLite's variable limit is
    lowered to 2,000 (this machine's build allows 250,000, which 23,000 concurrent imports
    overflowed in the re-derivation benchmark): the writer asks in slices."""
    import uuid

    from sqlalchemy import event

    from tests.scenarios import CLEAN, LogBuilder

    logs = []
    for n in range(800):
        builder = LogBuilder().launched().codex(CLEAN).finish(0)
        builder.events[0]["session_id"] = str(uuid.UUID(int=n + 1))
        logs.append(builder.events)
    db = tmp_path / "many.db"
    async with await Ledger.open(str(db)) as ledger:
        writer = ledger._engines.sync_writer  # where a commit's transaction runs on SQLite
        assert writer is not None

        @event.listens_for(writer, "connect")
        def _small(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
            dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 2000)

        writer.dispose()  # every writer connection from now on has the small limit
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the writer waits: every import queues up

        async def release() -> None:
            await anyio.sleep(2)
            holder.execute("COMMIT")

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            for log in logs:
                tg.start_soon(ledger.import_log, log)
        holder.close()
        assert len(await ledger.sessions()) == 800
        assert (await ledger.audit()).ok


async def test_the_store_leaves_its_callers_collector_alone_and_the_command_tunes_its_own(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from trialledger import cli
    from trialledger.store.collector import THRESHOLDS

    before = gc.get_threshold()
    async with await Ledger.open(db) as ledger:
        sid = (await ledger.seed(seed_data())).session_id
        await ledger.append(sid, run_of("clean"))
        await ledger.divergences(jobs=1)
    assert gc.get_threshold() == before != THRESHOLDS
    seen: list[tuple[int, int, int]] = []

    def main() -> int:
        seen.append(gc.get_threshold())
        return 0

    monkeypatch.setattr(cli, "main", main)
    try:
        assert cli.entry() == 0
    finally:
        gc.set_threshold(*before)
    assert seen == [THRESHOLDS]
