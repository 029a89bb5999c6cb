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

A job folder is written by agents' harnesses and holds agents' files: it is read without
following links (not even out of the folder), regular files only, under caps, with the
sandbox user's rights (a root runner's own would read a hard link to any file). An unsafe
`codex.txt` or rollout is gap `unsafe_agent_file`; a trial whose `result.json` is missing,
unsafe or malformed refuses the whole job (`HarborJobInvalid` naming the trial) before
anything is stored.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.rollout import usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.adapters.sandbox.agentfiles import AgentTree, LongLine, UnsafeAgentFile
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.session.capture import refused_lines
from trialledger.core import (
    BadEvent,
    IllegalTransition,
    SessionView,
    TrialLedgerError,
    redact,
    replay,
)
from trialledger.core.boundedjson import UnsafeJSON, bounded_loads
from trialledger.store import Ledger

TIMEOUT_ERRORS = frozenset({"AgentTimeoutError"})
EXIT_CODE = re.compile(r"exit(?:ed with)? code (-?\d+)", re.IGNORECASE)
IMPORT_RUNNER = "harbor-import"
RESULT_LIMIT = 16 * 2**20  # bytes of a result.json


class HarborJobInvalid(TrialLedgerError):
    """A job folder that cannot be imported (the message names the trial and why)."""


Tokens = dict[str, int | None]  # input (cached included), cached, output


@dataclass(frozen=True)
class Agreement:
    """How our re-derived decision compares with Harbor's own verdict for one trial."""

    trial: str
    session_id: str
    status: str  # imported | unchanged (the same log was already stored)
    harbor_exception: str | None
    harbor_policy: dict[str, bool] | None  # the exception's error policy, as Harbor applied it
    harbor_verdict: str  # verify | retry | drop
    harbor_reward_valid: bool
    harbor_rewards: dict[str, Any] | None
    our_rule: str
    our_action: str
    our_reward_valid: bool
    our_rewards: dict[str, Any] | None  # Harbor's, where we decide verify; else none
    our_evidence: str  # what our rule decided on: cause, status, error, recorded gaps
    harbor_tokens: Tokens | None
    our_tokens: Tokens | None
    rewards_appended: bool

    @property
    def agrees(self) -> bool:
        """Same verdict and same reward validity (no decision of ours — a session closed
        before one, a step that could not be set up — is Harbor's `drop`)."""
        ours = self.our_action if self.our_action != "-" else "drop"
        return (self.harbor_verdict, self.harbor_reward_valid) == (ours, self.our_reward_valid)

    @property
    def tokens_agree(self) -> bool | None:
        """Whether Harbor's token counts are ours (None when either side has none)."""
        if self.harbor_tokens is None or self.our_tokens is None:
            return None
        return self.harbor_tokens == self.our_tokens

    @property
    def explanation(self) -> str:
        """Why the two differ — Harbor's exception policy against our rule and the evidence
        it decided on — or that they do not."""
        if self.agrees:
            return "same verdict"
        if self.harbor_exception is None:
            harbor = "Harbor: no exception"
        else:
            policy = ", ".join(f"{k} {str(v).lower()}"
                               for k, v in (self.harbor_policy or {}).items())
            harbor = f"Harbor: {self.harbor_exception} ({policy or 'no policy recorded'})"
        harbor += (f" → {self.harbor_verdict}, reward "
                   f"{_validity(self.harbor_reward_valid)}")
        ours = (f"we: rule {self.our_rule} → {self.our_action}, reward "
                f"{_validity(self.our_reward_valid)}, on {self.our_evidence}")
        return f"{harbor}; {ours}"

    def as_json(self) -> dict[str, Any]:
        """Every field, and the derived agreement, explanation and token comparison."""
        return {**self.__dict__, "agrees": self.agrees, "tokens_agree": self.tokens_agree,
                "explanation": self.explanation}


def _validity(valid: bool) -> str:
    return "valid" if valid else "invalid"


def _evidence(view: SessionView) -> str:
    """What a decision rested on, in words: its cause, HTTP status, error and the gaps
    the import recorded (a missing `codex.txt` among them)."""
    decision = view.decision
    said = []
    if decision is not None and decision.cause is not None:
        code = decision.cause.status_code
        said.append(f"cause {decision.cause.kind}" + (f" (status {code})" if code else ""))
    if decision is not None and decision.incomplete_reason:
        said.append(f"incomplete: {decision.incomplete_reason}")
    if decision is not None and decision.error:
        error = decision.error if len(decision.error) <= 160 else decision.error[:157] + "..."
        said.append(f"error {error!r}")
    recorded = sorted({e.data.code for e in view.events if e.type == "gap.recorded"}
                      - {"cleanup_assumed", "harbor_retries_discarded"})
    if recorded:
        said.append("gaps " + ", ".join(recorded))
    return "; ".join(said) or f"a {decision.status if decision else 'missing'} run"


