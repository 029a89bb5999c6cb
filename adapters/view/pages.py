"""What each page of `trialledger view` shows, read from the store (docs/SPEC.md §10, §13):
plain dicts and lists for the templates, never HTML. Job figures are `Jobs.summary`'s, the
same rows `job show --json` prints."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from trialledger.adapters.view import charts, render, results
from trialledger.adapters.view.diff import job_diff
from trialledger.adapters.view.names import slug
from trialledger.adapters.view.store import rows
from trialledger.core import why
from trialledger.core.errors import TrialLedgerError
from trialledger.core.summary import rewards_text, several_names
from trialledger.core.why import Ending
from trialledger.store import Ledger
from trialledger.store.jobs import TASK_COLUMNS, Jobs

SEARCH_LIMIT = 500  # sessions one search page lists (the count of all matches is shown)


class NotFound(TrialLedgerError):
    """A page for a job, trial or session the store does not hold."""


def job_state(counts: Mapping[str, Any]) -> str:
    """`queued` (nothing started), `running` (some trial open, some started) or `done`."""
    if not counts.get("queued") and not counts.get("running"):
        return "done"
    started = counts.get("running") or counts.get("done") or counts.get("environment_failed")
    return "running" if started else "queued"


def _overall(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    return next((t for t in summary["tasks"] if t["task"] is None and t["dataset"] is None),
                None)


def _passk(summary: Mapping[str, Any], row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A figure's pass@k rows of its row's reward name."""
    return [p for p in summary["passk"]
            if p["task"] == row["task"] and p["dataset"] == row["dataset"]
            and p.get("name") == row.get("name")]


async def job_names(ledger: Ledger) -> list[str]:
    """Every job's name, oldest first."""
    return [r["job"] for r in await Jobs(ledger).names()]


async def jobs(ledger: Ledger) -> list[dict[str, Any]]:
    """Each job: configuration, state and its overall summary (SPEC §13)."""
    store = Jobs(ledger)
    found = []
    for entry in await store.names():
        summary = await store.summary(entry["job"])
        overall = _overall(summary) or dict.fromkeys(TASK_COLUMNS)
        found.append({"name": entry["job"], "slug": slug(entry["job"]),
                      "config": await store.config(entry["job"]), "counts": entry,
                      "state": job_state(entry), "overall": overall,
                      "passk": _passk(summary, overall),
                      "reward_means": [m for m in summary["reward_means"] if m["task"] is None
                                       and m["dataset"] is None],
                      "retries": _by_cause(summary["retries"]),
                      "partial": summary["partial"]})
    return found


