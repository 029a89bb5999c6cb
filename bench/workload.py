"""Workloads for the benchmarks: the same data for trialledger and for each reference."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from tests.scenarios import CLEAN, LogBuilder
from trialledger.core import replay
from trialledger.core.parsing import event_dict
from trialledger.store import Ledger, tune_collector

PAYLOAD = "x" * 200  # an agent message of this text makes an event of ~330 bytes
SEED = LogBuilder().events[0]["data"]
SETUP = [*LogBuilder().launched().events[-1:],
         {"type": "turn.started", "at": "2026-11-29T08:00:02Z", "data": {}}]
PG_SESSIONS_PER_WRITER = 50
RAW_INSERT = ("INSERT INTO events (session_id, seq, event_id, type, at, data, hash) "
              "VALUES (?, ?, ?, ?, ?, ?, ?)")


def message(i: int) -> dict[str, Any]:
    """One ~330-byte evidence event."""
    return {"type": "item.completed", "at": "2026-11-29T08:00:03Z",
            "data": {"item": {"id": f"item_{i}", "type": "agent_message", "text": PAYLOAD}}}


async def seed_running(ledger: Ledger, sessions: int) -> list[str]:
    """Seed sessions and bring each to `running` (concurrently)."""
    sids: list[str] = []

    async def one() -> None:
        sid = (await ledger.seed(SEED)).session_id
        await ledger.append(sid, SETUP)
        sids.append(sid)

    async with anyio.create_task_group() as tg:
        for _ in range(sessions):
            tg.start_soon(one)
    return sids


async def append_one_by_one(ledger: Ledger, session_id: str, count: int) -> None:
    """Append `count` events, one per call, each acknowledged durably."""
    head = 3
    for i in range(count):
        stored = await ledger.append(session_id, [message(i)], expected_seq=head)
        head = stored[-1].event.seq or head


def session_logs(sessions: int, messages: int, *, with_decisions: bool = False,
                 first: int = 0) -> list[list[dict[str, Any]]]:
    """Complete session logs (seed, launch, messages, a clean ending) as JSONL dicts, of
    the sessions numbered from `first`."""
    tail = [*(line for line in CLEAN[-1:])]
    logs = []
    for n in range(sessions):
        builder = LogBuilder()
        builder.events[0]["session_id"] = str(uuid.UUID(int=first + n + 1))
        builder.launched().codex(CLEAN[:3])
        for i in range(messages - 3):
            builder.events.append(message(i))
        builder.codex(tail).finish(0)
        log = builder.events
        if with_decisions:
            log = [event_dict(e) for e in replay(log).events]
        logs.append(log)
    return logs


def _trial_class() -> Any:
    from eventsourcing.domain import Aggregate, event

    class Trial(Aggregate):
        """A session as an `eventsourcing` aggregate: started, then one event per message."""

        @event("Started")
        def __init__(self, task: str) -> None:
            self.task, self.messages = task, 0

        @event("Appended")
        def append(self, payload: str) -> None:
            self.messages += 1

    return Trial


_TRIAL: Any = None


def eventsourcing_app(path: Path, aggregates: int, events_each: int = 0) -> tuple[Any, list[Any]]:
    """The `eventsourcing` library's SQLite application with one aggregate per session."""
    global _TRIAL
    from eventsourcing.application import Application

    _TRIAL = _TRIAL or _trial_class()
    app: Any = Application(env={"PERSISTENCE_MODULE": "eventsourcing.sqlite",
                                "SQLITE_DBNAME": str(path)})
    made = [_TRIAL(task="t") for _ in range(aggregates)]
    for aggregate in made:
        for _ in range(events_each):
            aggregate.append(payload=PAYLOAD)
    for start in range(0, len(made), 500):
        app.save(*made[start:start + 500])
    return app, made