def _object(value: Any) -> dict[str, Any]:
    """A JSON object of a Harbor result, or {} for any other JSON (the folder is the
    agent's: nothing in it is trusted to have Harbor's shape)."""
    return value if isinstance(value, dict) else {}


def _harbor_tokens(result: dict[str, Any]) -> Tokens | None:
    """Harbor's `agent_result` counts (its input includes the cached tokens, as ours)."""
    agent = _object(result.get("agent_result"))
    counts = {name: agent.get(key) for name, key in (
        ("input", "n_input_tokens"), ("cached", "n_cache_tokens"), ("output", "n_output_tokens"))}
    if counts["input"] is None and counts["output"] is None:
        return None
    return {k: v if isinstance(v, int) and not isinstance(v, bool) else None
            for k, v in counts.items()}


def _our_tokens(view: SessionView) -> Tokens | None:
    usage = view.usage
    if usage is None:
        return None
    return {"input": usage.input_tokens, "cached": usage.cached_input_tokens,
            "output": usage.output_tokens}


def _harbor_verdict(result: dict[str, Any]) -> tuple[str, bool]:
    info = _object(result.get("exception_info"))
    valid = bool(result.get("reward_valid"))
    if not info:
        return "verify", valid
    policy = _object(info.get("policy"))
    if policy.get("should_retry"):
        return "retry", valid
    return ("verify" if policy.get("should_grade", True) else "drop"), valid


def _at(result: dict[str, Any], *path: str) -> str | None:
    value: Any = result
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, str) else None


def _result(job: AgentTree, trial: str) -> dict[str, Any]:
    try:
        result = bounded_loads(job.read(f"{trial}/result.json", RESULT_LIMIT),
                               limit=RESULT_LIMIT)
    except UnsafeAgentFile as error:
        raise HarborJobInvalid(f"trial {trial}: result.json {error.rule}") from None
    except UnsafeJSON as error:
        raise HarborJobInvalid(f"trial {trial}: result.json is {error.rule}" if error.malformed
                               else f"trial {trial}: result.json: {error.rule}") from None
    if not isinstance(result, dict):
        raise HarborJobInvalid(f"trial {trial}: result.json is not a JSON object")
    return result


def _text_lines(job: AgentTree, path: str, gaps: list[dict[str, Any]], *,
                required: bool = False) -> list[str]:
    """A file's lines, read safely; an unsafe file or over-long line is a gap, and so is
    a `required` one that is missing."""
    lines: list[str] = []
    try:
        for line in job.lines(path):
            if isinstance(line, LongLine):
                gaps.append(UnsafeAgentFile(path, f"a {line.size}-byte line, over the cap "
                                                  "(skipped)").gap())
            else:
                lines.append(line.decode("utf-8", errors="replace"))
    except UnsafeAgentFile as error:
        if error.rule != "missing":
            gaps.append(error.gap())
        elif required:
            gaps.append({"code": "agent_output_missing",
                         "detail": f"{path} is missing: Codex's stream was not kept, so "
                                   "nothing shows that the agent ran"})
    return lines


def _usage_events(job: AgentTree, rollouts: list[str], gaps: list[dict[str, Any]], *,
                  at: str) -> list[dict[str, Any]]:
    """Native usage from a trial's rollouts, read as one stream of lines; each rule their
    lines broke is one gap per file."""
    rules: dict[str, Counter[str]] = {path: Counter() for path in rollouts}
    counting: Counter[str] = Counter()  # refused lines of the file being read

    def lines() -> Iterator[str]:
        for path in rollouts:
            yield from _text_lines(job, path, gaps)
            rules[path] += counting  # the reader asked past its last line: all were read
            counting.clear()

    events = usage_events(lines(), at=at, refused=counting)
    gaps += [error.gap() for path in rollouts for error in refused_lines(path, rules[path])]
    return events


