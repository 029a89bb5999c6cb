"""SPEC §8 "Delivery": evidence the runner captured while the store was away is journalled
on the runner's own disk and delivered in order — by the runner when the store returns, by
`recover` on the same machine after a crash — never dropped; another machine's journal is a
gap, and the session is closed without a decision from part of its evidence."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runs import make_task
from tests.scenarios import seed_data
from tests.session.test_signals import running
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, shell

BUDGET_S = 5  # session_close_timeout_s: the store stays away twice as long
SECRET = "sk-journal-0123456789abcdef"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runner's cache (its journal folder) for this test alone, and SQLite's busy wait
    cut from 30 s to 1.5 s so an append gives up on a held lock quickly."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    monkeypatch.setenv("TRIALLEDGER_SQLITE_BUSY_MS", "1500")
    return folder


@contextlib.contextmanager
def store_locked(db: Path) -> Iterator[sqlite3.Connection]:
    """Another process's connection holding SQLite's write lock until the block ends."""
    holder = sqlite3.connect(db, timeout=60, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield holder
    finally:
        holder.execute("COMMIT")
        holder.close()


def journalled(journals: Path, kind: str, deadline_s: float = 60) -> Path | None:
    """The journal that holds an event of `kind`, once one does (None past the deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for path in journals.glob("*.jsonl"):
            if f'"type":"{kind}"' in path.read_text(errors="replace"):
                return path
        time.sleep(0.1)
    return None


def decisions(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute(
            "SELECT data FROM events WHERE type = 'outcome.decided' ORDER BY seq")]


def kinds_of(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT type FROM events ORDER BY seq")]


def test_a_store_away_past_the_capture_budget_when_codex_finishes_loses_nothing(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The store is locked while Codex runs its last turn and stays locked for twice the
    # capture budget after Codex has exited: its final message and turn.completed wait in
    # the journal (scrubbed: the message echoes the API key), and once the store is back
    # the session is decided on all of it.
    monkeypatch.setenv("TL_JOURNAL_KEY", SECRET)
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = tmp_path / "t.db"
    turns = [shell("sleep 2; echo worked"), message(f"all done {SECRET}")]
    with ScriptedEndpoint(turns) as endpoint, \
            running(db, task.folder, endpoint.url, "--api-key-env", "TL_JOURNAL_KEY", "--set",
                    f"session_close_timeout_s={BUDGET_S}") as runner:
        with store_locked(db):
            deadline = time.monotonic() + 60
            while len(endpoint.requests) < 2:  # Codex asked for its last turn
                assert time.monotonic() < deadline, "Codex never asked for its last turn"
                time.sleep(0.05)
            # Codex's end: its turn.completed journalled (or, where nothing journals, a
            # while), then the capture budget runs out twice over with the store still away.
            journal = journalled(cache / "trialledger" / "journals", "turn.completed", 20)
            modes = (None if journal is None else
                     (stat.S_IMODE(journal.stat().st_mode),
                      stat.S_IMODE(journal.parent.stat().st_mode)))
            held = "" if journal is None else journal.read_text(errors="replace")
            time.sleep(2 * BUDGET_S)
        out, err = runner.communicate(timeout=180)
    assert runner.returncode == 0, (err, kinds_of(db), decisions(db))
    assert out.split()[1] == "verify", out
    assert journal is not None and modes == (0o600, 0o700)
    assert "all done" in held and SECRET not in held  # at rest, as in the store: scrubbed
    kinds = kinds_of(db)
    assert kinds.index("turn.completed") < kinds.index("agent.exited")  # decided from it
    assert kinds.count("turn.completed") == 1 and kinds.count("model.call") == 2  # once each
    assert "verification.recorded" in kinds and kinds[-1] == "session.closed"
    with sqlite3.connect(db) as conn:
        said = [r[0] for r in conn.execute(
            "SELECT data FROM events WHERE type = 'item.completed'")]
    assert any("all done" in data for data in said)
    assert not journal.exists()  # delivered, then removed


def test_recover_delivers_the_journal_of_a_runner_killed_during_an_outage(
        tmp_path: Path, cache: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = tmp_path / "t.db"
    with ScriptedEndpoint([shell("sleep 1; echo worked"), message("all done")]) as endpoint, \
            running(db, task.folder, endpoint.url) as runner, store_locked(db):
        journal = journalled(cache / "trialledger" / "journals", "turn.completed")
        assert journal is not None, "turn.completed never reached the journal"
        runner.send_signal(signal.SIGKILL)  # a crash while the store is away
        runner.wait(timeout=30)
    assert "turn.completed" not in kinds_of(db)
    done = subprocess.run([sys.executable, "-m", "trialledger.cli", "recover", "--db",
                           str(db), "--all"], capture_output=True, text=True, timeout=120,
                          env={**os.environ}, check=False)
    assert done.returncode == 0, done.stderr
    kinds = kinds_of(db)
    assert "turn.completed" in kinds and kinds[-1] == "session.closed"
    assert kinds.index("turn.completed") < kinds.index("sandbox.lost")  # in order
    assert not journal.exists()


def test_a_journal_on_another_machine_is_a_gap_and_no_decision(tmp_path: Path) -> None:
    import anyio

    from trialledger.store import Ledger

    db = str(tmp_path / "t.db")
    launched = {"type": "agent.launched", "at": "2026-11-29T10:00:01Z", "schema": 4, "data": {
        "argv": ["codex"], "workdir": "/app", "env_keys": [], "config_sha256": "0" * 64,
        "isolation": "bwrap", "runner_id": "elsewhere-7", "model_proxy": True,
        "journal": {"host": "elsewhere", "path": "/root/.cache/trialledger/journals/x.jsonl"}}}

    async def left_open() -> str:
        async with await Ledger.open(db) as ledger:
            seeded = await ledger.seed(seed_data(runner_id="elsewhere-7"))
            await ledger.append(seeded.session_id, [launched], expected_seq=1)
            return seeded.session_id

    session_id = anyio.run(left_open)
    done = subprocess.run([sys.executable, "-m", "trialledger.cli", "recover", "--db", db,
                           "--runner", "elsewhere-7"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as conn:
        gaps = conn.execute("SELECT code, detail FROM gaps").fetchall()
        closed = conn.execute("SELECT state, close_reason, outcome FROM sessions "
                              "WHERE session_id = ?", (session_id,)).fetchone()
    detail = dict(gaps)["evidence_undelivered"]  # and the derived agent_activation_interrupted
    assert "elsewhere" in detail and "x.jsonl" in detail
    assert "sandbox.lost" not in kinds_of(Path(db))  # no decision from part of it
    assert closed[:2] == ("closed", "recovered") and closed[2] != "retry"


def test_a_jobs_next_holder_delivers_a_journal_skipping_what_the_store_took(
        tmp_path: Path, cache: Path) -> None:
    # A journal whose first batch did commit (its answer was lost) and whose second did
    # not: the trial's next holder appends the second alone, fenced by its lease, then
    # closes the session out.
    import anyio

    from tests.scenarios import claimed_session
    from trialledger.adapters.session.journal import Journal, delivery, journal_record
    from trialledger.store import Ledger

    async def scenario() -> list[str]:
        async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
            _, claim, seeded, log = await claimed_session(ledger, "holder-1", lease_s=60)
            sid, fence = seeded.session_id, (claim.trial_id, claim.token)
            launched = {**log.events[1], "schema": 4, "data": {
                **log.events[1]["data"], "journal": journal_record(sid)}}
            await ledger.append(sid, [launched], expected_seq=1, fence=fence)
            took, lost = log.events[2:4], log.events[4:6]
            await ledger.append(sid, took, expected_seq=2, fence=fence)
            journal = Journal(sid)
            journal.begin(2)
            journal.add(took)
            journal.add(lost)
            await ledger.recover_sessions([sid], fence=fence, deliver=delivery(ledger))
            assert not journal.path.exists()
            return [s.event.type for s in await ledger.events(sid)]

    kinds = anyio.run(scenario)
    assert kinds[:7] == ["session.seeded", "agent.launched", "thread.started",
                         "item.completed", "turn.started", "item.completed", "sandbox.lost"]
    assert kinds[-1] == "session.closed" and kinds.count("item.completed") == 2


def test_events_the_store_refuses_as_invalid_are_a_gap_never_a_poison(tmp_path: Path) -> None:
    """A batch the store refuses as invalid would be refused again however often it is
    offered: journalled, it failed every later append of the session and its recovery.
    Gap `evidence_refused` (what it was, the store's one line) is stored in its place and
    the append still raises (nothing is decided from the rest); later appends, the
    recovery's, are taken."""
    import anyio

    from tests.scenarios import LogBuilder
    from trialledger.adapters.session.recorder import Recorder
    from trialledger.core import BadEvent
    from trialledger.store import Ledger
    from trialledger.store.writer import now

    async def run() -> tuple[list[tuple[str, str | None]], bool, list[str]]:
        async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
            seeded = await ledger.seed(seed_data())
            recorder = Recorder(ledger, seeded)
            await recorder.append([LogBuilder().launched().events[1]])
            with pytest.raises(BadEvent, match=r"data\.code"):
                await recorder.append([{"type": "gap.recorded", "at": now(),
                                        "data": {"code": ""}}])  # a code is never empty
            await recorder.add("agent.stderr", {"tail": "after it", "truncated": False})
            view = await ledger.view(seeded.session_id)
            return ([(g.code, g.detail) for g in view.observations.gaps],
                    recorder.journal.pending, [e.type for e in view.events])

    gaps, pending, types = anyio.run(run)
    assert not pending and types[-1] == "agent.stderr"
    (detail,) = [d for code, d in gaps if code == "evidence_refused"]
    assert detail is not None and "1 event(s) (gap.recorded)" in detail and "'data.code'" in detail
