"""trialledger benchmarks: every figure beside a reference measured in the same run.

    python -m bench.run            # the full run (BENCHMARKS.md), several minutes
    python -m bench.run --quick    # small sizes, under 2 minutes (CI runs it; asserts nothing)

Prints a table, then one `ratio ...` line per comparison. Needs the `bench` extra
(`eventsourcing`), and PostgreSQL's `initdb`/`pg_ctl` for the last figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio

from bench import proxy, workload
from trialledger.store import Ledger, tune_collector

FULL: dict[str, Any] = {
    "sessions": 1000, "events": 100_000, "rederive": 1_000_000, "store_rederive": 1_000_000,
    "query_sessions": 100_000,
    "query_events": 1_000_000, "ingest_mb": (100, 1000), "pg_events": 8 * 5000,
    "baseline_cap_s": 30.0}
QUICK: dict[str, Any] = {
    "sessions": 200, "events": 4000, "rederive": 20_000, "store_rederive": 4000,
    "query_sessions": 2000,
    "query_events": 20_000, "ingest_mb": (5, 20), "pg_events": 8 * 250,
    "baseline_cap_s": 5.0}


@dataclass
class Figure:
    """One measured line of the table."""

    name: str
    method: str
    count: int
    seconds: float
    unit: str = "events/s"
    extra: str = ""

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def tuned(measure: Callable[[], Figure]) -> Figure:
    """`measure()` with the collector set as the `trialledger` command sets it for itself
    (`tune_collector`), then set back: what a service that embeds the store gets."""
    previous = tune_collector()
    try:
        figure = measure()
    finally:
        gc.set_threshold(*previous)
    return replace(figure, method="trialledger, tune_collector()")


# --- 1. durable appends, one event per call, many concurrent sessions ---------------------


def durable_ours(folder: Path, sessions: int, events: int, name: str = "ours") -> Figure:
    async def run() -> float:
        async with await Ledger.open(str(folder / f"{name}.db")) as ledger:
            sids = await workload.seed_running(ledger, sessions)
            per = events // sessions
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(workload.append_one_by_one, ledger, sid, per)
            return time.perf_counter() - start

    seconds = anyio.run(run)
    return Figure("durable appends", "trialledger (group commit)", events, seconds)


def durable_processes(folder: Path, sessions: int, events: int) -> Figure:
    """The same appends from one process per core, each with its share of the sessions, on
    one SQLite file (as a job's workers run: `tune_collector()` in each)."""
    processes, db = os.cpu_count() or 1, str(folder / "processes.db")
    run = workload.in_processes(
        db, workload.appending(sessions // processes, events // processes),
        processes=processes, tuned=True)
    _, stored = workload.stored(db, after=len(workload.SETUP) + 1)
    return across_processes("durable appends", processes, run, stored,
                            f"lost {events - stored} events")


def across_processes(name: str, processes: int, run: workload.Processes, count: int,
                     lost: str) -> Figure:
    return Figure(name, f"trialledger, {processes} processes, tune_collector()", count,
                  run.seconds, extra=f"{lost}; CPU/event {run.cpu / count * 1e6:.0f} us; "
                  f"cores busy {run.machine_cpu / run.seconds / processes:.0%}")


def durable_eventsourcing(folder: Path, sessions: int, events: int, cap_s: float) -> Figure:
    app, aggregates = workload.eventsourcing_app(folder / "es.db", sessions)
    done, start = 0, time.perf_counter()
    while done < events and time.perf_counter() - start < cap_s:
        for aggregate in aggregates:
            aggregate.append(payload=workload.PAYLOAD)
            app.save(aggregate)  # one event per save(), one transaction
            done += 1
    return Figure("durable appends", "eventsourcing SQLite (one per save)", done,
                  time.perf_counter() - start)


def durable_raw(folder: Path, events: int, cap_s: float) -> Figure:
    conn = workload.raw_sqlite(folder / "raw.db")
    done, start = 0, time.perf_counter()
    while done < events and time.perf_counter() - start < cap_s:
        with conn:  # one row per transaction, WAL, synchronous=FULL
            conn.execute(workload.RAW_INSERT, workload.raw_row(done))
        done += 1
    return Figure("durable appends", "raw sqlite3 (one row per txn)", done,
                  time.perf_counter() - start)


# --- 2. batched import ----------------------------------------------------------------------


def import_ours(folder: Path, sessions: int, events: int, name: str = "import") -> Figure:
    logs = workload.session_logs(sessions, events // sessions)

    async def run() -> float:
        async with await Ledger.open(str(folder / f"{name}.db")) as ledger:
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for log in logs:
                    tg.start_soon(ledger.import_log, log)
            return time.perf_counter() - start

    seconds = anyio.run(run)
    total = sum(len(log) for log in logs)
    return Figure("batched import", "trialledger (whole pipeline)", total, seconds)


def import_processes(folder: Path, sessions: int, events: int) -> Figure:
    """The same logs imported by one process per core, each its share, into one SQLite
    file (`tune_collector()` in each, as `trialledger import` runs)."""
    processes, db = os.cpu_count() or 1, str(folder / "import-processes.db")
    run = workload.in_processes(
        db, workload.importing(sessions // processes, events // processes),
        processes=processes, tuned=True)
    count = len(workload.session_logs(1, events // sessions)[0]) * sessions  # as imported
    stored, _ = workload.stored(db)
    return across_processes("batched import", processes, run, count,
                            f"lost {sessions - stored} sessions")


def import_raw(folder: Path, events: int) -> Figure:
    conn = workload.raw_sqlite(folder / "raw-import.db")
    rows = [workload.raw_row(i) for i in range(events)]
    _, seconds = timed(lambda: workload.executemany(conn, rows))
    return Figure("batched import", "raw sqlite3 executemany (one txn)", events, seconds)


# --- 3. re-derivation -----------------------------------------------------------------------


def rederive_ours(events: int) -> Figure:
    from trialledger.core import replay

    per = 10
    logs = workload.session_logs(events // per, per - 3, with_decisions=True)
    total = sum(len(log) for log in logs)
    _, seconds = timed(lambda: [replay(log) for log in logs])
    return Figure("re-derivation", "trialledger replay (every outcome)", total, seconds)


def rederive_store(folder: Path, events: int) -> list[Figure]:
    """`replay --all --diff` over a SQLite store: one process, then one per core."""
    per = 10
    logs = workload.session_logs(events // per, per - 3)
    db = str(folder / "rederive.db")

    async def fill() -> None:
        async with await Ledger.open(db) as ledger, anyio.create_task_group() as tg:
            for log in logs:
                tg.start_soon(ledger.import_log, log)

    anyio.run(fill)
    total = sum(len(log) for log in logs) + len(logs)  # each import adds its decision
    figures = []
    for jobs in sorted({1, os.cpu_count() or 1}):
        async def diff(jobs: int = jobs) -> int:
            async with await Ledger.open(db, create=False) as ledger:
                return len((await ledger.divergences(jobs=jobs))[1])

        differing, seconds = timed(lambda: anyio.run(diff))
        assert differing == 0
        figures.append(Figure("store re-derivation", f"trialledger --jobs {jobs}", total,
                              seconds, extra=f"{total / seconds / jobs:,.0f} per core; "
                                             f"peak RSS {_replay_peak_mb(db, jobs):.0f} MB"))
    return figures


# The CLI's peak resident memory, workers included (ru_maxrss of every reaped descendant),
# from a small wrapper process: a child forked from this process, which holds the whole
# workload, would count this process's memory as its own.
_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
         "stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")


def _replay_peak_mb(db: str, jobs: int) -> float:
    """Peak RSS of `trialledger replay --all --diff --jobs N` over the store, in MB."""
    done = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m",
                           "trialledger.cli", "replay", "--all", "--diff", "--jobs",
                           str(jobs), "--db", db], capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def rederive_eventsourcing(folder: Path, events: int, cap_s: float) -> Figure:
    per = 10
    app, aggregates = workload.eventsourcing_app(folder / "es-rebuild.db", events // per,
                                                 events_each=per - 1)
    done, start = 0, time.perf_counter()
    for aggregate in aggregates:
        app.repository.get(aggregate.id)
        done += per
        if time.perf_counter() - start > cap_s:
            break
    return Figure("re-derivation", "eventsourcing repository.get", done,
                  time.perf_counter() - start)


# --- 4. analyst queries ---------------------------------------------------------------------


def analyst_queries(folder: Path, sessions: int, events: int) -> list[Figure]:
    from trialledger.adapters.demo.samples import QUESTIONS

    db = folder / "analyst.db"
    logs = workload.session_logs(sessions, max(1, events // sessions - 3))

    async def build() -> None:
        async with await Ledger.open(str(db)) as ledger:
            for start in range(0, len(logs), 500):
                async with anyio.create_task_group() as tg:
                    for log in logs[start:start + 500]:
                        tg.start_soon(ledger.import_log, log)

    _, build_s = timed(lambda: anyio.run(build))
    conn = sqlite3.connect(db)
    figures = [Figure("analyst DB build", f"{sessions} sessions via import", sum(map(len, logs)),
                      build_s)]
    for question, sql in QUESTIONS.items():
        conn.execute(sql).fetchall()  # warm the page cache once
        runs = 5

        def ask(sql: str = sql, runs: int = runs) -> list[Any]:
            return [conn.execute(sql).fetchall() for _ in range(runs)]

        _, seconds = timed(ask)
        figures.append(Figure("analyst query", question[:48], runs, seconds, unit="queries/s",
                              extra=f"{seconds / runs * 1000:.1f} ms each"))
    return figures


# --- 5. streaming ingest --------------------------------------------------------------------


def ingest(folder: Path, megabytes: int) -> Figure:
    exec_log, rollout = workload.codex_logs(folder, megabytes)
    size = exec_log.stat().st_size + rollout.stat().st_size
    done = subprocess.run([sys.executable, "-m", "bench.ingest", str(exec_log), str(rollout)],
                          capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    report = json.loads(done.stdout)
    return Figure("streaming ingest", f"{megabytes} MB exec log + rollout", size,
                  report["seconds"], unit="bytes/s",
                  extra=f"{report['events']} events, peak RSS {report['max_rss_mb']:.0f} MB")


# --- 6. PostgreSQL, 8 writer processes -------------------------------------------------------


def postgres_writers(events: int) -> list[Figure]:
    """The same number of events appended by 1, 2, 4 and 8 writer processes, each on a
    fresh database of one server: how the store scales with writers; then 8 writers with
    the collector as the `trialledger` command sets it (a job's workers run so)."""
    from tests.pg import PostgresServer

    server = PostgresServer.start()
    figures = []
    try:
        for processes, tuned in ((1, False), (2, False), (4, False), (8, False), (8, True)):
            db = server.create_database()
            run = workload.in_processes(
                db, workload.appending(workload.PG_SESSIONS_PER_WRITER, events // processes),
                processes=processes, tuned=tuned)
            _, stored = workload.stored(db, after=len(workload.SETUP) + 1)
            label = f"{processes} process" + ("es" if processes > 1 else "")
            figures.append(Figure(
                "PostgreSQL writers", label + (", tune_collector()" if tuned else ""),
                stored, run.seconds,
                extra=f"lost {events - stored}; CPU/event: writers "
                      f"{run.cpu / stored * 1e6:.0f} us, server and the rest "
                      f"{(run.machine_cpu - run.cpu) / stored * 1e6:.0f} us; cores busy "
                      f"{run.machine_cpu / run.seconds / (os.cpu_count() or 1):.0%}"))
    finally:
        server.stop()
    return figures


# --- the run --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    cap = float(size["baseline_cap_s"])
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)

        def add(*new: Figure) -> None:
            for figure in new:
                figures.append(figure)
                print(f"  {figure.name:<20} {figure.method:<40} {figure.rate:>12,.0f} "
                      f"{figure.unit} {figure.extra}", flush=True)

        n_sessions, n_events = int(size["sessions"]), int(size["events"])
        add(durable_ours(folder, n_sessions, n_events))
        add(tuned(lambda: durable_ours(folder, n_sessions, n_events, "tuned")))
        add(durable_processes(folder, n_sessions, n_events))
        add(durable_eventsourcing(folder, n_sessions, n_events, cap))
        add(durable_raw(folder, n_events, cap))
        add(import_ours(folder, n_sessions, n_events))
        add(tuned(lambda: import_ours(folder, n_sessions, n_events, "import-tuned")))
        add(import_processes(folder, n_sessions, n_events))
        add(import_raw(folder, n_events))
        add(rederive_ours(int(size["rederive"])))
        add(rederive_eventsourcing(folder, int(size["rederive"]), cap))
        add(*rederive_store(folder, int(size["store_rederive"])))
        add(*analyst_queries(folder, int(size["query_sessions"]), int(size["query_events"])))
        for megabytes in size["ingest_mb"]:
            add(ingest(folder, int(megabytes)))
        if not args.skip_postgres:
            add(*postgres_writers(int(size["pg_events"])))
    print()

    def pick(name: str, method: str) -> Figure:
        """The figure of workload `name` whose method starts with `method`."""
        return next(f for f in figures if f.name == name and f.method.startswith(method))

    def ratio(label: str, ours: Figure, reference: Figure) -> None:
        print(f"ratio {label}: {ours.rate / reference.rate:.2f}x "
              f"({ours.rate:,.0f} vs {reference.rate:,.0f} {ours.unit})")

    ratio("durable appends, ours / eventsourcing", pick("durable appends", "trialledger ("),
          pick("durable appends", "eventsourcing"))
    cores = os.cpu_count()
    for name, raw in (("durable appends", "raw sqlite3"), ("batched import", "raw executemany")):
        reference = pick(name, "raw")
        ratio(f"{name}, ours / {raw}", pick(name, "trialledger ("), reference)
        ratio(f"{name}, tuned collector / {raw}", pick(name, "trialledger, tune"), reference)
        ratio(f"{name}, {cores} processes / {raw}", pick(name, f"trialledger, {cores} processes"),
              reference)
    ratio("re-derivation, ours / eventsourcing", pick("re-derivation", "trialledger"),
          pick("re-derivation", "eventsourcing"))
    stored = [f for f in figures if f.name == "store re-derivation"]
    if len(stored) == 2:
        ratio(f"store re-derivation, {cores} processes / 1", stored[1], stored[0])
    writers = [f for f in figures if f.name == "PostgreSQL writers"]
    if len(writers) > 2:
        ratio(f"PostgreSQL, {writers[-2].method} / {writers[0].method}", writers[-2],
              writers[0])
        ratio(f"PostgreSQL, {writers[-1].method} / {writers[-2].method}", writers[-1],
              writers[-2])
    ingests = [f for f in figures if f.name == "streaming ingest"]
    if len(ingests) == 2:
        ratio("streaming ingest, large / small throughput", ingests[1], ingests[0])
    print()
    proxy.report(50 if args.quick else 200)  # against a direct call in the same run


if __name__ == "__main__":
    main()
