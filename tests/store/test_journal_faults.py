"""SPEC §8 (round 4): capture never waits on the store — an append that stalls is abandoned
and journalled while Codex's output is still read — and the journal's integrity: a damaged
journal is a gap in its place, never delivered as it is nor silently dropped; a journal
that cannot be written is a gap once the store is back, never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.pg import PostgresServer
from tests.runs import make_task
from tests.scenarios import LogBuilder, seed_data
from tests.session.test_signals import running
from tests.store.test_journal import cache as cache  # the runner's cache, for each test alone
from tests.store.test_journal import decisions, journalled, kinds_of, store_locked
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, shell
from trialledger.adapters.session.journal import Journal, journal_path
from trialledger.store import Ledger, StoredEvent

BUDGET_S = 5  # session_close_timeout_s


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def stalled(server: PostgresServer) -> Iterator[None]:
    """The server and every backend stopped (SIGSTOP: its sockets stay open, nothing
    answers, no reset) until the block ends."""
    postmaster = int((server.folder / "data" / "postmaster.pid").read_text().split()[0])
    stopped = [postmaster]
    os.kill(postmaster, signal.SIGSTOP)
    try:
        for pid in _children(postmaster):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _session_events(db: str) -> list[StoredEvent]:
    async def read() -> list[StoredEvent]:
        async with await Ledger.open(db) as ledger:
            (row,) = await ledger.sessions()
            return await ledger.events(str(row["session_id"]))

    return anyio.run(read)


def test_a_stalled_postgresql_while_codex_prints_loses_none_of_it(
        tmp_path: Path, cache: Path, postgres: PostgresServer) -> None:
    # The server is stopped from Codex's first model call until well after Codex has
    # printed its tool's output, its final message and turn.completed and exited (twice
    # the capture budget): the appends stall, are abandoned after 5 s, and everything from
    # then on is journalled while Codex is still read; once the server goes on, the
    # journal is delivered and the session decided on all of it.
    db = postgres.create_database()
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    with ScriptedEndpoint([shell("sleep 2; echo worked-42"), message("all done")]) as endpoint, \
            running(db, task.folder, endpoint.url, "--set",
                    f"session_close_timeout_s={BUDGET_S}", wait=False) as runner:
        deadline = time.monotonic() + 90
        while not endpoint.requests:  # Codex asked for its first turn: the session runs
            assert time.monotonic() < deadline, "Codex never asked for its first turn"
            assert runner.poll() is None, runner.communicate()
            time.sleep(0.05)
        with stalled(postgres):
            while len(endpoint.requests) < 2:
                assert time.monotonic() < deadline, "Codex never asked for its last turn"
                time.sleep(0.05)
            # Codex's end is read while the server is still stopped: into the journal.
            journal = journalled(cache / "trialledger" / "journals", "turn.completed",
                                 3 + 2 * BUDGET_S)
            time.sleep(2 * BUDGET_S)  # then the budget runs out twice over
        out, err = runner.communicate(timeout=240)
    assert "Traceback" not in err, err
    assert journal is not None, "turn.completed was never journalled while the store stalled"
    events = _session_events(db)
    kinds = [s.event.type for s in events]
    assert _decided(events) == ["verify"], (out, err, kinds)  # not `retry`: all of it seen
    assert kinds.count("turn.completed") == 1 and kinds.count("model.call") == 2
    assert kinds.index("turn.completed") < kinds.index("agent.exited")  # decided from it
    said = [json.dumps(s.event.data.model_dump(mode="json")) for s in events
            if s.event.type == "item.completed"]
    assert any("worked-42" in text for text in said)  # the tool's output
    assert any("all done" in text for text in said)  # the final message
    assert len(said) == len(set(said)) == 2 + 1  # the command (started, done), the message
    ids = [s.event.event_id for s in events]
    assert len(ids) == len(set(ids))
    assert not list((cache / "trialledger" / "journals").glob("*.jsonl"))  # delivered


def _decided(events: list[StoredEvent]) -> list[str]:
    """The machine's decisions (the verifier's own verdict is not what is tested here)."""
    return [s.event.data.action for s in events if s.event.type == "outcome.decided"]


def _launched(session_id: str) -> dict[str, Any]:
    launched = LogBuilder().launched().events[1]
    return {**launched, "schema": 4, "data": {
        **launched["data"], "runner_id": "gone-1",
        "journal": {"host": socket.gethostname(), "path": str(journal_path(session_id))}}}


BATCHES = [  # one event each, of the kinds Codex prints, in order
    {"type": "thread.started", "at": f"2026-11-29T10:00:0{n}Z", "data": {"thread_id": f"t{n}"}}
    for n in range(6)]


def _recover(db: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trialledger.cli", "recover", *flags,
                           *(["--db", db] if "--purge-damaged" not in flags else [])],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ})


def _damage(path: Path) -> None:
    """Four damages: a bad header (line 1), a cut middle line (3), an altered digit (5)
    and a last line cut short (7)."""
    lines = path.read_bytes().split(b"\n")
    assert len(lines) == 8 and lines[-1] == b""  # header, six batches, the last newline
    lines[0] = lines[0].replace(b'"after_seq"', b'"after_sq"')
    lines[2] = lines[2][: len(lines[2]) // 2]
    assert b"10:00:03Z" in lines[4]
    lines[4] = lines[4].replace(b"10:00:03Z", b"10:00:08Z")
    lines[6] = lines[6][:-7]
    path.write_bytes(b"\n".join(lines[:7]))  # no newline after the cut last line


async def _left_open(db: str) -> str:
    """A session of runner `gone-1` left open after its launch (seq 2)."""
    async with await Ledger.open(db) as ledger:
        seeded = await ledger.seed(seed_data(runner_id="gone-1"))
        await ledger.append(seeded.session_id, [_launched(seeded.session_id)],
                            expected_seq=1)
        return seeded.session_id


def test_a_damaged_journal_is_a_gap_in_place_later_batches_delivered_the_file_kept(
        tmp_path: Path, cache: Path) -> None:
    db = str(tmp_path / "t.db")

    session_id = anyio.run(_left_open, db)
    journal = Journal(session_id)
    journal.begin(2)
    for batch in BATCHES:
        journal.add([batch])
    _damage(journal.path)
    done = _recover(db, "--runner", "gone-1")
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT type, data FROM events WHERE seq > 2 ORDER BY seq"
                            ).fetchall()
    found = [(kind, json.loads(data)["data"]) for kind, data in rows]
    gaps = [d["detail"] for k, d in found if k == "gap.recorded"
            and d["code"] == "evidence_damaged"]
    threads = [d["thread_id"] for k, d in found if k == "thread.started"]
    assert threads == ["t0", "t2", "t4"]  # the good lines, in order, each once
    assert [g.split(" not delivered")[0].rsplit("line(s) ", 1)[1] for g in gaps] == [
        "1", "3", "5", "7"]
    order = [k if k != "gap.recorded" else "gap" for k, _ in found][:7]
    assert order == ["gap", "thread.started", "gap", "thread.started", "gap",
                     "thread.started", "gap"]  # each gap where its line was
    kept = journal.path.with_name(journal.path.name + ".damaged")
    assert kept.exists() and not journal.path.exists()
    assert kinds_of(Path(db))[-1] == "session.closed"
    purged = _recover(db, "--purge-damaged")
    assert purged.returncode == 0, purged.stderr
    assert "1 damaged journals removed" in purged.stdout
    assert not kept.exists()


def test_an_old_format_journal_is_still_delivered(tmp_path: Path, cache: Path) -> None:
    db = str(tmp_path / "t.db")

    session_id = anyio.run(_left_open, db)
    path = journal_path(session_id)
    path.parent.mkdir(parents=True, mode=0o700)
    lines = [{"session_id": session_id, "after_seq": 2}] + [{"events": [b]} for b in BATCHES]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path.chmod(0o600)
    done = _recover(db, "--runner", "gone-1")
    assert done.returncode == 0, done.stderr
    kinds = kinds_of(Path(db))
    assert kinds.count("thread.started") == 6 and "gap.recorded" not in kinds
    assert not path.exists()


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder` a read-only tmpfs of its own (root only), unmounted after."""
    folder.mkdir(parents=True, mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs",
                              str(folder)], capture_output=True, text=True, check=False)
    if mounted.returncode:
        pytest.fail(f"a read-only tmpfs is needed for this test: {mounted.stderr}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)


def test_a_journal_that_cannot_be_written_is_a_gap_never_a_traceback(
        tmp_path: Path, cache: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = tmp_path / "t.db"
    with read_only(cache / "trialledger" / "journals"), \
            ScriptedEndpoint([shell("sleep 2; echo worked"), message("all done")]) as endpoint, \
            running(db, task.folder, endpoint.url, "--set",
                    f"session_close_timeout_s={BUDGET_S}") as runner:
        with store_locked(db):
            deadline = time.monotonic() + 90
            while len(endpoint.requests) < 2:  # Codex asked for its last turn
                assert time.monotonic() < deadline, "Codex never asked for its last turn"
                assert runner.poll() is None, runner.communicate()
                time.sleep(0.05)
            time.sleep(3 + BUDGET_S)  # Codex's end, its output neither stored nor journalled
        out, err = runner.communicate(timeout=240)
    assert "Traceback" not in err, err
    with sqlite3.connect(db) as conn:
        gaps = conn.execute("SELECT code, detail FROM gaps").fetchall()
    details = [detail for code, detail in gaps if code == "evidence_unjournalled"]
    assert len(details) == 1 and "Read-only file system" in details[0], gaps
    kinds = kinds_of(db)  # what was held in memory, delivered after its gap
    assert kinds.index("gap.recorded") < kinds.index("turn.completed") < kinds.index(
        "agent.exited")
    assert kinds[-1] == "session.closed", (out, err)
    assert [json.loads(d)["data"]["action"] for d in decisions(db)] == ["verify"], (out, err)
