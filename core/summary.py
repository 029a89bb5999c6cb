"""A job's summary as Harbor computes it (docs/SPEC.md §13): the k set of pass@k, the
estimator per task and over tasks, and the means of reward dicts with unscored trials
counted 0. Pure: the SQL views compute the same figures, and the tests hold them to these.

A trial is given as its reward dict when scored, `None` when finished unscored (Harbor's
trial without a verifier result).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Rewards = Mapping[str, float]


def k_values(max_k: int) -> list[int]:
    """Harbor's k set: {2, 4, 8, …} ∪ {5, 10, 15, …} up to `max_k` (`_eligible_k_values`)."""
    found = {2 ** e for e in range(1, max(1, max_k).bit_length() + 1) if 2 ** e <= max_k}
    found |= set(range(5, max_k + 1, 5))
    return sorted(found)


def pass_at_k_for_task(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k)/C(n, k) as a product (Harbor's `_pass_at_k_for_task`); needs k ≤ n."""
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(k):
        fail *= (n - c - i) / (n - i)
    return 1.0 - fail


def binary(trials: Sequence[Rewards | None]) -> bool:
    """Whether pass@k applies: every scored trial has exactly one reward name, valued 0 or 1."""
    return all(r is None or (len(r) == 1 and next(iter(r.values())) in (0, 1)) for r in trials)


def pass_at_k(tasks: Mapping[str, Sequence[Rewards | None]]) -> dict[int, float]:
    """pass@k for each k of the set up to the fewest trials of any task, averaged over tasks
    (unscored trials count as failures); empty when not `binary` or there is no trial."""
    tasks = {name: trials for name, trials in tasks.items() if trials}
    everything = [r for trials in tasks.values() for r in trials]
    if not tasks or not binary(everything) or len(names(everything)) > 1:
        return {}
    fewest = min(len(trials) for trials in tasks.values())
    counts = [(len(t), sum(1 for r in t if r is not None and next(iter(r.values())) >= 1))
              for t in tasks.values()]
    return {k: sum(pass_at_k_for_task(n, c, k) for n, c in counts) / len(counts)
            for k in k_values(fewest)}


def names(trials: Sequence[Rewards | None]) -> list[str]:
    """The union of the reward names of the scored trials (`aggregate_reward_dicts`' keys)."""
    return sorted({name for r in trials if r is not None for name in r})


def reward(trial: Rewards | None) -> float | None:
    """A trial's one reward: its one value, 0 for `{}`; None when unscored or several names."""
    if trial is None or len(trial) > 1:
        return None
    return float(next(iter(trial.values()), 0.0))


def means(trials: Sequence[Rewards | None]) -> dict[str, float]:
    """Harbor's `Mean`: with at most one name {"mean": …}, else a mean per name; a trial
    without the name (or unscored) counts 0; empty when there is no finished trial."""
    if not trials:
        return {}
    keys = names(trials)
    if len(keys) <= 1:
        return {"mean": sum(reward(r) or 0.0 for r in trials) / len(trials)}
    return {key: sum(0.0 if r is None else r.get(key, 0.0) for r in trials) / len(trials)
            for key in keys}


def mean_scored(trials: Sequence[Rewards | None]) -> float | None:
    """The mean over scored trials only (None when none is scored or there are several
    names)."""
    scored = [r for r in trials if r is not None]
    if not scored or len(names(scored)) > 1:
        return None
    return sum(reward(r) or 0.0 for r in scored) / len(scored)


def ordered(keys: Iterable[str]) -> list[str]:
    """Reward names as every figure lists them: `reward` first when present, then by name."""
    return sorted(set(keys), key=lambda name: (name != "reward", name))


def several(trials: Sequence[Rewards | None]) -> bool:
    """Whether a figure's scored trials carry several reward names between them (then its
    figures are per name, `by_name`)."""
    return len(names(trials)) > 1


def by_name(tasks: Mapping[str, Sequence[Rewards | None]]) -> dict[str, dict[str, Any]]:
    """A figure with several reward names, per name (`reward` first; docs/SPEC.md §13):
    `mean` over the finished trials and `mean_scored` over the scored ones (a trial without
    the name, or unscored, counts 0), `passed` (value ≥ 1) and pass@k by Harbor's estimator
    over that name, both only for a name whose values are all 0 or 1. `tasks`: the tasks the
    figure covers → their finished trials."""
    everything = [r for trials in tasks.values() for r in trials]
    scored = [r for r in everything if r is not None]
    found: dict[str, dict[str, Any]] = {}
    for name in ordered(names(everything)):
        values = [r.get(name, 0.0) for r in scored]
        binary_name = all(v in (0, 1) for v in values)
        as_one = {task: [None if r is None else {name: r.get(name, 0.0)} for r in trials]
                  for task, trials in tasks.items()}
        found[name] = {
            "mean": sum(values) / len(everything) if everything else None,
            "mean_scored": sum(values) / len(scored) if scored else None,
            "passed": sum(1 for v in values if v >= 1) if binary_name else None,
            "pass_at_k": pass_at_k(as_one) if binary_name else {}}
    return found


def rewards_text(rewards: Mapping[str, float] | None) -> str:
    """A trial's rewards as every page and line prints them: `reward 1 coverage 0.5`
    (`reward` first), `reward 0` for a scored `{}` (its one reward, SPEC §13), `no reward`
    when unscored (None)."""
    if rewards is None:
        return "no reward"
    return " ".join(f"{name} {float(rewards[name]):g}" for name in ordered(rewards)) \
        or "reward 0"


def several_names(figures: Sequence[Mapping[str, Any]]) -> bool:
    """Whether some of a job's figures (`job_tasks` rows) has several reward names: a row
    per name."""
    return len({(t["dataset"], t["task"]) for t in figures}) < len(figures)


def figure_key(row: Mapping[str, object]) -> str:
    """How `job diff` matches figures across jobs: a task by its name, an overall row by its
    dataset (the job's total as `(all)`; a dataset's folder name may differ between jobs,
    a task's may not), then a reward name other than `reward` as ` · NAME`."""
    name = row.get("name")
    said = "" if name is None or name == "reward" else f" · {name}"
    if row.get("task") is not None:
        return f"{row['task']}{said}"
    return ("(all)" if row.get("dataset") is None else f"(dataset {row['dataset']})") + said


def difference(a: float | int | None, b: float | int | None) -> float | int | None:
    """b − a, or None when either is unknown."""
    return None if a is None or b is None else b - a


def compare(a: Sequence[Mapping[str, object]], b: Sequence[Mapping[str, object]],
            fields: Sequence[str]) -> list[dict[str, object]]:
    """Figures of two jobs side by side, in A's order then B's extra ones: each `field` as
    {"a", "b", "diff"}; `only` names the one side a figure is in (else None)."""
    left = {figure_key(r): r for r in a}
    right = {figure_key(r): r for r in b}
    keys = [*left, *(k for k in right if k not in left)]
    rows: list[dict[str, object]] = []
    for key in keys:
        ra, rb = left.get(key), right.get(key)
        row: dict[str, object] = {"figure": key,
                                  "only": None if ra and rb else ("a" if ra else "b")}
        for name in fields:
            va = ra.get(name) if ra else None
            vb = rb.get(name) if rb else None
            row[name] = {"a": va, "b": vb, "diff": difference(
                va if isinstance(va, int | float) else None,
                vb if isinstance(vb, int | float) else None)}
        rows.append(row)
    return rows


__all__ = ["binary", "by_name", "compare", "difference", "figure_key", "k_values", "mean_scored",
           "means", "names", "ordered", "pass_at_k", "pass_at_k_for_task", "reward", "rewards_text",
           "several", "several_names"]
