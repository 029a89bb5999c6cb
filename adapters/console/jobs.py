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
from trialledger.adapters.console.render import out, table, table_width
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
               rewards: Mapping[str, float] | None, sessions: int, wall_s: Any,
               steps: Sequence[Mapping[str, Any]] | None = None) -> str:
    """A trial in one line: how it ended, its rewards (every name, `reward` first; `no
    reward` when unscored; a multi-step trial's by its strategy, then each step's `reward`,
    SPEC §17) and its own duration (its sessions' wall time of work, SPEC §13 — not the
    time since the job began). `sessions`: its attempts, for a multi-step trial."""
    said = rewards_text(rewards)
    took = "" if wall_s is None else f", {float(wall_s):.1f} s"
    counted = "attempt" if steps is not None else "session"
    ran = "" if steps is None else " steps: " + ", ".join(
        f"{step['name']} {'-' if step['reward'] is None else format(step['reward'], 'g')}"
        for step in steps)
    return (f"{task} k={k_index} {outcome} {said}{ran} "
            f"({sessions} {counted}{'s' * (sessions != 1)}{took})")


# `job show` at a width too narrow for every column (docs/cli.md): these always, with
# pass@k of the job's smallest k, then the others in this order as long as they fit — the
# second smallest k's pass@k first. `--wide` shows every column whatever the width.
ESSENTIAL = ("dataset", "task", "reward", "trials", "scored", "passed", "mean")
OPTIONAL = ("open", "unscored", "mean scored", "retries", "interrupted", "tokens", "wall s")
LABEL_WIDTH = 20  # a task's (dataset's, reward name's) name counts this much at most when
# columns are chosen: a longer one folds to make room for the figures
NAMES = ("dataset", "task", "reward")  # the columns that fold; every other one stays whole
NAME_FOLDED = 8  # … as long as the names can fold to this width


def print_job(summary: Mapping[str, Any], *, as_json: bool, trials: bool = False,
              wide: bool = False) -> None:
    """A job's figures (per task and overall), then who holds its open trials, its tasks
    that did not run and why; `trials`: first one line per trial. The columns that fit
    the terminal, or every one when `wide` (docs/cli.md)."""
    if as_json:
        print(json.dumps(summary, default=str))
        return
    for t in summary["trials"] if trials else ():
        ended = t["outcome"] if t["state"] == "done" and t["outcome"] else t["state"]
        out.print(plain(trial_line(t["task"], t["k_index"], ended, t["rewards"],
                                   t["attempts"], t["wall_s"], t.get("steps"))))
    columns, hidden = job_columns(summary, wide=wide, width=out.width)
    rows = list(zip(*columns.values(), strict=True))
    fits = table_width(list(columns), rows, capped={name: NAME_FOLDED for name in NAMES}) \
        <= out.width  # else (`--wide` in a narrow terminal) every column folds its share
    table(list(columns), rows, whole=[c for c in columns if c not in NAMES] if fits else ())
    if hidden:
        out.print(plain(f"not shown at this width: {', '.join(hidden)} (--wide shows every "
                        f"column)"), soft_wrap=False)
    out.print(plain(cost_text(summary)))
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


