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
from sqlalchemy.ext.asyncio import AsyncConnection

from trialledger.core.canonical import NS
from trialledger.core.cost import Price
from trialledger.store.errors import JobRefused as JobRefused
from trialledger.store.errors import NoJob as NoJob
from trialledger.store.errors import guarded
from trialledger.store.jobfigures import TASK_COLUMNS as TASK_COLUMNS
from trialledger.store.jobfigures import TRIAL_COLUMNS as TRIAL_COLUMNS
from trialledger.store.jobfigures import JobFigures
from trialledger.store.jobfigures import with_defaults as _with_defaults
from trialledger.store.ledger import gone_from_this_host
from trialledger.store.log import in_slices
from trialledger.store.writer import now

T = TypeVar("T")
# Trial ids are uuid5(NS, …) with SPEC §2's NS. A job created before that kept a private
# namespace: its stored configuration names none (`_TRIAL_NS` absent), and it keeps it, so
# a resume finds its trials under the ids they were queued with.
LEGACY_NAMESPACE = uuid.UUID("6f0c35f4-5d52-4c1e-9a0b-7d1f6a0f7b11")
_TRIAL_NS = "trial_namespace"  # the stored configuration's key; never compared on resume
ADHOC = "adhoc"  # Harbor's dataset of the tasks given as task folders
UNCOUNTED_CAP = 3  # harness failures a trial may have beyond max_attempts (SPEC §13)


_REOPEN_SQL = """
UPDATE job_queue SET state = 'queued' WHERE trial_id IN (
  SELECT q.trial_id FROM sessions f JOIN job_queue q ON q.trial_id = f.trial_id
  WHERE q.job = :j AND q.state = 'done' AND q.detail IS NULL
    AND f.close_reason = 'cancelled' AND f.outcome = 'unverified'
    AND NOT EXISTS (SELECT 1 FROM sessions later
                    WHERE later.trial_id = f.trial_id AND later.attempt > f.attempt)
    AND NOT EXISTS (SELECT 1 FROM events e WHERE e.session_id = f.session_id
                    AND e.type IN ('verification.recorded', 'verification.failed'))
    AND (SELECT COUNT(*) FROM sessions s WHERE s.trial_id = q.trial_id
         AND s.close_reason IN ('cancelled', 'recovered')) <= :cap
    AND (SELECT COUNT(*) FROM sessions s WHERE s.trial_id = q.trial_id
         AND COALESCE(s.close_reason, '') NOT IN ('cancelled', 'recovered')) < :m)"""


def trial_id(job: str, task: str, k_index: int, namespace: uuid.UUID = NS) -> str:
    """`uuid5(NS, "<job>:<task>:<k>")`: the same trial on every machine and every resume
    (`namespace`: an old job's own, `LEGACY_NAMESPACE`)."""
    return str(uuid.uuid5(namespace, f"{job}:{task}:{k_index}"))


def _namespace(stored: Mapping[str, Any]) -> uuid.UUID:
    """The namespace of a stored job's trial ids: the one it names, else the legacy one."""
    return uuid.UUID(str(stored.get(_TRIAL_NS, LEGACY_NAMESPACE)))


@dataclass(frozen=True)
class Claim:
    """A trial a worker holds until it finishes, releases it or its lease expires."""

    trial_id: str
    task: str
    k_index: int
    task_dir: str
    token: str


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))


