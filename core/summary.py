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


def _fail(n: int, c: int, k: int) -> float:
    """C(n−c, k)/C(n, k) as the view `job_passk` multiplies it, left to right (so that both
    give the same float)."""
    fail = 1.0
    for i in range(k):
        fail = fail * (n - c - i) / (n - i)
    return fail


def pass_at_k_for_task(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k)/C(n, k) as a product (Harbor's `_pass_at_k_for_task`); needs k ≤ n."""
    return 1.0 if n - c < k else 1.0 - _fail(n, c, k)


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


def passk_rows(job: str, trials: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the view `job_passk` for one job, in its reads' order, from the job's
    trials as `job_trials` gives them (`state`, `task`, `scored`, `reward`, `passed`), each
    with its `dataset` and `rewards` (its final session's names and values when scored,
    else None). Each figure — a task, a dataset when the job has several, the job — has a
    row per k of Harbor's set (the fewest finished trials of its tasks bounding it) when
    its trials' rewards are binary: by the one reward name they share (`name`: it, None
    when no trial was scored), or per name when they have several."""
    fin = []  # as the view counts a trial: an open one neither finished nor scored
    for t in trials:
        finished = t["state"] not in ("queued", "running")
        counted = finished and bool(t["scored"])
        rewards = t["rewards"] if counted else None
        fin.append({"dataset": t["dataset"], "task": t["task"], "scored": counted,
                    "finished": finished, "reward": t["reward"] if counted else None,
                    "passed": counted and bool(t["passed"]), "rewards": rewards,
                    "name": next(iter(rewards)) if rewards and len(rewards) == 1 else None})
    figures: list[tuple[str | None, str | None]] = sorted({(t["dataset"], t["task"]) for t in fin})
    if len({t["dataset"] for t in fin}) > 1:
        figures += sorted({(t["dataset"], None) for t in fin})
    figures.append((None, None))

    def covered(dataset: str | None, task: str | None) -> list[dict[str, Any]]:
        return [t for t in fin if (dataset is None or t["dataset"] == dataset)
                and (task is None or t["task"] == task)]

    def value(trial: dict[str, Any], name: str | None) -> float | None:
        """A trial's reward under `name` (None: the one name, as `passed` counts it), None
        when unscored."""
        if not trial["scored"]:
            return None
        if name is None:
            return 1.0 if trial["passed"] else 0.0
        return float(trial["rewards"].get(name, 0.0))

    def members(dataset: str | None, task: str | None, name: str | None
                ) -> list[tuple[int, int, bool]]:
        """(n finished, c passed, binary) of each task the figure covers with a finished
        trial, by its reward under `name`."""
        found = []
        for d, t in sorted({(x["dataset"], x["task"]) for x in covered(dataset, task)}):
            own = covered(d, t)
            n = sum(1 for x in own if x["finished"])
            if n:
                values = [value(x, name) for x in own]
                found.append((n, sum(1 for v in values if v is not None and v >= 1),
                              all(v is None or v in (0, 1) for v in values)))
        return found

    def average(tasks: list[tuple[int, int, bool]]) -> dict[int, float]:
        if not tasks or not all(binary for _, _, binary in tasks):
            return {}
        return {k: sum(1 - _fail(n, c, k) for n, c, _ in tasks) / len(tasks)
                for k in k_values(min(n for n, _, _ in tasks))}

    rows: list[dict[str, Any]] = []
    for dataset, task in figures:
        scope = covered(dataset, task)
        scored = [t for t in scope if t["scored"]]
        shared = sorted({t["name"] for t in scored if t["name"] is not None})
        if any(len(t["rewards"]) > 1 for t in scored) or len(shared) > 1:  # several names
            for name in ordered({n for t in scored for n in t["rewards"]}):
                per_name = average(members(dataset, task, name))
                rows += [{"job": job, "dataset": dataset, "task": task, "name": name, "k": k,
                          "pass_at_k": p} for k, p in per_name.items()]
            continue
        # One name at most: pass@k when every scored trial has it, valued 0 or 1.
        if any(len(t["rewards"]) != 1 or t["reward"] not in (0, 1) for t in scored):
            continue
        for k, p in average(members(dataset, task, None)).items():
            rows.append({"job": job, "dataset": dataset, "task": task,
                         "name": shared[0] if shared else None, "k": k, "pass_at_k": p})
    return rows


__all__ = ["binary", "by_name", "compare", "difference", "figure_key", "k_values", "mean_scored",
           "means", "names", "ordered", "pass_at_k", "pass_at_k_for_task", "passk_rows", "reward",
           "rewards_text", "several", "several_names"]
