"""Harbor 0.26's job and trial configurations and the job's result, made from a job's rows
(`export-harbor`, SPEC §18). Plain JSON objects in the shape of Harbor's `JobConfig`,
`TrialConfig` and `JobResult` (the tests validate them with Harbor's own models); fields
left out take Harbor's defaults when Harbor reads them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trialledger.store.jobs import ADHOC

OPEN = ("queued", "running")


def _source(dataset: str | None) -> str | None:
    return None if (dataset or ADHOC) == ADHOC else dataset


def _agent(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": config["agent"], "model_name": config.get("model") or None}


def trial_config(trial: Mapping[str, Any], name: str, out: Path, config: Mapping[str, Any],
                 job_id: str) -> dict[str, Any]:
    """Harbor's TrialConfig of one trial: its task (folder and dataset), name, agent."""
    return {"schema_version": 1,
            "task": {"path": trial["task_dir"], "source": _source(trial["dataset"])},
            "trial_name": name, "trials_dir": str(out), "agent": _agent(config),
            "job_id": job_id}


def job_config(rows: Mapping[str, Any], config: Mapping[str, Any], out: Path
               ) -> dict[str, Any]:
    """Harbor's JobConfig: the name, k as `n_attempts`, our attempts as retries, the agent,
    each dataset folder with the tasks the job took from it, and the tasks given alone."""
    datasets: dict[str, set[str]] = defaultdict(set)
    folders: dict[str, str] = {}
    alone: set[str] = set()
    for trial in rows["queue"]:
        dataset = _source(trial["dataset"])
        if dataset is None:
            alone.add(trial["task_dir"])
        else:
            datasets[dataset].add(trial["task"])
            folders[dataset] = str(Path(trial["task_dir"]).parent)
    return {"schema_version": 1, "job_name": rows["job"]["name"], "jobs_dir": str(out.parent),
            "n_attempts": int(rows["job"]["k"]),
            "retry": {"max_retries": int(rows["job"]["max_attempts"]) - 1},
            "agents": [_agent(config)],
            "datasets": [{"path": folders[d], "task_names": sorted(tasks)}
                         for d, tasks in sorted(datasets.items())],
            "tasks": [{"path": path} for path in sorted(alone)]}


def evals_key(result: Mapping[str, Any]) -> str:
    """Harbor's `JobStats.format_agent_evals_key`: agent, model (when one), dataset."""
    info = result["agent_info"]
    model = (info.get("model_info") or {}).get("name")
    dataset = result.get("source") or ADHOC
    return f"{info['name']}__{model}__{dataset}" if model else f"{info['name']}__{dataset}"


def _figure(figures: Mapping[str, Any], dataset: str) -> tuple[str | None, str | None]:
    """The (dataset, task) of the overall figure of a dataset: its own row when the job
    has several datasets, else the job's total row."""
    several = any(t["task"] is None and t["dataset"] is not None for t in figures["tasks"])
    return (dataset, None) if several else (None, None)


def _metrics(figures: Mapping[str, Any], dataset: str) -> tuple[list[dict[str, Any]],
                                                              dict[int, float]]:
    """§13's mean (unscored count 0) of a dataset — per reward name when several — and its
    pass@k, in Harbor's shapes."""
    key = _figure(figures, dataset)
    row = next((t for t in figures["tasks"] if (t["dataset"], t["task"]) == key), None)
    names = {r["name"]: r["mean"] for r in figures["reward_means"]
             if (r["dataset"], r["task"]) == key}
    passk = {int(p["k"]): p["pass_at_k"] for p in figures["passk"]
             if (p["dataset"], p["task"]) == key and p["pass_at_k"] is not None}
    if names:
        return [names], passk
    if row is None or row["mean"] is None:
        return [], passk
    return [{"mean": row["mean"]}], passk


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def job_result(rows: Mapping[str, Any], trials: Sequence[Mapping[str, Any]],
               figures: Mapping[str, Any], job_id: str, retries: int,
               cost_usd: float | None = None) -> dict[str, Any]:
    """Harbor's JobResult (without `trial_results`, as Harbor writes it): counts, per
    agent-model-dataset stats with §13's figures as metrics, tokens of the kept attempts,
    `cost_usd` the job's (every session's, SPEC §18; null when one is unknown)."""
    states = [t["state"] for t in rows["queue"]]
    evals: dict[str, dict[str, Any]] = {}
    for result in trials:
        stats = evals.setdefault(evals_key(result), {
            "n_trials": 0, "n_errors": 0, "metrics": [], "pass_at_k": {},
            "reward_stats": {}, "exception_stats": {}})
        rewards = (result.get("verifier_result") or {}).get("rewards")
        if result["reward_valid"] and rewards:
            stats["n_trials"] += 1
            for name, value in rewards.items():
                stats["reward_stats"].setdefault(name, {}).setdefault(
                    str(value), []).append(result["trial_name"])
        if result.get("exception_info"):
            stats["n_errors"] += 1
            kind = result["exception_info"]["exception_type"]
            stats["exception_stats"].setdefault(kind, []).append(result["trial_name"])
    for key, stats in evals.items():
        stats["metrics"], stats["pass_at_k"] = _metrics(figures, key.rsplit("__", 1)[-1])
    agents = [r.get("agent_result") or {} for r in trials]
    finished = [str(r["finished_at"]) for r in trials if r.get("finished_at")]
    done = not any(s in OPEN for s in states)
    last = max(finished) if finished else rows["job"]["created_at"]
    return {
        "schema_version": 1, "id": job_id, "started_at": rows["job"]["created_at"],
        "updated_at": last, "finished_at": last if done else None,
        "n_total_trials": len(states),
        "stats": {
            "n_completed_trials": sum(1 for s in states if s not in OPEN),
            "n_errored_trials": sum(1 for r in trials if r.get("exception_info")),
            "n_running_trials": states.count("running"),
            "n_pending_trials": states.count("queued"),
            "n_cancelled_trials": sum(
                1 for r in trials
                if (r.get("exception_info") or {}).get("exception_type") == "CancelledError"),
            "n_retries": retries, "evals": evals,
            "n_input_tokens": _sum([a.get("n_input_tokens") for a in agents]),
            "n_cache_tokens": _sum([a.get("n_cache_tokens") for a in agents]),
            "n_output_tokens": _sum([a.get("n_output_tokens") for a in agents]),
            "cost_usd": cost_usd}}
