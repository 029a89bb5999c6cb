"""`trialledger import-harbor`: a Harbor job folder → one session per trial folder.

Each `<job>/<trial>/` with a `result.json` (Harbor's `TrialResult`) becomes a session
whose id is the trial's `id`, so importing a job twice changes nothing. Harbor's facts
map onto our events: `agent_info` and the task to the seed; `agent/codex.txt` (Codex's
`exec --json` stdout with stderr mixed in) to stream events, its non-JSON lines to the
stderr tail; `agent/sessions/**/rollout-*.jsonl` to native usage; the exception and the
phase timings to `agent.exited`. Harbor keeps no cleanup receipt, so `cleanup.reported`
is recorded confirmed with gap `cleanup_assumed`; a local job keeps only each trial's
last attempt, so the job's `n_retries` is recorded as gap `harbor_retries_discarded`.
Our decision is re-derived from those events; Harbor's rewards become
`verification.recorded` only where it is `verify`, and are otherwise only compared.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.rollout import usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.core import SessionView, redact, replay
from trialledger.store import Ledger

TIMEOUT_ERRORS = frozenset({"AgentTimeoutError"})
EXIT_CODE = re.compile(r"exit(?:ed with)? code (-?\d+)", re.IGNORECASE)
IMPORT_RUNNER = "harbor-import"


@dataclass(frozen=True)
class Agreement:
    """How our re-derived decision compares with Harbor's own verdict for one trial."""

    trial: str
    session_id: str
    harbor_exception: str | None
    harbor_verdict: str  # verify | retry | drop
    harbor_reward_valid: bool
    our_rule: str
    our_action: str
    our_reward_valid: bool
    rewards_appended: bool

    @property
    def agrees(self) -> bool:
        """Same verdict and same reward validity."""
        return (self.harbor_verdict, self.harbor_reward_valid) == (
            self.our_action, self.our_reward_valid)

    @property
    def explanation(self) -> str:
        """Why the two differ (or that they do not)."""
        if self.agrees:
            return "same verdict"
        harbor = (f"Harbor: {self.harbor_exception or 'no exception'} → "
                  f"{self.harbor_verdict}, reward {_validity(self.harbor_reward_valid)}")
        ours = (f"we: rule {self.our_rule} → {self.our_action}, reward "
                f"{_validity(self.our_reward_valid)}")
        return f"{harbor}; {ours}"


def _validity(valid: bool) -> str:
    return "valid" if valid else "invalid"


def _harbor_verdict(result: dict[str, Any]) -> tuple[str, bool]:
    info = result.get("exception_info") or None
    valid = bool(result.get("reward_valid"))
    if not info:
        return "verify", valid
    policy = info.get("policy") or {}
    if policy.get("should_retry"):
        return "retry", valid
    return ("verify" if policy.get("should_grade", True) else "drop"), valid


def _at(result: dict[str, Any], *path: str) -> str | None:
    value: Any = result
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, str) else None


