"""A job as a person reads it (docs/SPEC.md §13): `job run`'s line per finished trial,
`job show`'s figures, `job diff` side by side and `job ls`.

A figure with nothing under it is blank, never 0: a mean over no trial, a token sum no
session has reported (`unknown (2)` when some usage is unknown).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trialledger.adapters.console.plain import plain
from trialledger.adapters.console.render import out, table
from trialledger.core.summary import rewards_text, several_names


def trial_printer(as_json: bool) -> Callable[[Any], None]:
    """One line (or JSON object) per finished trial: its outcome, its reward and its own
    duration (its sessions' wall time of work, SPEC §13; not the time since the job began)."""

    def said(done: Any) -> None:
        if as_json:
            print(json.dumps({"trial_id": done.trial_id, "task": done.task, "k": done.k_index,
                              "outcome": done.outcome, "reward": done.reward,
                              "rewards": done.rewards, "wall_s": done.wall_s,
                              "sessions": done.sessions}), flush=True)
        else:
            out.print(plain(trial_line(done.task, done.k_index, done.outcome, done.rewards,
                                       len(done.sessions), done.wall_s)))

    return said


def trial_line(task: str, k_index: int, outcome: str,
               rewards: Mapping[str, float] | None, sessions: int, wall_s: Any) -> str:
    """A trial in one line: how it ended, its rewards (every name, `reward` first; `no
    reward` when unscored) and its own duration (its sessions' wall time of work, SPEC §13
    — not the time since the job began)."""
    said = rewards_text(rewards)
    took = "" if wall_s is None else f", {float(wall_s):.1f} s"
    return (f"{task} k={k_index} {outcome} {said} "
            f"({sessions} session{'s' * (sessions != 1)}{took})")


def print_job(summary: Mapping[str, Any], *, as_json: bool, trials: bool = False) -> None:
    """A job's figures (per task and overall), then who holds its open trials, its tasks
    that did not run and why; `trials`: first one line per trial."""
    if as_json:
        print(json.dumps(summary, default=str))
        return
    several = len({t["dataset"] for t in summary["tasks"] if t["task"] is not None}) > 1
    named = several_names(summary["tasks"])
    rows = [[*([t["dataset"] or ""] if several else []), figure_name(t),
             *([t["name"] or ""] if named else []), t["trials"],
             t["open"], t["scored"], t["unscored"], number(t["passed"]), number(t["mean"]),
             number(t["mean_scored"]), passk_text(summary["passk"], t), t["retries"],
             t["interrupted"], tokens(t),
             "" if t["wall_s"] is None else f"{float(t['wall_s']):.0f}"]
            for t in summary["tasks"]]
    for t in summary["trials"] if trials else ():
        ended = t["outcome"] if t["state"] == "done" and t["outcome"] else t["state"]
        out.print(plain(trial_line(t["task"], t["k_index"], ended, t["rewards"],
                                   t["attempts"], t["wall_s"])))
    table([*(["dataset"] if several else []), "task", *(["reward"] if named else []),
           "trials", "open", "scored", "unscored", "passed", "mean", "mean scored", "pass@k",
           "retries", "interrupted", "tokens", "wall s"], rows)
    if summary["retries"]:
        out.print(plain("retries by cause: " + ", ".join(
            f"{r['task']} {r['cause_kind']} × {r['sessions']}" for r in summary["retries"])))
    if summary["partial"]:
        out.print(plain(f"partial: {len(summary['open_trials'])} trial(s) still open, left "
                        f"out of every figure"))
        for t in summary["open_trials"]:
            out.print(plain(f"  {t['task']} #{t['k_index']} ({t['trial_id']}): "
                            f"{holder(t)}"))
    for state in ("environment_failed", "no_solution"):
        for task, why in summary[state].items():
            out.print(plain(f"{task}: {state}: {why}"))
    for task, why in summary.get("skipped", {}).items():
        out.print(plain(f"{task}: skipped: {why}"))


def print_job_diff(result: Mapping[str, Any], *, as_json: bool) -> None:
    """`job diff`: each figure of job A and job B with the difference B − A, and whether
    a job's open trials were left out."""
    if as_json:
        print(json.dumps(result, default=str))
        return

    def cells(row: Mapping[str, Any], name: str) -> list[str]:
        side = row[name]
        return [number(side["a"]), number(side["b"]),
                "" if side["diff"] is None else f"{side['diff']:+.3f}"
                if isinstance(side["diff"], float) else f"{side['diff']:+d}"]

    table(["figure", "in", "mean A", "mean B", "Δ", "passed A", "passed B", "Δ", "k",
           "pass@k A", "pass@k B", "Δ", "tokens A", "tokens B", "Δ"],
          [[r["figure"], {"a": "A only", "b": "B only"}.get(str(r["only"]), "both"),
            *cells(r, "mean"), *cells(r, "passed"), number(r["pass_at_k"]["k"]),
            *cells(r, "pass_at_k"), *cells(r, "total_tokens")] for r in result["figures"]])
    if result["partial"]:
        out.print(plain("partial: a job has open trials, left out of its figures"))


def print_jobs(rows: Sequence[Mapping[str, Any]], *, as_json: bool) -> None:
    """`job ls`: every job with its trials by queue state (`as_json`: one object each)."""
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table(["job", "k", "trials", "queued", "running", "done", "environment failed",
           "created"],
          [[r["job"], r["k"], r["trials"], r.get("queued", 0), r.get("running", 0),
            r.get("done", 0), r.get("environment_failed", 0), r["created_at"]] for r in rows])


def holder(trial: Mapping[str, Any]) -> str:
    """Who has an open trial: `queued`, or its runner and when its lease expires."""
    if trial["state"] == "queued":
        return "queued"
    left = trial.get("lease_left_s")
    if left is None:
        return f"held by {trial['runner_id']}"
    left = float(left)
    expiry = (f"its lease expires in {left:.0f} s" if left >= 0 else
              f"its lease expired {-left:.0f} s ago: the next claim takes it over")
    return f"held by {trial['runner_id']}, {expiry}"


def number(value: Any, digits: int = 3) -> str:
    """A figure, or blank when there is none (never a mean over nothing shown as 0)."""
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) \
        else str(value)


def tokens(row: Mapping[str, Any]) -> str:
    """The known token sum and how many sessions' usage is unknown (`tokens 0` is never
    printed for a sum that is not known)."""
    known, unknown = row.get("total_tokens"), row.get("unknown_usage") or 0
    if not unknown:
        return "" if known is None else str(known)  # None: no session ended yet
    return f"unknown ({unknown})" if known is None else f"{known} + {unknown} unknown"


def figure_name(row: Mapping[str, Any]) -> str:
    """A figure's row: its task, `(dataset NAME)` or `(all)`."""
    if row["task"] is not None:
        return str(row["task"])
    return "(all)" if row["dataset"] is None else f"(dataset {row['dataset']})"


def passk_text(passk: Sequence[Mapping[str, Any]], row: Mapping[str, Any]) -> str:
    """A figure's pass@k (of its row's reward name) for each k of Harbor's set, e.g.
    `2: 0.833 4: 1.000`."""
    return " ".join(f"{p['k']}: {p['pass_at_k']:.3f}" for p in passk
                    if p["task"] == row["task"] and p["dataset"] == row["dataset"]
                    and p.get("name") == row.get("name"))