def trial_events(job: AgentTree, trial: str, *, job_retries: int = 0
                 ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """The session id, our events (without verification or close) and Harbor's result."""
    try:
        return _trial_events(job, trial, _result(job, trial), job_retries)
    except (TypeError, ValueError, AttributeError, KeyError) as error:
        raise HarborJobInvalid(f"trial {trial}: result.json has an unexpected shape "
                               f"({type(error).__name__})") from None


def _trial_events(job: AgentTree, trial: str, result: dict[str, Any], job_retries: int
                  ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    started = _at(result, "started_at") or "1970-01-01T00:00:00Z"
    run_start = _at(result, "agent_execution", "started_at") or started
    run_end = _at(result, "agent_execution", "finished_at") or run_start
    agent = result.get("agent_info") or {}
    model = (agent.get("model_info") or {}).get("name") or _at(
        result, "config", "agent", "model_name") or "unknown"
    events: list[dict[str, Any]] = [
        {"type": "session.seeded", "at": started, "data": {
            "trial_id": str(result.get("trial_name") or trial), "attempt": 1,
            "retry_of": None, "runner_id": IMPORT_RUNNER,
            "task": str(result.get("task_name") or trial), "instruction": "",
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
    gaps: list[dict[str, Any]] = []
    for line in _text_lines(job, f"{trial}/agent/codex.txt", gaps, required=True):
        record = parse_stream_line(line)
        if record.gap is not None:  # not JSON: Harbor pipes stderr into the same file
            stderr.append(line)
            continue
        events += record.events(run_end)
    if stderr:
        text = "\n".join(stderr)
        events.append({"type": "agent.stderr", "at": run_end,
                       "data": {"tail": redact(text, ()), "truncated": len(text) > 2000}})
    rollouts, refused = job.find(f"{trial}/agent/sessions", "rollout-*.jsonl")
    gaps += [error.gap() for error in refused]
    events += _usage_events(job, rollouts, gaps, at=run_end)
    events += [{"type": "gap.recorded", "at": run_end, "data": gap} for gap in gaps]
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
    return str(result.get("id") or trial), events, result


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


def trial_folders(job: Path) -> list[str]:
    """The trial folders of a job: every real subfolder (never a link) with a
    `result.json` entry."""
    return sorted(entry.name for entry in os.scandir(job)
                  if entry.is_dir(follow_symlinks=False)
                  and os.path.lexists(os.path.join(entry.path, "result.json")))


def job_tree(job: Path) -> AgentTree:
    """The job folder as the sandbox user reads it (docs/SPEC.md §11): its files were
    written by agents, so a root runner opens them with that user's fs ids — a hard link
    to a file only root may read is a gap, never its content."""
    user = sandbox_user()  # ourselves when not root; root without `setup` is refused
    return AgentTree(job.resolve(), user.uid, user.gid)


def job_retries(job: AgentTree) -> int:
    """The job's `n_retries` (0 when its result.json has none or cannot be read)."""
    try:
        stats = bounded_loads(job.read("result.json", RESULT_LIMIT),
                              limit=RESULT_LIMIT).get("stats", {})
        return int(stats.get("n_retries") or 0)
    except (UnsafeAgentFile, ValueError, AttributeError, TypeError):  # UnsafeJSON among them
        return 0


async def import_job(ledger: Ledger, job: Path) -> list[Agreement]:
    """Import every trial folder of a Harbor job; compare each verdict with ours. Every
    trial is read and checked before the first is stored; each is stored all or nothing.
    (A folder `export-harbor` wrote, with our own logs inside, is `harborexport`'s to
    import: `import-harbor` picks by its `trialledger.json`.)"""
    tree = job_tree(job)
    retries = job_retries(tree)
    trials = trial_folders(job)
    if not trials:
        raise HarborJobInvalid(f"{job}: no trial folder with a result.json in it; is this "
                               "a Harbor job folder (jobs/<job name>/)?")
    prepared = []
    for trial in trials:
        session_id, events, result = trial_events(tree, trial, job_retries=retries)
        events[0]["session_id"] = session_id
        try:
            full, view, appended = completed_events(events, result)
            final = replay(full)  # every line is checked before anything is stored
        except (BadEvent, IllegalTransition, TypeError, AttributeError) as error:
            raise HarborJobInvalid(f"trial {trial}: {error}; nothing was imported") from None
        prepared.append((trial, session_id, result, full, view, final, appended))
    agreements = []
    for trial, session_id, result, full, view, final, appended in prepared:
        stored = bool(await ledger.sessions(session_id=session_id))
        await ledger.import_log(full)  # the same log again is a no-op; a changed one refused
        decision = view.decision
        verdict, harbor_valid = _harbor_verdict(result)
        info = _object(result.get("exception_info"))
        policy = info.get("policy")
        rewards = _object(result.get("verifier_result")).get("rewards")
        agreements.append(Agreement(
            trial=trial, session_id=session_id, status="unchanged" if stored else "imported",
            harbor_exception=info.get("exception_type"),
            harbor_policy={k: bool(v) for k, v in policy.items()}
            if isinstance(policy, dict) else None,
            harbor_verdict=verdict, harbor_reward_valid=harbor_valid,
            harbor_rewards=rewards if isinstance(rewards, dict) else None,
            our_rule=decision.rule if decision else "-",
            our_action=decision.action if decision else "-",
            our_reward_valid=bool(decision and decision.reward_valid),
            our_rewards=final.rewards, our_evidence=_evidence(view),
            harbor_tokens=_harbor_tokens(result), our_tokens=_our_tokens(view),
            rewards_appended=appended,
        ))
    return agreements