class Jobs(JobFigures):
    """A store's jobs (shares the ledger's engines): their definition, the queue and its
    leases, and their rows for an export; what they add up to is `JobFigures`'."""

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

    @guarded
    async def define(self, name: str, config: Mapping[str, Any],
                     tasks: Sequence[tuple[str, str]], *, add: bool = False,
                     datasets: Mapping[str, str] | None = None,
                     skipped: Mapping[str, str] | None = None,
                     ignored: Mapping[str, Mapping[str, str]] | None = None,
                     prices: Mapping[str, Price] | None = None,
                     strategies: Mapping[str, str] | None = None) -> bool:
        """Create the job, or check a resumed one: the same configuration but for `k`, which
        may grow (new trials are queued), never shrink, and the same task names (`add`:
        other names are added; the job's own must still all be named). `tasks` are (name,
        folder) pairs; a task's folder may move; `datasets`: task name → its dataset's name
        (absent: `adhoc`); `skipped`: a dataset's tasks skipped as invalid → why (SPEC §15;
        listed by `job show`, in no figure); `ignored`: a task → the fields its runner does
        not honour → why (`job_task_fields`; never part of the configuration, so never
        compared at resume); `prices`: the job's price table (SPEC §18; `job_prices`, never
        compared either: a table given replaces the job's, none keeps it); `strategies`: a
        multi-step task → its `multi_step_reward_strategy` (`job_queue.reward_strategy`,
        how the views take its trials' reward, SPEC §17). A resume also
        queues again the trials an earlier version
        settled on a session cancelled before its verdict (`_REOPEN_SQL`). A refusal writes
        nothing. Returns whether the job was new."""
        k, attempts = int(config["k"]), int(config["max_attempts"])
        async with self._engines.writer.begin() as conn:
            row = (await conn.execute(text("SELECT config, k FROM jobs WHERE name = :n"),
                                      {"n": name})).first()
            namespace = NS if row is None else _namespace(json.loads(row[0]))
            stored = json.dumps({**config, _TRIAL_NS: str(namespace)}, sort_keys=True,
                                separators=(",", ":"))
            if row is None:
                await conn.execute(text(
                    "INSERT INTO jobs (name, config, k, max_attempts, created_at) "
                    "VALUES (:n, :c, :k, :m, :t)"),
                    {"n": name, "c": stored, "k": k, "m": attempts, "t": now()})
            else:
                self._check_resume(name, json.loads(row[0]), int(row[1]), config)
                await self._check_task_names(conn, name, [task for task, _ in tasks], add)
                if k > int(row[1]):
                    await conn.execute(text("UPDATE jobs SET k = :k, config = :c WHERE name = :n"),
                                       {"k": k, "c": stored, "n": name})
            known = {tid for (tid,) in (await conn.execute(
                text("SELECT trial_id FROM job_queue WHERE job = :n"), {"n": name})).all()}
            for task, folder in tasks:
                for index in range(k):
                    tid = trial_id(name, task, index, namespace)
                    strategy = (strategies or {}).get(task)
                    if tid in known:
                        await conn.execute(text(
                            "UPDATE job_queue SET task_dir = :d, reward_strategy = :r "
                            "WHERE trial_id = :t"), {"d": folder, "t": tid, "r": strategy})
                        continue
                    await conn.execute(text(
                        "INSERT INTO job_queue (trial_id, job, task, k_index, task_dir, state, "
                        "dataset, reward_strategy) "
                        "VALUES (:t, :j, :task, :i, :d, 'queued', :ds, :r)"),
                        {"t": tid, "j": name, "task": task, "i": index, "d": folder,
                         "ds": (datasets or {}).get(task, ADHOC), "r": strategy})
            if row is not None:
                await conn.execute(text(_REOPEN_SQL), {"j": name, "m": attempts,
                                                       "cap": UNCOUNTED_CAP})
            await self._record_skipped(conn, name, [t for t, _ in tasks], skipped or {},
                                       datasets or {})
            await self._record_fields(conn, name, [t for t, _ in tasks], ignored or {})
            if prices is not None:
                await self._record_prices(conn, name, prices)
        return row is None

    @staticmethod
    async def _record_prices(conn: AsyncConnection, name: str,
                             prices: Mapping[str, Price]) -> None:
        """The job's price table: the one given replaces the one it had."""
        await conn.execute(text("DELETE FROM job_prices WHERE job = :j"), {"j": name})
        for model, price in sorted(prices.items()):
            await conn.execute(text(
                "INSERT INTO job_prices (job, model, input, cached_input, output, reasoning) "
                "VALUES (:j, :m, :i, :c, :o, :r)"),
                {"j": name, "m": model, "i": price.input, "c": price.cached_input,
                 "o": price.output, "r": price.reasoning})

    @staticmethod
    async def _record_fields(conn: AsyncConnection, name: str, queued: Sequence[str],
                             ignored: Mapping[str, Mapping[str, str]]) -> None:
        """The fields each queued task's runner does not honour, as this run found them."""
        for part in in_slices(list(queued)):
            names = ", ".join(f":t{i}" for i in range(len(part)))
            await conn.execute(text(f"DELETE FROM job_task_fields WHERE job = :j AND task IN "
                                    f"({names})"),
                               {"j": name, **{f"t{i}": task for i, task in enumerate(part)}})
        for task in queued:
            for field, reason in sorted((ignored.get(task) or {}).items()):
                await conn.execute(text(
                    "INSERT INTO job_task_fields (job, task, field, reason) "
                    "VALUES (:j, :t, :f, :r)"), {"j": name, "t": task, "f": field, "r": reason})

    @staticmethod
    async def _record_skipped(conn: AsyncConnection, name: str, queued: Sequence[str],
                              skipped: Mapping[str, str], datasets: Mapping[str, str]
                              ) -> None:
        """The job's skipped tasks as this run found them (a task it queues is no longer
        skipped; one skipped again gets today's reason)."""
        for part in in_slices([*queued, *skipped]):
            names = ", ".join(f":t{i}" for i in range(len(part)))
            await conn.execute(text(f"DELETE FROM job_skipped WHERE job = :j AND task IN "
                                    f"({names})"),
                               {"j": name, **{f"t{i}": task for i, task in enumerate(part)}})
        for task, reason in skipped.items():
            if task not in queued:
                await conn.execute(text(
                    "INSERT INTO job_skipped (job, task, dataset, reason) "
                    "VALUES (:j, :t, :ds, :r)"),
                    {"j": name, "t": task, "ds": datasets.get(task, ADHOC), "r": reason})

    @staticmethod
    def _check_resume(name: str, stored: Mapping[str, Any], stored_k: int,
                      config: Mapping[str, Any]) -> None:
        """A resumed job's configuration must be its own; `k` may only grow."""
        old = {key: value for key, value in _with_defaults(stored).items() if key != _TRIAL_NS}
        changed = [f for f in _differences(old, config) if f != "k"]
        if changed:
            raise JobRefused(f"job {name} was created with another configuration: "
                             f"{', '.join(changed)} differ (start a new job)")
        if int(config["k"]) < stored_k:
            raise JobRefused(f"job {name} has k = {stored_k}; a smaller -k {config['k']} would "
                             f"drop trials (a larger one adds them)")

    @staticmethod
    async def _check_task_names(conn: AsyncConnection, name: str, given: Sequence[str],
                                add: bool) -> None:
        """A resume names the job's tasks, all of them; others only with `add` (SPEC §13)."""
        own = {task for (task,) in (await conn.execute(
            text("SELECT DISTINCT task FROM job_queue WHERE job = :n"), {"n": name})).all()}
        other, missing = sorted(set(given) - own), sorted(own - set(given))
        if other and not add:
            raise JobRefused(f"job {name} has no task{'s' * (len(other) != 1)} "
                             f"{', '.join(other)} (pass --add to add "
                             f"{'them' if len(other) != 1 else 'it'}, or start a new job)")
        if missing:
            raise JobRefused(f"job {name} also has task{'s' * (len(missing) != 1)} "
                             f"{', '.join(missing)}, not named here (name every task of the "
                             f"job, as when it was created)")

    @guarded
    async def config(self, name: str) -> dict[str, Any]:
        async with self._engines.reader.begin() as conn:
            row = (await conn.execute(text("SELECT config FROM jobs WHERE name = :n"),
                                      {"n": name})).first()
        if row is None:
            raise NoJob(f"no job named {name}")
        return _with_defaults(json.loads(row[0]))

    @guarded
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

    @guarded
    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """Extend the lease; False when it is no longer ours (taken over)."""
        return await self._atomic(lambda conn: bool(conn.execute(text(
            f"UPDATE job_queue SET lease_expires = {self._now} + :lease "
            "WHERE trial_id = :t AND lease_token = :tok AND state = 'running'"),
            {"lease": lease_s, "t": claim.trial_id, "tok": claim.token}).rowcount))

    @guarded
    async def settle(self, claim: Claim, state: str, *, detail: str | None = None) -> bool:
        """End our hold: `done`, or `queued` to release the trial to whoever claims next;
        `detail`: why a trial ended otherwise than by its sessions (an unexpected error)."""
        return await self._atomic(lambda conn: bool(conn.execute(text(
            "UPDATE job_queue SET state = :s, detail = :d, lease_token = NULL, "
            "lease_expires = NULL WHERE trial_id = :t AND lease_token = :tok"),
            {"s": state, "d": detail, "t": claim.trial_id, "tok": claim.token}).rowcount))

    @guarded
    async def environment_failed(self, job: str, task: str, reason: str) -> None:
        """Mark every unfinished trial of a task whose environment cannot be prepared."""
        await self._unrunnable(job, task, "environment_failed", reason)

    @guarded
    async def no_solution(self, job: str, task: str, reason: str) -> None:
        """Mark every unfinished trial of an oracle job's task that has no solution (SPEC
        §15): unscored, no session seeded, kept as `environment_failed` is."""
        await self._unrunnable(job, task, "no_solution", reason)

    async def _unrunnable(self, job: str, task: str, state: str, reason: str) -> None:
        """Mark the task's unfinished trials `state`, but for one another holder runs under a
        live lease (it may prepare what this machine cannot; it settles the trial itself)."""
        await self._atomic(lambda conn: conn.execute(text(
            "UPDATE job_queue SET state = :s, detail = :d, "
            "lease_token = NULL, lease_expires = NULL "
            "WHERE job = :j AND task = :t AND state <> 'done' AND NOT (state = 'running' "
            f"AND COALESCE(lease_expires, 0) >= {self._now})"),
            {"s": state, "d": reason, "j": job, "t": task}))

    @guarded
    async def requeue_environment(self, job: str, tasks: Sequence[str]) -> None:
        """Tasks whose environment failed (or that had no solution) before get their trials
        back on a new run (one transaction for all the tasks a run prepared)."""
        def requeue(conn: Connection) -> None:
            for part in in_slices(list(tasks)):
                names = ", ".join(f":t{i}" for i in range(len(part)))
                conn.execute(text(
                    "UPDATE job_queue SET state = 'queued', detail = NULL WHERE job = :j AND "
                    f"state IN ('environment_failed', 'no_solution') AND task IN ({names})"),
                    {"j": job, **{f"t{i}": task for i, task in enumerate(part)}})

        await self._engines.transaction(requeue)

    @guarded
    async def held(self, job: str, tasks: Sequence[str] | None = None) -> int:
        """How many trials of `job` (of `tasks`) are held under a lease now."""
        sql = "SELECT task FROM job_queue WHERE job = :j AND state = 'running'"
        async with self._engines.reader.begin() as conn:
            found = [t for (t,) in (await conn.execute(text(sql), {"j": job})).all()]
        return sum(1 for t in found if tasks is None or t in tasks)

    @guarded
    async def task_folders(self, job: str) -> list[tuple[str, str]]:
        """Each task of `job` with the folder its trials were last queued from."""
        rows = await self._rows("SELECT task, MAX(task_dir) AS task_dir FROM job_queue "
                                "WHERE job = :j GROUP BY task ORDER BY task", job)
        return [(r["task"], r["task_dir"]) for r in rows]

    @guarded
    async def pending(self) -> list[str]:
        """Jobs with a trial queued or held, oldest first."""
        async with self._engines.reader.begin() as conn:
            return [name for (name,) in (await conn.execute(text(
                "SELECT j.name FROM jobs j WHERE EXISTS (SELECT 1 FROM job_queue q WHERE "
                "q.job = j.name AND q.state IN ('queued', 'running')) "
                "ORDER BY j.created_at, j.name"))).all()]

    # --- a job's rows as they are, for `export-harbor` and its import (SPEC §18) ----------

    @guarded
    async def rows_of(self, name: str) -> dict[str, Any]:
        """The job's own rows: `jobs` (its configuration as stored, the trial namespace
        included), its `job_queue` rows without their leases, `job_skipped` and
        `job_task_fields` and `job_prices` — what `restore` writes back into another
        store."""
        async with self._engines.reader.begin() as conn:
            job = (await conn.execute(text(
                "SELECT name, config, k, max_attempts, created_at FROM jobs WHERE name = :n"),
                {"n": name})).mappings().first()
            if job is None:
                raise NoJob(f"no job named {name}")
            found: dict[str, Any] = {"job": dict(job)}
            for key, sql in _OWN_ROWS.items():
                found[key] = [dict(r) for r in (await conn.execute(
                    text(sql), {"n": name})).mappings().all()]
        return found

    @guarded
    async def restore(self, rows: Mapping[str, Any]) -> bool:
        """Write a job's rows (`rows_of`'s shape) as they were, in one transaction, its
        trials settled (a trial left queued or held is written `queued`). A job of that
        name with the same rows is left as it is (False); with other rows, refused."""
        job = dict(rows["job"])
        name = str(job["name"])
        queue = [{**r, "state": r["state"] if r["state"] not in ("running",) else "queued"}
                 for r in rows["queue"]]
        async with self._engines.writer.begin() as conn:
            stored = (await conn.execute(text(
                "SELECT name, config, k, max_attempts, created_at FROM jobs WHERE name = :n"),
                {"n": name})).mappings().first()
            if stored is not None:
                mine = {key: [dict(r) for r in (await conn.execute(
                    text(sql), {"n": name})).mappings().all()]
                    for key, sql in _OWN_ROWS.items()}
                if dict(stored) != job or mine != {**{k: rows.get(k, []) for k in _OWN_ROWS},
                                                    "queue": queue}:
                    raise JobRefused(f"job {name} is already in this store with other "
                                     "trials or another configuration")
                return False
            await conn.execute(text(
                "INSERT INTO jobs (name, config, k, max_attempts, created_at) "
                "VALUES (:name, :config, :k, :max_attempts, :created_at)"), job)
            for row in queue:
                await conn.execute(text(
                    "INSERT INTO job_queue (trial_id, job, task, k_index, task_dir, state, "
                    "detail, dataset) VALUES (:trial_id, :job, :task, :k_index, :task_dir, "
                    ":state, :detail, :dataset)"), {**row, "job": name})
            for row in rows["skipped"]:
                await conn.execute(text(
                    "INSERT INTO job_skipped (job, task, dataset, reason) "
                    "VALUES (:job, :task, :dataset, :reason)"), {**row, "job": name})
            for row in rows["task_fields"]:
                await conn.execute(text(
                    "INSERT INTO job_task_fields (job, task, field, reason) "
                    "VALUES (:job, :task, :field, :reason)"), {**row, "job": name})
            for row in rows.get("prices", []):
                await conn.execute(text(
                    "INSERT INTO job_prices (job, model, input, cached_input, output, "
                    "reasoning) VALUES (:job, :model, :input, :cached_input, :output, "
                    ":reasoning)"), {**row, "job": name})
        return True


_OWN_ROWS = {  # `rows_of` and `restore`: each table's rows of one job, in a stable order
    "queue": "SELECT trial_id, task, k_index, task_dir, state, detail, dataset FROM job_queue "
             "WHERE job = :n ORDER BY task, k_index, trial_id",
    "skipped": "SELECT task, dataset, reason FROM job_skipped WHERE job = :n ORDER BY task",
    "task_fields": "SELECT task, field, reason FROM job_task_fields WHERE job = :n "
                   "ORDER BY task, field",
    "prices": "SELECT model, input, cached_input, output, reasoning FROM job_prices "
              "WHERE job = :n ORDER BY model",
}
