"""What a job adds up to (docs/SPEC.md §13, §18): its trials with their rewards, steps and
costs, its figures per task and reward name (`job_tasks`, `job_passk`,
`job_reward_means`), its retries, open trials and failures — the reads `job show`, `job
ls`, the view and the export make. `Jobs` (store/jobs.py) writes what these read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, text

from trialledger.core.cost import Price, prices_from, session_cost, total_cost, usage
from trialledger.core.summary import ordered, passk_rows, several_names
from trialledger.store.errors import NoJob, guarded
from trialledger.store.ledger import _DB_NOW, Ledger

TRIAL_COLUMNS = ("job", "trial_id", "task", "k_index", "state", "attempts", "final_session_id",
                 "outcome", "reward", "scored", "input_tokens", "output_tokens",
                 "total_tokens", "unknown_usage", "wall_s", "passed", "interrupted", "cost_usd")
TASK_COLUMNS = ("job", "dataset", "task", "name", "trials", "open", "scored", "unscored", "passed",
                "mean", "mean_scored", "retries", "interrupted", "total_tokens",
                "unknown_usage", "wall_s", "mean_reward", "pass_at_k", "cost_usd")

# Task rows first (by dataset, task), then the overall rows: each dataset's, the job's last.
_FIGURE_ORDER = ("ORDER BY CASE WHEN task IS NULL THEN 1 ELSE 0 END, "
                 "CASE WHEN dataset IS NULL THEN 1 ELSE 0 END, dataset, task")
# A figure's reward names (several: a row each, SPEC §13), `reward` first.
_NAME_ORDER = "CASE WHEN name = 'reward' THEN 0 ELSE 1 END, name"
# The reads of a job's figures (`Jobs.summary` and a method each), `:j` the job's name.
_TASKS_SQL = f"SELECT {{columns}} FROM job_tasks WHERE job = :j {_FIGURE_ORDER}, {_NAME_ORDER}"
# The summary's: `job_tasks` but for pass_at_k and cost_usd, which it has from `job_passk`
# and the trials' costs (SQLite plans a view whole: those two were 95% of planning it).
_FIGURES_SQL = (f"SELECT {', '.join(TASK_COLUMNS[:-2])} FROM job_task_figures WHERE job = :j "
                f"{_FIGURE_ORDER}, {_NAME_ORDER}")
_PASSK_SQL = f"SELECT * FROM job_passk WHERE job = :j {_FIGURE_ORDER}, {_NAME_ORDER}, k"
# Each trial's dataset, as `job_passk` groups them.
_DATASETS_SQL = ("SELECT trial_id, COALESCE(dataset, 'adhoc') AS dataset FROM job_queue "
                 "WHERE job = :j")
# Each trial's reward names and values: of every session of the job's trials (a trial's
# are its final session's, `job_trials.final_session_id`; a multi-step trial's by its
# strategy over its steps: `trial_rewards`, migration 0016).
_REWARDS_SQL = ("SELECT r.session_id, r.name, r.value FROM trial_rewards r "
                "JOIN sessions s ON s.session_id = r.session_id "
                "JOIN job_queue q ON q.trial_id = s.trial_id WHERE q.job = :j")
# The step sessions of the job's multi-step trials (SPEC §17), each with its `reward`.
_STEPS_SQL = ("SELECT s.trial_id, s.attempt, s.step_name, s.step_index, "
              "(SELECT r.value FROM rewards r WHERE r.session_id = s.session_id "
              "AND r.name = 'reward') AS reward FROM sessions s "
              "JOIN job_queue q ON q.trial_id = s.trial_id "
              "WHERE q.job = :j AND s.step_index IS NOT NULL "
              "ORDER BY s.trial_id, s.attempt, s.step_index")
_REWARD_MEANS_SQL = f"SELECT * FROM job_reward_means WHERE job = :j {_FIGURE_ORDER}, name"
# Each job's overall figure, a row per reward name (`job ls`'s headline mean): from
# `job_task_figures`, which SQLite plans in a tenth of `job_tasks`' time.
_HEADLINE_SQL = ("SELECT job, name, mean FROM job_task_figures "
                 "WHERE dataset IS NULL AND task IS NULL")
_RETRIES_SQL = "SELECT * FROM job_retries WHERE job = :j ORDER BY task, cause_kind"
_TRIALS_SQL = "SELECT * FROM job_trials WHERE job = :j ORDER BY task, k_index"
_PRICES_SQL = "SELECT * FROM job_prices WHERE job = :j ORDER BY model"
# Each session of the job's trials with its usage (`outcomes`: none for a session that
# ended without a decision, whose usage is then unknown) and what prices it (SPEC §18).
_SESSION_USAGE_SQL = (
    "SELECT q.trial_id, COALESCE(q.dataset, 'adhoc') AS dataset, s.session_id, s.agent_name, "
    "s.model, o.input_tokens, o.cached_input_tokens, o.output_tokens, "
    "o.reasoning_output_tokens FROM job_queue q JOIN sessions s ON s.trial_id = q.trial_id "
    "LEFT JOIN outcomes o ON o.session_id = s.session_id WHERE q.job = :j")
_SKIPPED_SQL = "SELECT task, reason FROM job_skipped WHERE job = :j ORDER BY task"
_FAILURES_SQL = "SELECT DISTINCT task, detail FROM job_queue WHERE job = :j AND state = :s"
# Trials an earlier version settled `done` on a session cancelled before its verification
# was recorded (SPEC §13: such a session finishes nothing) are queued again when their job
# is resumed — but for those an error ended (`detail`), or past the trial rule's limits:
# `:cap` uncounted sessions, `:m` counted ones (adapters/jobs/trial.py `next_attempt`).
def with_rewards(trials: Sequence[dict[str, Any]],
                 rewards: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """`job_trials` rows, each with `rewards`: its final session's reward names and values,
    `reward` first (SPEC §13), for a scored trial (`{}` when it named none); None for an
    unscored one. `rewards`: (session_id, name, value) rows covering their final sessions."""
    by_session: dict[str, dict[str, float]] = {}
    for session_id, name, value in rewards:
        by_session.setdefault(session_id, {})[name] = float(value)
    found = []
    for trial in trials:
        own = by_session.get(trial["final_session_id"] or "", {})
        found.append(dict(trial, rewards={name: own[name] for name in ordered(own)}
                          if trial["scored"] else None))
    return found


def with_steps(trials: Sequence[dict[str, Any]], steps: Sequence[Mapping[str, Any]]
               ) -> list[dict[str, Any]]:
    """`job_trials` rows, each with `steps`: a multi-step trial's steps of its last attempt
    (its final session's), in order, as {name, reward} (`reward`: that step's `reward`, None
    without one); None for a one-step trial. `steps`: `_STEPS_SQL`'s rows."""
    last: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    for row in steps:
        attempt, found = last.get(row["trial_id"], (0, []))
        if int(row["attempt"]) > attempt:
            attempt, found = int(row["attempt"]), []
        found.append({"name": row["step_name"], "reward": row["reward"]})
        last[row["trial_id"]] = (attempt, found)
    return [dict(trial, steps=last[trial["trial_id"]][1] if trial["trial_id"] in last
                 else None) for trial in trials]


