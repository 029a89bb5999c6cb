"""Jobs in the store (docs/SPEC.md §13): the job's configuration, its queue of trials and
their leases. Everything a trial produced stays in its sessions' events; the queue only
says which trials a job has and who holds one.

A claim is one transaction: the first trial that is queued, or running under a lease that
expired in the database's clock (or, on this host, held by a process that is gone), is
given a fresh lease token. PostgreSQL picks it with `FOR UPDATE SKIP LOCKED`, so workers
never wait on each other; SQLite has one writer, which serialises claims by itself.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, text

from trialledger.core.errors import TrialLedgerError
from trialledger.store.ledger import _DB_NOW, Ledger, _guarded, gone_from_this_host
from trialledger.store.log import in_slices
from trialledger.store.writer import now

T = TypeVar("T")
NAMESPACE = uuid.UUID("6f0c35f4-5d52-4c1e-9a0b-7d1f6a0f7b11")  # trial ids of jobs
TRIAL_COLUMNS = ("job", "trial_id", "task", "k_index", "state", "attempts", "final_session_id",
                 "outcome", "reward", "scored", "input_tokens", "output_tokens",
                 "total_tokens", "unknown_usage", "wall_s")
TASK_COLUMNS = ("job", "task", "trials", "scored", "mean_reward", "pass_at_k", "retries",
                "total_tokens", "unknown_usage", "wall_s")


class JobRefused(TrialLedgerError):
    """A job that cannot be created or resumed as asked (the message says why)."""


class NoJob(JobRefused):
    """No job of that name in the store."""


def trial_id(job: str, task: str, k_index: int) -> str:
    """`uuid5(NS, "<job>:<task>:<k>")`: the same trial on every machine and every resume."""
    return str(uuid.uuid5(NAMESPACE, f"{job}:{task}:{k_index}"))


@dataclass(frozen=True)
class Claim:
    """A trial a worker holds until it finishes, releases it or its lease expires."""

    trial_id: str
    task: str
    k_index: int
    task_dir: str
    token: str


def _with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A stored configuration with the fields added since it was written: a job created
    before the agent was part of it ran Codex (SPEC §15)."""
    return {"agent": "codex", **config}


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))