def trial_events(trial: Path, *, job_retries: int = 0) -> tuple[str, list[dict[str, Any]],
                                                                 dict[str, Any]]:
    """The session id, our events (without verification or close) and Harbor's result."""
    result = json.loads((trial / "result.json").read_text(encoding="utf-8"))
    started = _at(result, "started_at") or "1970-01-01T00:00:00Z"
    run_start = _at(result, "agent_execution", "started_at") or started
    run_end = _at(result, "agent_execution", "finished_at") or run_start
    agent = result.get("agent_info") or {}
    model = (agent.get("model_info") or {}).get("name") or _at(
        result, "config", "agent", "model_name") or "unknown"
    events: list[dict[str, Any]] = [
        {"type": "session.seeded", "at": started, "data": {
            "trial_id": str(result.get("trial_name") or trial.name), "attempt": 1,
            "retry_of": None, "runner_id": IMPORT_RUNNER,
            "task": str(result.get("task_name") or trial.name), "instruction": "",
            "agent": {"name": str(agent.get("name", "codex")),
                      "version": str(agent.get("version", "unknown"))},
            "model": model, "settings": {}, "grants": []}},
        {"type": "agent.launched", "at": run_start, "data": {
            "argv": ["codex", "exec", "--json"], "workdir": "/app", "env_keys": [],
            "config_sha256": "", "oom_score_adj": None, "isolation": "external",
            "runner_id": IMPORT_RUNNER}},
    ]
    if job_retries:
        events.append({"type": "gap.recorded", "at": run_start, "data": {
            "code": "harbor_retries_discarded",
            "detail": f"the job retried {job_retries} trial(s); Harbor keeps only the last "
                      "attempt of each, so earlier attempts of this trial may be missing"}})
    stderr: list[str] = []
    codex_log = trial / "agent" / "codex.txt"
    if codex_log.is_file():
        for line in codex_log.read_text(encoding="utf-8", errors="replace").splitlines():
            record = parse_stream_line(line)
            if record.gap is not None:  # not JSON: Harbor pipes stderr into the same file
                stderr.append(line)
                continue
            events += record.events(run_end)
    if stderr:
        text = "\n".join(stderr)
        events.append({"type": "agent.stderr", "at": run_end,
                       "data": {"tail": redact(text, ()), "truncated": len(text) > 2000}})
    rollout_lines: list[str] = []
    for path in sorted((trial / "agent" / "sessions").rglob("rollout-*.jsonl")):
        rollout_lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
    events += usage_events(rollout_lines, at=run_end)
    info = result.get("exception_info") or {}
    kind = info.get("exception_type")
    found = EXIT_CODE.search(str(info.get("exception_message", "")))
    return_code = 0 if not kind else int(found.group(1)) if found else None
    events.append({"type": "agent.exited", "at": run_end, "data": {
        "return_code": return_code, "timed_out": kind in TIMEOUT_ERRORS}})
    events.append({"type": "gap.recorded", "at": run_end, "data": {
        "code": "cleanup_assumed",
        "detail": "Harbor records no cleanup receipt; assumed confirmed"}})
    events.append({"type": "cleanup.reported", "at": run_end,
                   "data": {"confirmed": True, "error": None}})
    return str(result.get("id") or trial.name), events, result


def completed_events(events: list[dict[str, Any]], result: dict[str, Any]
                     ) -> tuple[list[dict[str, Any]], SessionView, bool]:
    """Add Harbor's rewards (only where we decide `verify`) and the close."""
    view = replay(events)
    rewards = (result.get("verifier_result") or {}).get("rewards")
    end = _at(result, "finished_at") or events[-1]["at"]
    out = list(events)
    appended = bool(view.state == "graded" and rewards)
    if appended:
        out.append({"type": "verification.recorded", "at": _at(
            result, "verifier", "finished_at") or end, "data": {
            "rewards": rewards, "detail": "Harbor verifier_result"}})
    out.append({"type": "session.closed", "at": end, "data": {"reason": "imported"}})
    return out, view, appended


def trial_folders(job: Path) -> list[Path]:
    """The trial folders of a job: every subfolder with a `result.json`."""
    return sorted(p.parent for p in job.glob("*/result.json"))


def job_retries(job: Path) -> int:
    """The job's `n_retries` (0 when its result.json has none)."""
    try:
        stats = json.loads((job / "result.json").read_text(encoding="utf-8")).get("stats", {})
        return int(stats.get("n_retries") or 0)
    except (OSError, ValueError, AttributeError):
        return 0


async def import_job(ledger: Ledger, job: Path) -> list[Agreement]:
    """Import every trial folder of a Harbor job; compare each verdict with ours."""
    retries = job_retries(job)
    agreements = []
    for trial in trial_folders(job):
        session_id, events, result = trial_events(trial, job_retries=retries)
        events[0]["session_id"] = session_id
        full, view, appended = completed_events(events, result)
        await ledger.import_log(full)
        decision = view.decision
        verdict, harbor_valid = _harbor_verdict(result)
        agreements.append(Agreement(
            trial=trial.name, session_id=session_id,
            harbor_exception=(result.get("exception_info") or {}).get("exception_type"),
            harbor_verdict=verdict, harbor_reward_valid=harbor_valid,
            our_rule=decision.rule if decision else "-",
            our_action=decision.action if decision else "-",
            our_reward_valid=bool(decision and decision.reward_valid),
            rewards_appended=appended,
        ))
    return agreements