def _prices(rows: Sequence[Mapping[str, Any]]) -> dict[str, Price] | None:
    """A job's price table from its `job_prices` rows (None: it has none)."""
    return prices_from({r["model"]: {f: r[f] for f in ("input", "cached_input", "output",
                                                        "reasoning")} for r in rows}) or None


def with_costs(trials: Sequence[dict[str, Any]], tasks: Sequence[dict[str, Any]],
               sessions: Sequence[Mapping[str, Any]],
               prices: Mapping[str, Price] | None) -> float | None:
    """Each trial's and figure's `cost_usd` (SPEC §18), set in place, and the job's: a
    session's by its usage and model, a trial's the sum of its sessions', a figure's of its
    trials', the job's of all — each None when one it sums is unknown (never 0)."""
    by_trial: dict[str, list[float | None]] = {}
    for s in sessions:
        known = s["input_tokens"] is not None and s["output_tokens"] is not None
        tokens = usage(int(s["input_tokens"]), s["cached_input_tokens"],
                       int(s["output_tokens"]), s["reasoning_output_tokens"]) if known else None
        by_trial.setdefault(s["trial_id"], []).append(
            session_cost(tokens, model=s["model"], agent=s["agent_name"], prices=prices))
    for trial in trials:
        trial["cost_usd"] = total_cost(by_trial.get(trial["trial_id"], []))
    datasets = {r["trial_id"]: r["dataset"] for r in sessions}
    for figure in tasks:
        figure["cost_usd"] = total_cost(
            t["cost_usd"] for t in trials
            if (figure["task"] is None or t["task"] == figure["task"])
            and (figure["dataset"] is None or figure["task"] is not None
                 or datasets.get(t["trial_id"], figure["dataset"]) == figure["dataset"]))
    return total_cost(t["cost_usd"] for t in trials)


