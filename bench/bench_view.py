"""`trialledger view` (docs/SPEC.md §10): what its two heaviest pages cost the server.

    python -m bench.bench_view [--trials 1000] [--events 10000] [--repeat 7]

1. The job page of a job of `--trials` trials (50 tasks × k, each trial one imported
   session, scored), read from the store and rendered, beside `job show --json` for the
   same job in the same run (`Jobs.summary` and its JSON, what the command prints).
2. The session page of a session of `--events` events (tool calls, each started and
   completed), read, folded (`Ledger.view`) and rendered, beside `show --json` for the
   same session (the view and its JSON): first shown (a server that has not folded the
   session yet) and shown again (its fold kept: another part, a reload).

Each figure is the median of `--repeat` runs on a warm SQLite store (the first run of each
is not counted; the CPU time, the process's, beside it: on a shared machine it drifts less
than the wall time), in a process whose garbage collector is tuned as the `trialledger` command
tunes its own (`tune_collector`; `--default-collector` leaves CPython's). Prints one line
per figure and a `ratio` line per comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import text

from tests.scenarios import CLEAN, THREAD, TURN, LogBuilder, run
from trialledger.adapters.view.session import Folds
from trialledger.adapters.view.site import Site
from trialledger.store import Ledger, tune_collector
from trialledger.store.jobs import Jobs, trial_id

TASKS = 50
CONFIG = {"model": "m", "settings": {}, "grants": [], "max_attempts": 1}


async def _job(ledger: Ledger, name: str, trials: int) -> None:
    """A job of `trials` trials over TASKS tasks, each trial one scored session."""
    k = max(1, trials // TASKS)
    tasks = [f"task-{i:03d}" for i in range(TASKS)]
    await Jobs(ledger).define(name, {**CONFIG, "k": k}, [(t, f"/tasks/{t}") for t in tasks])
    for n, (task, index) in enumerate((t, i) for t in tasks for i in range(k)):
        log = run(CLEAN, 0)
        log.events[0]["data"].update(trial_id=trial_id(name, task, index), task=task)
        log.add("verification.recorded", {"rewards": {"reward": float(n % 3 != 0)},
                                          "detail": None})
        log.add("session.closed", {"reason": "normal"})
        await ledger.import_log(log.events)
    async with ledger._engines.writer.begin() as conn:
        await conn.execute(text("UPDATE job_queue SET state = 'done' WHERE job = :j"),
                           {"j": name})


def _long_session(events: int) -> list[dict[str, Any]]:
    """A session of about `events` events: tool calls, each started and completed."""
    calls = max(1, (events - 12) // 2)
    lines = [THREAD, TURN]
    for i in range(calls):
        item = {"id": f"item_{i}", "type": "command_execution", "command": f"bash -lc 'ls {i}'",
                "aggregated_output": "", "exit_code": None, "status": "in_progress"}
        lines.append(json.dumps({"type": "item.started", "item": item}))
        done = dict(item, aggregated_output=f"file-{i}\n" * (1 + i % 5), exit_code=0,
                    status="completed")
        lines.append(json.dumps({"type": "item.completed", "item": done}))
    lines.append(CLEAN[-1])
    log = LogBuilder().launched().codex(lines).finish(0)
    log.add("verification.recorded", {"rewards": {"reward": 1.0}, "detail": None})
    log.add("session.closed", {"reason": "normal"})
    start = datetime(2026, 11, 29, 8, tzinfo=UTC)
    for i, event in enumerate(log.events):  # the builder's clock counts only to an hour
        event["at"] = (start + timedelta(milliseconds=10 * i)).isoformat().replace(
            "+00:00", "Z")
    return log.events


Figure = tuple[float, float]  # median wall time, median CPU time of the process (ms)


async def _median_ms(work: Callable[[], Awaitable[Any]], repeat: int,
                     setup: Callable[[], None] = lambda: None) -> Figure:
    """`work`'s median over `repeat` runs, `setup` run before each (not timed)."""
    setup()
    await work()  # warm: caches, compiled templates, the first connection
    times, cpu = [], []
    for _ in range(repeat):
        setup()
        start, start_cpu = time.perf_counter(), time.process_time()
        await work()
        times.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)  # its threads' too (SQLite's)
    return statistics.median(times), statistics.median(cpu)


async def main(trials: int, events: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        db = str(Path(folder) / "view.db")
        async with await Ledger.open(db, sqlite_synchronous="OFF") as ledger:
            await _job(ledger, "big", trials)
            session_id = await ledger.import_log(_long_session(events))
        async with await Ledger.open(db, create=False) as ledger:
            site = Site(ledger)
            stored = len(await ledger.events(session_id))
            n_trials = len(await Jobs(ledger).trials("big"))

            async def job_show() -> str:
                return json.dumps(await Jobs(ledger).summary("big"), default=str)

            async def show() -> str:
                return (await ledger.view(session_id)).model_dump_json()

            def unfolded() -> None:
                # A server that has not folded it yet. Set before the clock starts: letting
                # the last run's fold go costs ~25 ms, which a first showing does not pay.
                site.folds = Folds(ledger)

            show_ms = await _median_ms(show, repeat)
            figures = [
                (f"job page, {n_trials} trials", await _median_ms(lambda: site.job("big"),
                                                                  repeat),
                 "job show --json", await _median_ms(job_show, repeat)),
                (f"session page, {stored} events, first shown",
                 await _median_ms(lambda: site.session(session_id), repeat, unfolded),
                 "show --json", show_ms),
                (f"session page, {stored} events, shown again",
                 await _median_ms(lambda: site.session(session_id), repeat),
                 "show --json", show_ms),
            ]
    for name, (page_ms, page_cpu), reference, (reference_ms, reference_cpu) in figures:
        print(f"{name}: {page_ms:.1f} ms (server-side: read and render; CPU {page_cpu:.1f} "
              f"ms); {reference}: {reference_ms:.1f} ms (CPU {reference_cpu:.1f} ms)")
    for name, (page_ms, _), reference, (reference_ms, _) in figures:
        print(f"ratio {name} / {reference}: {page_ms / reference_ms:.2f}x")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--default-collector", action="store_true")
    args = parser.parse_args()
    if not args.default_collector:
        tune_collector()
    anyio.run(main, args.trials, args.events, args.repeat)


if __name__ == "__main__":
    cli()
