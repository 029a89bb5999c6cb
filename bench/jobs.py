"""Jobs (SPEC §13): what the queue and the scheduler cost.

    python -m bench.jobs [--claims 5000] [--trials 200] [-n 16]

1. Claims on PostgreSQL: `--claims` no-op trials claimed and finished (`claim` + `settle`)
   by 1 and by 4 worker processes — claims per second, and 4 workers against 1 (the queue
   must not serialise workers: `FOR UPDATE SKIP LOCKED`).
2. Scheduling overhead: a job of `--trials` trials whose agent ends at once (the real
   Codex CLI against a scripted endpoint that answers immediately) at `-n`, beside the same
   trials run one after another by `run`'s `SessionRunner.run_trial` in the same run —
   trials per second, and the harness's own CPU time per trial (Codex runs in child
   processes, and the scripted endpoint runs in a process of its own, so
   `time.process_time()` counts only the harness).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

from tests.pg import PostgresServer
from tests.runs import codex_path, make_task
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message
from trialledger.adapters.jobs.queue import JobRunner
from trialledger.adapters.session.runner import RunOptions, SessionRunner
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs

CONFIG = {"model": "m", "settings": {}, "grants": [], "max_attempts": 1}


def _claimer(db: str, name: str, result: Any) -> None:
    async def go() -> int:
        done = 0
        async with await Ledger.open(db) as ledger:
            jobs = Jobs(ledger)
            while (claim := await jobs.claim("bench", name, 60)) is not None:
                await jobs.settle(claim, "done")
                done += 1
        return done

    result.put(anyio.run(go))


def claims(server: PostgresServer, count: int, workers: int) -> float:
    """Claims per second of `workers` processes over a fresh job of `count` trials."""
    db = server.create_database()

    async def define() -> None:
        async with await Ledger.open(db) as ledger:
            tasks = [(f"t{i:05d}", "/nowhere") for i in range(count)]
            await Jobs(ledger).define("bench", {**CONFIG, "k": 1}, tasks)

    anyio.run(define)
    results: Any = multiprocessing.get_context("spawn").Queue()
    procs = [multiprocessing.get_context("spawn").Process(
        target=_claimer, args=(db, f"w{i}", results)) for i in range(workers)]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    total = sum(results.get(timeout=600) for _ in procs)
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join()
    assert total == count, f"{total} claims for {count} trials"
    return count / elapsed


def _serve(urls: Any, stop: Any) -> None:
    with ScriptedEndpoint([message("done")]) as endpoint:
        urls.put(endpoint.url)
        stop.wait()


@contextlib.contextmanager
def _endpoint() -> Iterator[str]:
    """A scripted endpoint that answers at once, in its own process (its CPU is the model
    provider's, not the harness's); its URL."""
    spawn = multiprocessing.get_context("spawn")
    urls, stop = spawn.Queue(), spawn.Event()
    server = spawn.Process(target=_serve, args=(urls, stop), daemon=True)
    server.start()
    try:
        yield urls.get(timeout=60)
    finally:
        stop.set()
        server.join(10)


async def _schedule(db: str, tasks: list[Any], options: RunOptions, concurrency: int,
                    sequential: bool) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    async with await Ledger.open(db) as ledger:
        if sequential:
            for task in tasks:
                await SessionRunner(ledger, task, options).run_trial()
        else:
            await JobRunner(ledger, "bench", tasks, options,
                            concurrency=concurrency).run()
    return time.process_time() - cpu, time.perf_counter() - wall


def scheduling(trials: int, concurrency: int) -> dict[str, tuple[float, float]]:
    """(trials/s, harness CPU ms per trial) for the job and for one-by-one `run`."""
    found = {}
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as work, _endpoint() as url:
        tasks = [make_task(Path(work) / f"t{i:04d}", test_sh="exit 0\n")
                 for i in range(trials)]
        options = RunOptions(model_base_url=url, model="m", codex_bin=codex_path(),
                             runner_id="bench")
        for label, sequential, n in (("run, one by one", True, 1),
                                     (f"job run -n {concurrency}", False, concurrency)):
            cpu, wall = anyio.run(_schedule, f"{work}/{label[:3]}.db", tasks, options, n,
                                  sequential)
            found[label] = (trials / wall, cpu / trials * 1000)
    return found


def report(claim_count: int, trials: int, concurrency: int) -> None:
    server = PostgresServer.start()
    try:
        one = claims(server, claim_count, 1)
        four = claims(server, claim_count, 4)
    finally:
        server.stop()
    print(f"claims on PostgreSQL, {claim_count} no-op trials (claim + finish):")
    print(f"  1 worker process   {one:8.0f} claims/s")
    print(f"  4 worker processes {four:8.0f} claims/s")
    print(f"ratio claims_4_workers/claims_1_worker {four / one:.2f}")
    found = scheduling(trials, concurrency)
    print(f"scheduling, {trials} trials whose agent (real Codex) ends at once:")
    for label, (rate, cpu_ms) in found.items():
        print(f"  {label:<18} {rate:6.2f} trials/s, harness CPU {cpu_ms:6.1f} ms per trial")
    (seq_rate, _), (job_rate, _) = found.values()
    print(f"ratio job_trials_per_s/run_trials_per_s {job_rate / seq_rate:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=5000)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("-n", type=int, default=16)
    args = parser.parse_args()
    report(args.claims, args.trials, args.n)


if __name__ == "__main__":
    main()