def raw_sqlite(path: Path) -> sqlite3.Connection:
    """A bare table like ours (two indexes), WAL, synchronous=FULL."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE events (position INTEGER PRIMARY KEY, session_id TEXT, seq INT,"
                 " event_id TEXT UNIQUE, type TEXT, at TEXT, data TEXT, hash TEXT,"
                 " UNIQUE (session_id, seq))")
    conn.isolation_level = "DEFERRED"
    return conn


def raw_row(i: int) -> tuple[Any, ...]:
    data = json.dumps(message(i))
    return (f"s{i // 100}", i % 100 + 1, str(uuid.uuid4()), "item.completed",
            "2026-11-29T08:00:03Z", data, "0" * 64)


def executemany(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    with conn:
        conn.executemany(RAW_INSERT, rows)


def codex_logs(folder: Path, megabytes: int) -> tuple[Path, Path]:
    """A generated Codex exec log and rollout of about `megabytes` together."""
    exec_log, rollout = folder / f"exec-{megabytes}.jsonl", folder / f"rollout-{megabytes}.jsonl"
    output = "test output line\n" * 40
    half = megabytes * 1024 * 1024 // 2
    with exec_log.open("w") as out:
        out.write(CLEAN[0] + "\n" + '{"type":"turn.started"}\n')
        n = 0
        while out.tell() < half:
            item = {"id": f"item_{n}", "type": "command_execution", "command": "make test",
                    "aggregated_output": output, "exit_code": 0, "status": "completed"}
            out.write(json.dumps({"type": "item.started", "item": {**item, "status":
                                  "in_progress", "aggregated_output": ""}}) + "\n")
            out.write(json.dumps({"type": "item.completed", "item": item}) + "\n")
            n += 1
        out.write(CLEAN[-1] + "\n")
    with rollout.open("w") as out:
        n = 0
        while out.tell() < half:
            n += 1
            total = {"input_tokens": 100 * n, "cached_input_tokens": 50 * n,
                     "output_tokens": 10 * n, "reasoning_output_tokens": 0,
                     "total_tokens": 110 * n}
            out.write(json.dumps({"timestamp": "2026-11-29T08:00:00.000Z", "type": "response_item",
                                  "payload": {"type": "message", "role": "assistant",
                                              "content": [{"type": "output_text",
                                                           "text": output}]}}) + "\n")
            out.write(json.dumps({"timestamp": "2026-11-29T08:00:00.000Z", "type": "event_msg",
                                  "payload": {"type": "token_count", "info": {
                                      "total_token_usage": total,
                                      "last_token_usage": total}}}) + "\n")
    return exec_log, rollout


@dataclass
class Processes:
    """What `in_processes` measured, from the moment every process was ready to the last
    one's end."""

    seconds: float
    cpu: float  # CPU seconds of the processes
    machine_cpu: float  # CPU seconds of the whole machine (a database server's too)


# A process's part of a workload: given its store and its index, get ready (untimed), and
# return what is timed.
Job = Callable[[Ledger, int], Awaitable[Callable[[], Awaitable[None]]]]


def _process(db: str, job: Job, index: int, ready: Any, report: Any, tuned: bool) -> None:
    if tuned:  # as a `trialledger` command (a job's worker) runs
        tune_collector()

    async def run() -> float:
        async with await Ledger.open(db) as ledger:
            timed = await job(ledger, index)
            await anyio.to_thread.run_sync(ready.wait)  # every process is ready: go
            start = time.process_time()
            await timed()
        return time.process_time() - start
    report.put(anyio.run(run))


def in_processes(db: str, job: Job, *, processes: int, tuned: bool = False) -> Processes:
    """`job` run by `processes` processes on one store (`tuned`: each with
    `tune_collector()`)."""
    anyio.run(_build, db)
    context = multiprocessing.get_context("fork")
    ready, report = context.Barrier(processes + 1), context.Queue()
    workers = [context.Process(target=_process, args=(db, job, index, ready, report, tuned))
               for index in range(processes)]
    for worker in workers:
        worker.start()
    ready.wait(timeout=600)
    start, machine = time.perf_counter(), machine_cpu_seconds()
    cpu = sum(report.get(timeout=600) for _ in workers)
    for worker in workers:
        worker.join()
    seconds, machine = time.perf_counter() - start, machine_cpu_seconds() - machine
    assert all(worker.exitcode == 0 for worker in workers)
    return Processes(seconds, cpu, machine)


def appending(sessions: int, events: int) -> Job:
    """Seed `sessions` sessions; timed: append `events` to them, one per call."""
    async def job(ledger: Ledger, _index: int) -> Callable[[], Awaitable[None]]:
        sids = await seed_running(ledger, sessions)

        async def timed() -> None:
            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(append_one_by_one, ledger, sid, events // sessions)
        return timed
    return job


def importing(sessions: int, events: int) -> Job:
    """Build `sessions` logs of `events` in all (each process its own sessions); timed:
    import them, all at once."""
    async def job(ledger: Ledger, index: int) -> Callable[[], Awaitable[None]]:
        logs = session_logs(sessions, events // sessions, first=index * sessions)

        async def timed() -> None:
            async with anyio.create_task_group() as tg:
                for log in logs:
                    tg.start_soon(ledger.import_log, log)
        return timed
    return job


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has used since boot (/proc/stat: all but idle and
    iowait)."""
    with open("/proc/stat", encoding="ascii") as stat:
        ticks = [int(t) for t in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


async def _build(db: str) -> None:
    async with await Ledger.open(db):
        pass


async def _stored(db: str, after: int) -> tuple[int, int]:
    async with await Ledger.open(db) as ledger:
        rows = await ledger.sessions()
        return len(rows), sum(row["head_seq"] - after for row in rows)


def stored(db: str, *, after: int = 0) -> tuple[int, int]:
    """The sessions stored in `db`, and their events not counting the first `after` of
    each."""
    return anyio.run(_stored, db, after)