def _failures(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    return {r["task"]: r["detail"] for r in rows}


def with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A stored configuration with the fields added since it was written: a job created
    before the agent was part of it ran Codex (SPEC §15)."""
    return {"agent": "codex", **config}


class JobFigures:
    """The reads of a store's jobs (shares the ledger's engines)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.db = ledger, ledger.db
        self._engines = ledger._engines
        self._now = _DB_NOW[ledger.dialect]
        self.postgres = ledger.dialect == "postgresql"

    @guarded
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
                "WHERE q.job = :j AND o.action = 'retry' "
                "AND COALESCE(s.close_reason, '') NOT IN ('cancelled', 'recovered') "
                "GROUP BY COALESCE(o.cause_kind, "
                "o.rule) ORDER BY 2 DESC"), {"j": job})).all()
        counts["retries"] = {str(cause): int(n) for cause, n in causes}
        return counts

    @guarded
    async def trial(self, trial_id: str) -> dict[str, Any] | None:
        """A trial's `job_trials` row with its `rewards` (`with_rewards`), as `job show
        --trials` reads it; None for a trial no job has."""
        def read(conn: Connection) -> dict[str, Any] | None:
            result = conn.execute(text("SELECT * FROM job_trials WHERE trial_id = :t"),
                                  {"t": trial_id})
            keys, row = list(result.keys()), result.first()
            if row is None:
                return None
            found = dict(zip(keys, row, strict=True))
            rewards = conn.execute(text("SELECT session_id, name, value FROM trial_rewards "
                                        "WHERE session_id = :s"),
                                   {"s": found["final_session_id"]}).all()
            return with_rewards([found], rewards)[0]

        return await self._engines.read(read)

    @guarded
    async def trials(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_trials`, by task and k index, each with its `rewards` and `steps`."""
        found = with_rewards(await self._rows(_TRIALS_SQL, job),
                             [(r["session_id"], r["name"], r["value"])
                              for r in await self._rows(_REWARDS_SQL, job)])
        return with_steps(found, await self._rows(_STEPS_SQL, job))

    @guarded
    async def prices(self, job: str) -> dict[str, Price] | None:
        """The job's price table (SPEC §18; None: it was given none)."""
        return _prices(await self._rows(_PRICES_SQL, job))

    @guarded
    async def tasks(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_tasks`: each task's by dataset and name, then the overall rows (a
        dataset's, then the job's total)."""
        return await self._rows(_TASKS_SQL.format(columns="*"), job)

    @guarded
    async def passk(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_passk` (a figure's pass@k for each k of Harbor's set)."""
        return await self._rows(_PASSK_SQL, job)

    @guarded
    async def reward_means(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_reward_means` (a mean per reward name, for several names)."""
        return await self._rows(_REWARD_MEANS_SQL, job)

    @guarded
    async def retries(self, job: str) -> list[dict[str, Any]]:
        """Rows of `job_retries`: retry decisions by task and cause."""
        return await self._rows(_RETRIES_SQL, job)

    @guarded
    async def open_trials(self, job: str) -> list[dict[str, Any]]:
        """Trials still queued or held, with the runner holding each and its lease's expiry
        (seconds from now in the database's clock)."""
        return await self._rows(self._open_trials_sql, job)

    @property
    def _open_trials_sql(self) -> str:
        return ("SELECT task, k_index, trial_id, state, runner_id, "
                f"lease_expires - {self._now} AS lease_left_s FROM job_queue "
                "WHERE job = :j AND state IN ('queued', 'running') ORDER BY task, k_index")

    @guarded
    async def summary(self, job: str, prices: Mapping[str, Price] | None = None
                      ) -> dict[str, Any]:
        """Everything `job show` prints: the figures, trials, open trials and failures —
        the rows of `tasks`, `passk`, … — read in one read transaction (one crossing to
        the database thread on SQLite; one snapshot, so `partial`, the figures and the
        trials agree even while a job runs). Costs (SPEC §18) by `prices` when given, else
        by the job's own table."""
        return await self._engines.read(lambda conn: self._summary(conn, job, prices))

    def _summary(self, conn: Connection, job: str,
                 prices: Mapping[str, Price] | None = None) -> dict[str, Any]:
        if self.postgres:  # READ COMMITTED would give each statement a snapshot of its own
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))

        def rows(sql: str, **params: Any) -> list[dict[str, Any]]:
            result = conn.execute(text(sql), {"j": job, **params})
            keys = list(result.keys())  # once, not a mapping per row (a third of the time)
            return [dict(zip(keys, row, strict=True)) for row in result]

        k = conn.execute(text("SELECT k FROM jobs WHERE name = :j"), {"j": job}).scalar()
        if k is None:
            raise NoJob(f"no job named {job}")
        trials = with_steps(with_rewards(rows(_TRIALS_SQL), [
            (r["session_id"], r["name"], r["value"]) for r in rows(_REWARDS_SQL)]),
            rows(_STEPS_SQL))
        # `job_passk`'s rows computed from the trials (core.summary.passk_rows; the tests
        # hold the two equal): SQLite took 0.06-0.2 s to plan the view, most of a summary.
        datasets = {r["trial_id"]: r["dataset"] for r in rows(_DATASETS_SQL)}
        passk = passk_rows(job, [dict(t, dataset=datasets[t["trial_id"]]) for t in trials])
        # `job_tasks.pass_at_k` is the figure's `job_passk` row at the job's k; taken from
        # the rows above rather than by the view's subquery, which computes job_passk again.
        at_k = {(p["dataset"] or "", p["task"] or "", p["name"] or ""): p["pass_at_k"]
                for p in passk if p["k"] == k}
        # `cost_usd` likewise: computed below (`with_costs`), by `prices` when given.
        tasks = rows(_FIGURES_SQL)
        for t in tasks:
            t["pass_at_k"] = at_k.get((t["dataset"] or "", t["task"] or "", t["name"] or ""))
        # A figure's reward names are several exactly when it has several rows, and the
        # job's overall figure covers every other; with none so, `job_reward_means` has no
        # row and its query (the whole cover) is skipped.
        several = several_names(tasks)
        if prices is None:
            prices = _prices(rows(_PRICES_SQL))
        cost = with_costs(trials, tasks, rows(_SESSION_USAGE_SQL), prices)
        return {"job": job, "partial": any(t["open"] for t in tasks), "tasks": tasks,
                "passk": passk, "reward_means": rows(_REWARD_MEANS_SQL) if several else [],
                "retries": rows(_RETRIES_SQL),
                "trials": trials, "cost_usd": cost,
                "prices": {m: vars(p) for m, p in sorted(prices.items())} if prices else None,
                "open_trials": rows(self._open_trials_sql),
                "environment_failed": _failures(rows(_FAILURES_SQL, s="environment_failed")),
                "no_solution": _failures(rows(_FAILURES_SQL, s="no_solution")),
                "skipped": {r["task"]: r["reason"] for r in rows(_SKIPPED_SQL)}}

    @guarded
    async def skipped(self, job: str) -> dict[str, str]:
        """Tasks of the job's datasets skipped as invalid (SPEC §15) → why."""
        return {r["task"]: r["reason"] for r in await self._rows(_SKIPPED_SQL, job)}

    @guarded
    async def failures(self, job: str, state: str = "environment_failed") -> dict[str, str]:
        """Tasks whose environment failed (or in another unrunnable `state`, such as
        `no_solution`) → why."""
        return _failures(await self._rows(_FAILURES_SQL, job, {"s": state}))

    @guarded
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

    @guarded
    async def overview(self) -> list[dict[str, Any]]:
        """`job ls`: every job as `names` gives it, with its agent, its model (None when it
        names none) and its headline: the overall `mean` of its reward name `reward`, else of
        its first name by name (`mean_name`; both None before any trial finished; a mean
        with no name when no finished trial was scored)."""
        found = await self.names()
        async with self._engines.reader.begin() as conn:
            configs: dict[str, str] = {name: config for name, config in (await conn.execute(
                text("SELECT name, config FROM jobs"))).all()}
            overall = (await conn.execute(text(_HEADLINE_SQL))).all()
        heads: dict[str, dict[str | None, Any]] = {}
        for job, name, mean in overall:
            heads.setdefault(job, {})[name] = mean
        for entry in found:
            config = with_defaults(json.loads(configs[entry["job"]]))
            means = heads.get(entry["job"], {})
            first = next(iter(ordered(n for n in means if n is not None)), None)
            mean = means.get(first, means.get(None))
            entry.update(agent=config["agent"], model=config.get("model") or None,
                         mean=None if mean is None else float(mean),
                         mean_name=first if mean is not None else None)
        return found

    async def _rows(self, sql: str, job: str, params: Mapping[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
        async with self._engines.reader.begin() as conn:
            if (await conn.execute(text("SELECT 1 FROM jobs WHERE name = :j"),
                                   {"j": job})).first() is None:
                raise NoJob(f"no job named {job}")
            result = await conn.execute(text(sql), {"j": job, **(params or {})})
            keys = list(result.keys())  # once, not a mapping per row
            return [dict(zip(keys, row, strict=True)) for row in result]
