"""The store under real processes: SIGKILL at random moments, 8 concurrent writers, tailing."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from tests.scenarios import seed_data
from trialledger.store import ConcurrencyConflict, Ledger

# SIGKILLs of a writer on SQLite (PostgreSQL: a fifth). 30 by default keeps the suite quick;
# TRIALLEDGER_SIGKILLS=100 is the full run (the "slow mode" of README.md).
KILLS = int(os.environ.get("TRIALLEDGER_SIGKILLS", "20"))
ROUNDS = 15  # appends per process and shared session among the 8 contending writers

FORK = multiprocessing.get_context("fork")
SETUP = [
    {"type": "agent.launched", "at": "2026-11-29T08:00:01Z", "data": {
        "argv": ["codex"], "workdir": "/app", "env_keys": [], "config_sha256": "0" * 64,
        "isolation": "bwrap", "runner_id": "runner-a"}},
    {"type": "turn.started", "at": "2026-11-29T08:00:02Z", "data": {}},
]
BATCH = 3


def message(event_id: str) -> dict[str, Any]:
    return {"type": "item.completed", "at": "2026-11-29T08:00:03Z", "event_id": event_id,
            "data": {"item": {"id": event_id, "type": "agent_message", "text": "x" * 200}}}


# --- crash: acknowledged appends survive SIGKILL, batches are never partial --------------


def _crash_child(db: str, fd: int, run: int) -> None:
    async def writer(ledger: Ledger, task: int) -> None:
        for n in range(10**6):
            sid = (await ledger.seed(seed_data(trial_id=f"r{run}-t{task}-{n}"))).session_id
            os.write(fd, f"{sid} 1\n".encode())
            await ledger.append(sid, SETUP, expected_seq=1)
            os.write(fd, f"{sid} 3\n".encode())
            for k in range(4):
                head = 3 + BATCH * k
                await ledger.append(sid, [message(f"{sid}-{head + i}") for i in range(BATCH)],
                                    expected_seq=head)
                os.write(fd, f"{sid} {head + BATCH}\n".encode())

    async def main() -> None:
        async with await Ledger.open(db) as ledger, anyio.create_task_group() as tg:
            for task in range(4):
                tg.start_soon(writer, ledger, task)

    anyio.run(main)


async def _check_after_crash(db: str, acked: dict[str, int]) -> None:
    async with await Ledger.open(db) as ledger:
        heads = {row["session_id"]: row["head_seq"] for row in await ledger.sessions()}
        for sid, seq in acked.items():
            assert heads.get(sid, 0) >= seq, f"acknowledged seq {seq} of {sid} was lost"
        for sid, head in heads.items():
            assert head == 1 or (head - 3) % BATCH == 0, f"{sid} holds a partial batch ({head})"
            assert len(await ledger.events(sid)) == head
        report = await ledger.audit()
        assert report.ok, report.fault


def _kill_repeatedly(db: str, kills: int) -> int:
    rng = random.Random(20261129)
    acked: dict[str, int] = {}
    for run in range(kills):
        read_fd, write_fd = os.pipe()
        child = FORK.Process(target=_crash_child, args=(db, write_fd, run))
        child.start()
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        deadline, first = time.monotonic() + 20, b""
        while time.monotonic() < deadline:  # wait until the child has acknowledged something
            try:
                first = os.read(read_fd, 1)
            except BlockingIOError:
                time.sleep(0.005)
                continue
            break
        time.sleep(rng.uniform(0.0, 0.12))
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join()
        os.set_blocking(read_fd, True)
        rest = b""
        while chunk := os.read(read_fd, 65536):
            rest += chunk
        os.close(read_fd)
        for line in (first + rest).decode().splitlines():
            sid, seq = line.split()
            acked[sid] = max(acked.get(sid, 0), int(seq))
        anyio.run(_check_after_crash, db, acked)
    return len(acked)


@pytest.mark.slow
def test_sigkill_never_loses_an_acknowledged_append_sqlite(tmp_path: Any) -> None:
    assert _kill_repeatedly(str(tmp_path / "crash.db"), kills=KILLS) > KILLS


@pytest.mark.slow
def test_sigkill_never_loses_an_acknowledged_append_postgresql(postgres: Any) -> None:
    assert _kill_repeatedly(postgres.create_database(), kills=max(5, KILLS // 5)) > 5


# --- 8 processes append to shared sessions with stale expectations -------------------------


def _contender(db: str, sids: list[str], proc: int, rounds: int, fd: int) -> None:
    async def main() -> int:
        conflicts = 0
        heads = dict.fromkeys(sids, 3)
        async with await Ledger.open(db) as ledger:
            for i in range(rounds):
                for sid in sids:
                    event = message(f"p{proc}-{sid}-{i}")
                    while True:
                        try:
                            await ledger.append(sid, [event], expected_seq=heads[sid])
                            heads[sid] += 1
                            break
                        except ConcurrencyConflict as conflict:
                            conflicts += 1
                            heads[sid] = conflict.actual
        return conflicts

    os.write(fd, f"{anyio.run(main)}\n".encode())


def _run_contenders(db: str, target: Callable[..., None], extra: tuple[Any, ...]) -> list[int]:
    read_fd, write_fd = os.pipe()
    procs = [FORK.Process(target=target, args=(db, *extra, p, ROUNDS, write_fd))
             for p in range(8)]
    for p in procs:
        p.start()
    os.close(write_fd)
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    acked: list[int] = []
    with os.fdopen(read_fd) as lines:
        acked = [int(line) for line in lines]
    return acked


async def _seed_shared(db: str, count: int) -> list[str]:
    async with await Ledger.open(db) as ledger:
        sids = []
        for _ in range(count):
            sid = (await ledger.seed(seed_data())).session_id
            await ledger.append(sid, SETUP, expected_seq=1)
            sids.append(sid)
        return sids


async def _check_shared(db: str, sids: list[str]) -> None:
    async with await Ledger.open(db) as ledger:
        for sid in sids:
            events = await ledger.events(sid)
            ids = [e.event.event_id for e in events[3:]]
            assert len(ids) == len(set(ids)) == 8 * ROUNDS
            assert set(ids) == {f"p{p}-{sid}-{i}" for p in range(8) for i in range(ROUNDS)}
            assert [e.event.seq for e in events] == list(range(1, len(events) + 1))
        assert (await ledger.audit()).ok


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_eight_processes_with_stale_expectations_lose_and_duplicate_nothing(
        kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    db = (str(tmp_path / "shared.db") if kind == "sqlite"
          else request.getfixturevalue("postgres").create_database())
    sids = anyio.run(_seed_shared, db, 4)
    conflicts = _run_contenders(db, _contender, (sids,))
    assert len(conflicts) == 8 and sum(conflicts) > 0  # stale expectations really happened
    anyio.run(_check_shared, db, sids)


# --- PostgreSQL: a tailing reader never skips an event that commits late ------------------


def _tail_writer(db: str, proc: int, fd: int) -> None:
    async def main() -> None:
        async with await Ledger.open(db) as ledger:
            async def one(task: int) -> None:
                for n in range(30):
                    sid = (await ledger.seed(seed_data(trial_id=f"w{proc}-{task}-{n}"))).session_id
                    await ledger.append(sid, SETUP)
            async with anyio.create_task_group() as tg:
                for task in range(3):
                    tg.start_soon(one, task)
    anyio.run(main)
    os.write(fd, b"done\n")


async def _tail_until(db: str, procs: list[Any]) -> tuple[list[int], list[int]]:
    seen: list[int] = []
    deadline = time.monotonic() + 300
    async with await Ledger.open(db) as ledger:
        while True:
            assert time.monotonic() < deadline, "the writers never finished"
            alive = any(p.is_alive() for p in procs)
            batch = await ledger.tail(seen[-1] if seen else 0, limit=500)
            seen += [e.position for e in batch]
            if not alive and not batch:
                break
            if not batch:
                await anyio.sleep(0.02)  # nothing new yet: let the writers write
        everything = [e.position for e in await ledger.tail(0, limit=10**6)]
    return seen, everything


def test_tailing_reader_never_skips_a_late_commit_postgresql(postgres: Any) -> None:
    db = postgres.create_database()
    anyio.run(_seed_shared, db, 1)  # builds the schema before the writers race
    read_fd, write_fd = os.pipe()
    procs = [FORK.Process(target=_tail_writer, args=(db, p, write_fd)) for p in range(4)]
    for p in procs:
        p.start()
    os.close(write_fd)
    seen, everything = anyio.run(_tail_until, db, procs)
    os.close(read_fd)
    assert all(p.exitcode == 0 for p in procs)
    assert len(everything) == 3 + 4 * 3 * 30 * 3
    assert seen == everything  # in order, nothing skipped, nothing twice