class Jobs:
    """A store's jobs (shares the ledger's engines)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.db = ledger, ledger.db
        self._engines = ledger._engines
        self._now = _DB_NOW[ledger.dialect]
        self.postgres = ledger.dialect == "postgresql"

    async def _atomic(self, work: Callable[[Connection], T]) -> T:
        """`work(conn)` for statements that are each atomic on their own: on PostgreSQL in
        autocommit (no BEGIN and COMMIT round trips: a claim or a settle is one statement,
        half the round trips); on SQLite in one write transaction (its single writer lock)
        run in one crossing to the database thread (`Engines.transaction`)."""
        if not self.postgres:
            return await self._engines.transaction(work)
        async with self._engines.writer.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return await auto.run_sync(work)

    async def define(self, name: str, config: Mapping[str, Any],
                     tasks: Sequence[tuple[str, str]]) -> bool:
        """Create the job, or check a resumed one: the same configuration but for `k`, which
        may grow (new trials are queued), never shrink. `tasks` are (name, folder) pairs; a
        task's folder may move. Returns whether the job was new."""
        k, attempts = int(config["k"]), int(config["max_attempts"])
        stored = json.dumps(dict(config), sort_keys=True, separators=(",", ":"))
        async with self._engines.writer.begin() as conn:
            row = (await conn.execute(text("SELECT config, k FROM jobs WHERE name = :n"),
                                      {"n": name})).first()
            if row is None:
                await conn.execute(text(
                    "INSERT INTO jobs (name, config, k, max_attempts, created_at) "
                    "VALUES (:n, :c, :k, :m, :t)"),
                    {"n": name, "c": stored, "k": k, "m": attempts, "t": now()})
            else:
                old = _with_defaults(json.loads(row[0]))
                changed = [f for f in _differences(old, config) if f != "k"]
                if changed:
                    raise JobRefused(f"job {name} was created with another configuration: "
                                     f"{', '.join(changed)} differ (start a new job)")
                if k < int(row[1]):
                    raise JobRefused(f"job {name} has k = {row[1]}; a smaller -k {k} would "
                                     f"drop trials (a larger one adds them)")
                if k > int(row[1]):
                    await conn.execute(text("UPDATE jobs SET k = :k, config = :c WHERE name = :n"),
                                       {"k": k, "c": stored, "n": name})
            known = {tid for (tid,) in (await conn.execute(
                text("SELECT trial_id FROM job_queue WHERE job = :n"), {"n": name})).all()}
            for task, folder in tasks:
                for index in range(k):
                    tid = trial_id(name, task, index)
                    if tid in known:
                        await conn.execute(text(
                            "UPDATE job_queue SET task_dir = :d WHERE trial_id = :t"),
                            {"d": folder, "t": tid})
                        continue
                    await conn.execute(text(
                        "INSERT INTO job_queue (trial_id, job, task, k_index, task_dir, state) "
                        "VALUES (:t, :j, :task, :i, :d, 'queued')"),
                        {"t": tid, "j": name, "task": task, "i": index, "d": folder})
        return row is None

    async def config(self, name: str) -> dict[str, Any]:
        async with self._engines.reader.begin() as conn:
            row = (await conn.execute(text("SELECT config FROM jobs WHERE name = :n"),
                                      {"n": name})).first()
        if row is None:
            raise NoJob(f"no job named {name}")
        return _with_defaults(json.loads(row[0]))

    async def claim(self, job: str | None, runner_id: str, lease_s: float,
                    tasks: Sequence[str] | None = None) -> Claim | None:
        """Take the next trial that is queued or whose lease expired (None: none left)."""
        token = uuid.uuid4().hex
        where = ["1 = 1"]
        params: dict[str, Any] = {"tok": token, "r": runner_id, "lease": lease_s}
        if job is not None:
            where.append("q.job = :job")
            params["job"] = job
        if tasks is not None:
            where.append("q.task IN (" + ", ".join(f":t{i}" for i in range(len(tasks))) + ")")
            params.update({f"t{i}": task for i, task in enumerate(tasks)})
            if not tasks:
                return None
        # Queued trials first, k-major (every task's first trial before any second one), by
        # the (job, state, k_index, task) index; then a running one whose lease expired.
        # One UPDATE … RETURNING takes it: PostgreSQL skips rows other claimers hold.
        # Orphaned leases only matter once no queued trial is left, so they are released
        # (one more statement) only then.
        lock = " FOR UPDATE SKIP LOCKED" if self.postgres else ""
        picks = [f"SELECT q.trial_id FROM job_queue q WHERE {' AND '.join(where)} AND "
                 f"q.state = 'queued' ORDER BY q.k_index, q.task LIMIT 1{lock}",
                 f"SELECT q.trial_id FROM job_queue q WHERE {' AND '.join(where)} AND "
                 f"q.state = 'running' AND q.lease_expires < {self._now} "
                 f"ORDER BY q.k_index, q.task LIMIT 1{lock}"]

        def take(conn: Connection) -> Claim | None:
            for index, pick in enumerate(picks):
                if index:
                    self._release_orphans(conn)
                got = conn.execute(text(
                    f"UPDATE job_queue SET state = 'running', lease_token = :tok, "
                    f"runner_id = :r, lease_expires = {self._now} + :lease "
                    f"WHERE trial_id = ({pick}) "
                    f"RETURNING trial_id, task, k_index, task_dir"), params).first()
                if got is not None:
                    return Claim(got[0], got[1], int(got[2]), got[3], token)
            return None

        return await self._atomic(take)

    @staticmethod
    def _release_orphans(conn: Connection) -> None:
        """Leases held by processes of this host that are gone expire at once (a killed
        `job run` resumed on the same machine need not wait out its lease)."""
        rows = conn.execute(text(
            "SELECT q.trial_id, q.runner_id FROM job_queue q WHERE q.state = 'running'")).all()
        for tid, runner in rows:
            if gone_from_this_host(runner or ""):
                conn.execute(text(
                    "UPDATE job_queue SET lease_expires = 0 WHERE trial_id = :t"), {"t": tid})

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """Extend the lease; False when it is no longer ours (taken over)."""
        return await self._atomic(lambda conn: bool(conn.execute(text(
            f"UPDATE job_queue SET lease_expires = {self._now} + :lease "
            "WHERE trial_id = :t AND lease_token = :tok AND state = 'running'"),
            {"lease": lease_s, "t": claim.trial_id, "tok": claim.token}).rowcount))

    async def settle(self, claim: Claim, state: str, *, detail: str | None = None) -> bool:
        """End our hold: `done`, or `queued` to release the trial to whoever claims next;
        `detail`: why a trial ended otherwise than by its sessions (an unexpected error)."""
        return await self._atomic(lambda conn: bool(conn.execute(text(
            "UPDATE job_queue SET state = :s, detail = :d, lease_token = NULL, "
            "lease_expires = NULL WHERE trial_id = :t AND lease_token = :tok"),
            {"s": state, "d": detail, "t": claim.trial_id, "tok": claim.token}).rowcount))

    async def environment_failed(self, job: str, task: str, reason: str) -> None:
        """Mark every unfinished trial of a task whose environment cannot be prepared."""
        await self._unrunnable(job, task, "environment_failed", reason)

    async def no_solution(self, job: str, task: str, reason: str) -> None:
        """Mark every unfinished trial of an oracle job's task that has no solution (SPEC
        §15): unscored, no session seeded, kept as `environment_failed` is."""
        await self._unrunnable(job, task, "no_solution", reason)

    async def _unrunnable(self, job: str, task: str, state: str, reason: str) -> None:
        async with self._engines.writer.begin() as conn:
            await conn.execute(text(
                "UPDATE job_queue SET state = :s, detail = :d, "
                "lease_token = NULL, lease_expires = NULL "
                "WHERE job = :j AND task = :t AND state <> 'done'"),
                {"s": state, "d": reason, "j": job, "t": task})

    async def requeue_environment(self, job: str, tasks: Sequence[str]) -> None:
        """Tasks whose environment failed (or that had no solution) before get their trials
        back on a new run (one transaction for all the tasks a run prepared)."""
        async with self._engines.writer.begin() as conn:
            for part in in_slices(list(tasks)):
                names = ", ".join(f":t{i}" for i in range(len(part)))
                await conn.execute(text(
                    "UPDATE job_queue SET state = 'queued', detail = NULL WHERE job = :j AND "
                    f"state IN ('environment_failed', 'no_solution') AND task IN ({names})"),
                    {"j": job, **{f"t{i}": task for i, task in enumerate(part)}})

    async def held(self, job: str, tasks: Sequence[str] | None = None) -> int:
        """How many trials of `job` (of `tasks`) are held under a lease now."""
        sql = "SELECT task FROM job_queue WHERE job = :j AND state = 'running'"
        async with self._engines.reader.begin() as conn:
            found = [t for (t,) in (await conn.execute(text(sql), {"j": job})).all()]
        return sum(1 for t in found if tasks is None or t in tasks)

    async def task_folders(self, job: str) -> list[tuple[str, str]]:
        """Each task of `job` with the folder its trials were last queued from."""
        rows = await self._rows("SELECT task, MAX(task_dir) AS task_dir FROM job_queue "
                                "WHERE job = :j GROUP BY task ORDER BY task", job)
        return [(r["task"], r["task_dir"]) for r in rows]

    async def pending(self) -> list[str]:
        """Jobs with a trial queued or held, oldest first."""
        async with self._engines.reader.begin() as conn:
            return [name for (name,) in (await conn.execute(text(
                "SELECT j.name FROM jobs j WHERE EXISTS (SELECT 1 FROM job_queue q WHERE "
                "q.job = j.name AND q.state IN ('queued', 'running')) "
                "ORDER BY j.created_at, j.name"))).all()]

    async def progress(self, job: str) -> dict[str, Any]:
        """Trials by queue state, and the retries so far by cause (the live display)."""
        counts: dict[str, Any] = {"queued": 0, "running": 0, "done": 0,
                                  "environment_failed": 0}
        async with self._engines.reader.begin() as conn:
            for state, n in (await conn.execute(text(
                    "SELECT state, COUNT(*) FROM job_queue WHERE job = :j GROUP BY state"),
                    {"j": job})).all():
                counts[state] = int(n)
            causes = (await conn.execute(text(
                "SELECT COALESCE(o.cause_kind, o.rule), COUNT(*) FROM job_queue q "
                "JOIN sessions s ON s.trial_id = q.trial_id "
                "JOIN outcomes o ON o.session_id = s.session_id "
                "WHERE q.job = :j AND o.action = 'retry' GROUP BY COALESCE(o.cause_kind, "
                "o.rule) ORDER BY 2 DESC"), {"j": job})).all()
        counts["retries"] = {str(cause): int(n) for cause, n in causes}
        return counts

    async def trials(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_trials`, by task and k index."""
        return await self._rows("SELECT * FROM job_trials WHERE job = :j "
                                "ORDER BY task, k_index", job)

    async def tasks(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_tasks`, by task."""
        return await self._rows("SELECT * FROM job_tasks WHERE job = :j ORDER BY task", job)

    async def failures(self, job: str, state: str = "environment_failed") -> dict[str, str]:
        """Tasks whose environment failed (or in another unrunnable `state`, such as
        `no_solution`) → why."""
        rows = await self._rows("SELECT DISTINCT task, detail FROM job_queue WHERE job = :j "
                                "AND state = :s", job, {"s": state})
        return {r["task"]: r["detail"] for r in rows}

    async def names(self) -> list[dict[str, Any]]:
        """Every job with its trial counts by queue state."""
        async with self._engines.reader.begin() as conn:
            rows = (await conn.execute(text(
                "SELECT j.name, j.k, j.created_at, q.state, COUNT(*) FROM jobs j "
                "JOIN job_queue q ON q.job = j.name GROUP BY j.name, j.k, j.created_at, q.state "
                "ORDER BY j.created_at, j.name"))).all()
        found: dict[str, dict[str, Any]] = {}
        for name, k, created, state, count in rows:
            entry = found.setdefault(name, {"job": name, "k": k, "created_at": created,
                                            "trials": 0})
            entry[state] = int(count)
            entry["trials"] += int(count)
        return list(found.values())

    async def _rows(self, sql: str, job: str, params: Mapping[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
        async with self._engines.reader.begin() as conn:
            if (await conn.execute(text("SELECT 1 FROM jobs WHERE name = :j"),
                                   {"j": job})).first() is None:
                raise NoJob(f"no job named {job}")
            return [dict(r._mapping) for r in await conn.execute(text(sql),
                                                                 {"j": job, **(params or {})})]


for _name in ("define", "config", "claim", "renew", "settle", "environment_failed", "no_solution",
              "requeue_environment", "held", "task_folders", "pending", "progress", "trials",
              "tasks",
              "failures", "names"):
    setattr(Jobs, _name, _guarded(getattr(Jobs, _name)))