def _by_cause(retries: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    causes: dict[str, int] = {}
    for r in retries:
        causes[str(r["cause_kind"])] = causes.get(str(r["cause_kind"]), 0) + int(r["sessions"])
    return causes


async def job(ledger: Ledger, name: str, *, others: Sequence[Mapping[str, Any]] = ()
              ) -> dict[str, Any]:
    """A job's page: configuration, state, the grid of tasks × trials, the per-task table,
    the overall rows, the charts, and the jobs it can be compared with (`others`: rows
    of `Jobs.names`, this job's among them)."""
    store = Jobs(ledger)
    entry = next((o for o in others if o["job"] == name), None)
    if entry is None:
        raise NotFound(f"no job named {name}")
    summary = await store.summary(name)
    counts = {"queued": 0, "running": 0, "done": 0, "environment_failed": 0, **entry,
              "retries": _by_cause(summary["retries"])}
    task_rows = [t for t in summary["tasks"] if t["task"] is not None]
    several = len({t["dataset"] for t in task_rows}) > 1
    k = max((t["k_index"] for t in summary["trials"]), default=-1) + 1
    ended = await results.endings(ledger, _JOB_SESSIONS, {"job": name})
    grid: dict[str, list[dict[str, Any] | None]] = {}
    for t in summary["trials"]:
        grid.setdefault(t["task"], [None] * k)[t["k_index"]] = _cell(
            t, ended.get(t["final_session_id"] or ""))
    for row in [*task_rows, *(t for t in summary["tasks"] if t["task"] is None)]:
        row["passk_list"] = _passk(summary, row)
    return {"name": name, "slug": slug(name), "config": await store.config(name),
            "state": job_state(counts), "counts": counts, "summary": summary,
            "several_datasets": several, "task_rows": task_rows,
            "several_names": several_names(summary["tasks"]),
            "overall_rows": [t for t in summary["tasks"] if t["task"] is None],
            "k": k, "grid": grid, "reward_chart": _reward_chart(summary, task_rows),
            "tokens": _tokens_histogram(summary["trials"]),
            "compare": [{"name": o["job"], "slug": slug(o["job"])} for o in others
                        if o["job"] != name]}


_JOB_SESSIONS = ("SELECT s.session_id FROM sessions s JOIN job_queue q ON q.trial_id = s.trial_id "
                 "WHERE q.job = :job")


def _cell(trial: Mapping[str, Any], ending: Ending | None) -> dict[str, Any]:
    """A grid cell: the trial's row, its colour, and the texts it shows (its tooltip: what
    ended it and why; its label: the reward, or in a word why there is none; its page),
    worked out here once rather than by filters in the template."""
    scored, rewards = trial["scored"], trial.get("rewards")
    title = f"{trial['state']} · {trial['outcome'] or 'no decision'}"
    if scored:
        title += f" · {rewards_text(rewards)}"
    judged = results.judged(ending)
    if judged["reason"] and trial["state"] not in ("queued", "running"):
        title += f" · {judged['reason']}"
    if scored and rewards is not None:
        label = " ".join(render.number(v, 2) for v in rewards.values()) or render.number(0.0, 2)
    elif judged["label"] and trial["state"] not in ("queued", "running"):
        label = judged["label"]
    else:
        label = trial["outcome"] or trial["state"]
    return dict(trial, css=_cell_class(trial), page=slug(trial["trial_id"]), title=title,
                label=label, result=judged["result"], reason=judged["reason"])


def _cell_class(trial: Mapping[str, Any]) -> str:
    """A grid cell's colour: open, unscored, or the reward in tenths (scored, 0–1)."""
    if trial["state"] in ("queued", "running"):
        return "open"
    if not trial["scored"]:
        return "unscored"
    rewards = trial.get("rewards") or {}  # several names: `reward`'s, else the first's
    reward = next(iter(rewards.values()), trial["reward"])
    if reward is None or not 0 <= reward <= 1:
        return "scored"
    return f"r{round(reward * 10)}"


def _reward_chart(summary: Mapping[str, Any], task_rows: Sequence[Mapping[str, Any]]
                  ) -> charts.Chart:
    """Mean reward per task, or per task and reward name when rewards have several."""
    if several_names(summary["tasks"]):
        return charts.bars([(f"{t['task']} · {t['name']}", t["mean"]) for t in task_rows])
    return charts.bars([(str(t["task"]), t["mean"]) for t in task_rows])


def _tokens_histogram(trials: Sequence[Mapping[str, Any]]) -> charts.Histogram:
    finished = [t for t in trials if t["state"] not in ("queued", "running")]
    known = [int(t["total_tokens"] or 0) for t in finished if not t["unknown_usage"]]
    return charts.histogram(known, sum(1 for t in finished if t["unknown_usage"]))


async def diff(ledger: Ledger, a: str, b: str) -> dict[str, Any]:
    """Two jobs side by side (`job diff A B --json`)."""
    names = await job_names(ledger)
    for name in (a, b):
        if name not in names:
            raise NotFound(f"no job named {name}")
    store = Jobs(ledger)
    result = job_diff(a, await store.summary(a), b, await store.summary(b))
    return dict(result, slug_a=slug(a), slug_b=slug(b))


async def trial(ledger: Ledger, trial_id: str) -> dict[str, Any]:
    """A trial's sessions (attempts) and why each attempt after the first happened."""
    sessions = await rows(ledger, (
        "SELECT s.session_id, s.attempt, s.retry_of, s.task, s.state, s.outcome, "
        "s.close_reason, s.created_at, s.closed_at, s.runner_id, o.rule, o.action, "
        "o.cause_kind, o.cause_message, o.error, o.total_tokens FROM sessions s "
        "LEFT JOIN outcomes o ON o.session_id = s.session_id WHERE s.trial_id = :t "
        "ORDER BY s.attempt, s.created_at"), {"t": trial_id})
    if not sessions:
        raise NotFound(f"no trial {trial_id}")
    by_id = {s["session_id"]: s for s in sessions}
    ended = await results.endings(ledger, "SELECT session_id FROM sessions WHERE trial_id = :t",
                                  {"t": trial_id})
    for s in sessions:
        s["why"] = _why(by_id.get(s["retry_of"] or "")) if s["attempt"] > 1 else None
        s.update(results.judged(ended.get(s["session_id"])))
    member = await Jobs(ledger).trial(trial_id)
    final = sessions[-1]  # the last attempt's: the trial's result (SPEC §13)
    return {"trial_id": trial_id, "task": sessions[0]["task"], "sessions": sessions,
            "result": final["result"], "reason": final["reason"],
            "job": None if member is None else dict(
                member, slug=slug(member["job"]), said=rewards_text(member["rewards"]))}


def _why(before: Mapping[str, Any] | None) -> str:
    """Why the attempt after `before` ran."""
    if before is None:
        return "retries a session this store does not hold"
    if before["close_reason"] in ("cancelled", "recovered"):
        return (f"attempt {before['attempt']} was closed {before['close_reason']} "
                f"(not counted toward --max-attempts)")
    if before["action"] == "retry":
        cause = f", cause {before['cause_kind']}" if before["cause_kind"] else ""
        said = f": {before['cause_message']}" if before["cause_message"] else ""
        return (f"attempt {before['attempt']} was decided retry by rule {before['rule']}"
                f"{cause}{said}")
    return f"attempt {before['attempt']} ended {before['outcome']}"


@dataclass
class Search:
    """The sessions page's filters; each empty one matches everything."""

    task: str = ""
    outcome: str = ""
    rule: str = ""
    gap: str = ""
    model: str = ""
    id: str = ""  # a prefix of a session or trial id
    result: str = ""  # pass, fail or unscored (`core.why`)
    job: str = ""  # only the sessions of this job's trials (an export of one job)
    limit: int = SEARCH_LIMIT
    FIELDS: ClassVar[tuple[str, ...]] = ("task", "outcome", "rule", "gap", "model", "id",
                                         "result")

    @classmethod
    def of(cls, query: Mapping[str, str]) -> Search:
        """The filters a query string gives (a result other than pass, fail or unscored
        matches nothing)."""
        given = {f: query.get(f, "").strip()[:200] for f in cls.FIELDS}
        return cls(task=given["task"], outcome=given["outcome"], rule=given["rule"],
                   gap=given["gap"], model=given["model"], id=given["id"],
                   result=given["result"])


_SEARCH_SQL = ("SELECT s.session_id, s.trial_id, s.task, s.attempt, s.state, s.outcome, "
               "s.model, s.created_at, o.rule, o.cause_kind, o.total_tokens "
               "FROM sessions s LEFT JOIN outcomes o ON o.session_id = s.session_id")
_CLAUSES = {"task": "s.task = :task", "outcome": "s.outcome = :outcome", "rule": "o.rule = :rule",
            "model": "s.model = :model",
            "gap": "EXISTS (SELECT 1 FROM gaps g WHERE g.session_id = s.session_id "
                   "AND g.code = :gap)",
            "id": "(s.session_id LIKE :id ESCAPE '\\' OR s.trial_id LIKE :id ESCAPE '\\')",
            "job": "s.trial_id IN (SELECT trial_id FROM job_queue WHERE job = :job)"}


async def sessions(ledger: Ledger, search: Search) -> dict[str, Any]:
    """Sessions matching the filters (at most `search.limit`), with their gap codes, and
    the values each filter can take."""
    params = {f: getattr(search, f) for f in _CLAUSES if getattr(search, f)}
    if "id" in params:
        params["id"] = re.sub(r"([\\%_])", r"\\\1", params["id"]) + "%"
    clauses = [_CLAUSES[f] for f in params]
    if search.result:  # no parameter: one of three fixed conditions, or none matches
        clauses.append(results.RESULT_SQL.get(search.result, "1 = 0"))
    where = " AND ".join(clauses) or "1 = 1"
    found = await rows(ledger, f"{_SEARCH_SQL} WHERE {where} "
                       f"ORDER BY s.created_at, s.session_id LIMIT {int(search.limit) + 1}",
                       params)
    gaps: dict[str, list[str]] = {}
    for g in await rows(ledger, "SELECT DISTINCT g.session_id, g.code FROM gaps g JOIN "
                        "sessions s ON s.session_id = g.session_id LEFT JOIN outcomes o ON "
                        f"o.session_id = s.session_id WHERE {where} ORDER BY g.code", params):
        gaps.setdefault(g["session_id"], []).append(g["code"])
    ended = await results.endings(ledger, f"SELECT s.session_id FROM sessions s LEFT JOIN "
                                  f"outcomes o ON o.session_id = s.session_id WHERE {where} "
                                  f"ORDER BY s.created_at, s.session_id "
                                  f"LIMIT {int(search.limit)}", params)
    for r in found:
        r["gaps"] = gaps.get(r["session_id"], [])
        r.update(results.judged(ended.get(r["session_id"])))
    scope = {"job": search.job} if search.job else {}
    within = _CLAUSES["job"] if search.job else "1 = 1"
    choices = {name: [r["v"] for r in await rows(ledger, sql.format(within=within), scope)]
               for name, sql in _CHOICES.items()}
    choices["result"] = list(why.RESULTS)
    return {"search": search, "sessions": found[: search.limit],
            "more": len(found) > search.limit, "choices": choices}


_CHOICES = {  # each filter's values in the store (or the exported job)
    "task": "SELECT DISTINCT s.task AS v FROM sessions s WHERE {within} ORDER BY 1",
    "outcome": "SELECT DISTINCT s.outcome AS v FROM sessions s WHERE {within} ORDER BY 1",
    "model": "SELECT DISTINCT s.model AS v FROM sessions s WHERE {within} "
             "AND s.model IS NOT NULL ORDER BY 1",
    "rule": "SELECT DISTINCT o.rule AS v FROM outcomes o JOIN sessions s ON s.session_id = "
            "o.session_id WHERE {within} ORDER BY 1",
    "gap": "SELECT DISTINCT g.code AS v FROM gaps g JOIN sessions s ON s.session_id = "
           "g.session_id WHERE {within} ORDER BY 1",
}
