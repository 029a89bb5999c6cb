"""Re-deriving every stored session, split across processes (`replay --all --diff --jobs N`).

A policy change means re-deriving every outcome ever recorded, and the fold is pure CPU:
so the sessions, sorted by id, are cut into chunks that worker processes (spawned, so
nothing of the parent's event loop or connections is shared) read and fold on their own
connections, with the garbage collector off during the fold (the fold makes no cycles
worth collecting; a worker is our own process, while `jobs=1` runs in the caller's, whose
collector is left alone). Chunks come back in order, so the output is the same for any
number of processes.
"""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import runpy
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import anyio
from sqlalchemy import select

from trialledger.core import Event
from trialledger.core.parsing import parse_stored
from trialledger.core.replay import rederive
from trialledger.store.engine import Engines, open_engines
from trialledger.store.log import EVENTS, IN_LIMIT
from trialledger.store.policies import load_installed_policies
from trialledger.store.projections import TABLE_OF

SESSIONS = TABLE_OF["sessions"]

CHUNKS_PER_PROCESS = 4  # more runs than processes: a slow one does not idle the others
MAX_CHUNK = IN_LIMIT  # sessions per chunk: one query's `IN (…)`, and progress moves


@dataclass(frozen=True)
class Difference:
    """A stored session whose recorded decision a re-derivation does not reproduce: the
    first differing decision's seq, and each side as `rule/action` (or `none`)."""

    session_id: str
    seq: int
    recorded: str
    derived: str


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def chunk_differences(engines: Engines, session_ids: Sequence[str],
                            policy: str | None) -> list[Difference]:
    """Re-derive these sessions (their logs read in one query) and return those that
    differ, in the order given."""
    logs: dict[str, list[Event]] = {sid: [] for sid in session_ids}
    async with engines.reader.begin() as conn:
        rows = await conn.execute(
            select(EVENTS.c.session_id, EVENTS.c.data)
            .where(EVENTS.c.session_id.in_(list(session_ids)))
            .order_by(EVENTS.c.session_id, EVENTS.c.seq))
        for sid, data in rows:
            logs[sid].append(parse_stored(data))  # stored: sealed and canonical
    found = []
    for sid in session_ids:
        d = rederive(logs.pop(sid), policy=policy).diverged_at  # no view is built
        if d is not None:
            found.append(Difference(
                sid, d.seq, f"{d.recorded.rule}/{d.recorded.action}" if d.recorded else "none",
                f"{d.derived.rule}/{d.derived.action}" if d.derived else "none"))
    return found


def _worker_chunks(db: str, parts: list[list[str]], policy: str | None,
                   policy_files: tuple[str, ...]) -> list[list[Difference]]:
    """A run of chunks, in a worker process: load the policy files, open the store once
    (opening it for every chunk had been a large share of the work), and derive chunk by
    chunk (one chunk's logs in memory at a time)."""
    load_installed_policies()  # as the parent's Ledger did when it opened
    for path in policy_files:
        runpy.run_path(path)

    async def go() -> list[list[Difference]]:
        async with open_engines(db) as engines:  # (the parent checked its schema)
            return [await chunk_differences(engines, part, policy) for part in parts]

    with _no_gc():  # the worker process is ours: no collector pauses during the fold
        return anyio.run(go)


def chunks(session_ids: Sequence[str], processes: int) -> list[list[str]]:
    """Contiguous chunks of the sorted ids: a few per process, none over MAX_CHUNK."""
    ordered = sorted(session_ids)
    if not ordered:
        return []
    size = max(1, min(MAX_CHUNK, math.ceil(len(ordered) / (processes * CHUNKS_PER_PROCESS))))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def runs(parts: list[list[str]], processes: int) -> list[list[list[str]]]:
    """The chunks in contiguous runs, a few per process: what one worker call derives."""
    if not parts:
        return []
    size = math.ceil(len(parts) / min(len(parts), processes * CHUNKS_PER_PROCESS))
    return [parts[i:i + size] for i in range(0, len(parts), size)]


async def divergences(engines: Engines, db: str, policy: str | None, *, jobs: int,
                      policy_files: Sequence[str] = (),
                      on_sessions: Callable[[int], object] | None = None
                      ) -> tuple[int, list[Difference]]:
    """Every stored session re-derived by `jobs` processes (1: this one)."""
    session_ids = await engines.read(lambda conn: list(conn.execute(
        select(SESSIONS.c.session_id)).scalars()))
    parts = chunks(session_ids, jobs)
    found: list[Difference] = []
    if jobs <= 1:
        for part in parts:
            found += await chunk_differences(engines, part, policy)
            if on_sessions is not None:
                on_sessions(len(part))
        return len(session_ids), found
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        batches = runs(parts, jobs)
        futures = [pool.submit(_worker_chunks, db, batch, policy, tuple(policy_files))
                   for batch in batches]
        for batch, future in zip(batches, futures, strict=True):  # in order: deterministic
            derived = await anyio.to_thread.run_sync(future.result)
            for part, differences in zip(batch, derived, strict=True):
                found += differences
                if on_sessions is not None:
                    on_sessions(len(part))
    return len(session_ids), found