def job_columns(summary: Mapping[str, Any], *, wide: bool,
                width: int) -> tuple[dict[str, list[str]], list[str]]:
    """`job show`'s table as column → cells, and the columns left out: every column when
    `wide` or when all fit in `width` (names counted at `LABEL_WIDTH` at most); else the
    `ESSENTIAL` ones with pass@k of the smallest k as its own column, then the `OPTIONAL`
    ones (the second smallest k's pass@k first) while they fit."""
    figures = summary["tasks"]
    several = len({t["dataset"] for t in figures if t["task"] is not None}) > 1
    named = several_names(figures)
    every: dict[str, list[str]] = {
        **({"dataset": [t["dataset"] or "" for t in figures]} if several else {}),
        "task": [figure_name(t) for t in figures],
        **({"reward": [t["name"] or "" for t in figures]} if named else {}),
        "trials": [str(t["trials"]) for t in figures],
        "open": [str(t["open"]) for t in figures],
        "scored": [str(t["scored"]) for t in figures],
        "unscored": [str(t["unscored"]) for t in figures],
        "passed": [number(t["passed"]) for t in figures],
        "mean": [number(t["mean"]) for t in figures],
        "mean scored": [number(t["mean_scored"]) for t in figures],
        "pass@k": [passk_text(summary["passk"], t) for t in figures],
        "retries": [str(t["retries"]) for t in figures],
        "interrupted": [str(t["interrupted"]) for t in figures],
        "tokens": [tokens(t) for t in figures],
        "wall s": ["" if t["wall_s"] is None else f"{float(t['wall_s']):.0f}" for t in figures]}

    def needs(columns: Mapping[str, list[str]]) -> int:
        return table_width(list(columns), list(zip(*columns.values(), strict=True)),
                           capped={name: LABEL_WIDTH for name in NAMES})

    if wide or needs(every) <= width:
        return every, []
    smallest = sorted({int(p["k"]) for p in summary["passk"]})[:2]
    each_k = {f"pass@{k}": [passk_text(summary["passk"], t, only=k) for t in figures]
              for k in smallest}
    order = [*(c for c in every if c in ESSENTIAL), *list(each_k)[:1]]
    candidates = {**every, **each_k}
    for name in [*list(each_k)[1:], *OPTIONAL]:
        tried = [*order, name]
        if needs({c: candidates[c] for c in tried}) > width:
            break
        order = tried
    # in the order of every column, each pass@K where pass@k was
    place = {c: ([*every].index(c if c in every else "pass@k"), [*candidates].index(c))
             for c in candidates}
    shown = sorted(order, key=place.__getitem__)
    hidden = [c for c in every if c not in shown and c != "pass@k"]
    if len({p["k"] for p in summary["passk"]}) > len([c for c in shown if c in each_k]):
        hidden.append("pass@k of every k")
    return {c: candidates[c] for c in shown}, hidden


def cost_text(summary: Mapping[str, Any]) -> str:
    """The job's cost in USD (SPEC §18), or why it is unknown — never 0 for unknown."""
    cost = summary.get("cost_usd")
    if cost is not None:
        return f"cost: ${float(cost):.4f}"
    if not summary.get("prices"):
        return "cost: unknown (no price table: job run --prices FILE, or job show --prices FILE)"
    return "cost: unknown (a session's usage is unknown, or its model is not in the price table)"


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
    """`job ls`: every job with its agent, model, trials by queue state, headline mean
    (of `reward`, else its first reward name, named after it) and when it was created, to
    the second (`as_json`: one object each, the time as stored)."""
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table(["job", "agent", "model", "k", "trials", "queued", "running", "done",
           "environment failed", "mean", "created"],
          [[r["job"], r["agent"], r["model"] or "", r["k"], r["trials"], r.get("queued", 0),
            r.get("running", 0), r.get("done", 0), r.get("environment_failed", 0),
            headline(r), str(r["created_at"])[:19].replace("T", " ")] for r in rows])


def headline(row: Mapping[str, Any]) -> str:
    """A job's headline mean: `0.750`, `0.250 (coverage)` when it is not of `reward`,
    blank before any trial finished."""
    name = row.get("mean_name")
    said = number(row.get("mean"))
    return said if name in (None, "reward") or not said else f"{said} ({name})"


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


def passk_text(passk: Sequence[Mapping[str, Any]], row: Mapping[str, Any],
               only: int | None = None) -> str:
    """A figure's pass@k (of its row's reward name) for each k of Harbor's set, e.g.
    `2: 0.833 4: 1.000`; with `only`, that k's value alone (`0.833`, blank without it)."""
    mine = [p for p in passk if p["task"] == row["task"] and p["dataset"] == row["dataset"]
            and p.get("name") == row.get("name")]
    if only is not None:
        return " ".join(f"{p['pass_at_k']:.3f}" for p in mine if int(p["k"]) == only)
    return " ".join(f"{p['k']}: {p['pass_at_k']:.3f}" for p in mine)
