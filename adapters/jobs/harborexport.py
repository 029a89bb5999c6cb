"""`trialledger export-harbor JOB DIR`: a job as the folder Harbor 0.26 writes (SPEC §18),
and the import of such a folder back (`import-harbor`, its inverse).

    DIR/config.json            Harbor's JobConfig (name, k as n_attempts, agent, datasets)
    DIR/result.json            Harbor's JobResult (stats; the metrics are §13's figures)
    DIR/trialledger.json       the job's own rows (`Jobs.rows_of`): what the import restores
    DIR/<trial>/config.json    Harbor's TrialConfig
    DIR/<trial>/result.json    Harbor's TrialResult of the kept attempt (the last)
    DIR/<trial>/agent/trajectory.json      its ATIF trajectory (core/atif.py)
    DIR/<trial>/verifier/…, artifacts/…    the files it kept (SPEC §15), when on this machine
    DIR/<trial>/trialledger/session.jsonl  its log, every field (as `export` writes it)
    DIR/<trial>/trialledger/attempts/<n>/  an earlier attempt: result.json, session.jsonl,
                                           agent/trajectory.json, verifier/…, artifacts/…
    DIR/<trial>/steps/<name>/agent/…, verifier/…, artifacts/…   a multi-step trial's steps
                                           (its kept attempt), as Harbor keeps them; their
                                           logs in trialledger/steps/<name>/session.jsonl;
                                           an earlier attempt's in attempts/<n>.<step>/

Earlier attempts stay inside their trial's folder: Harbor's resume deletes every job
subfolder without a `result.json`. A trial that never ran (its environment failed, no
solution) still has a folder, with the reason as its exception. The folder is written
beside DIR under a temporary name and renamed at the end: nothing is half-written.

Over 500 lines on purpose: the folder's format is written and read back here, so the
export and its import cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.stream import RENAMED
from trialledger.adapters.jobs.harbor import (
    RESULT_LIMIT,
    Agreement,
    HarborJobInvalid,
    _evidence,
    _harbor_tokens,
    _harbor_verdict,
    _object,
    _our_tokens,
    _result,
    job_tree,
)
from trialledger.adapters.jobs.harborjob import job_config, job_result, trial_config
from trialledger.adapters.sandbox.agentfiles import ROLLOUT_FILE_LIMIT, AgentTree, UnsafeAgentFile
from trialledger.adapters.session import artifacts
from trialledger.core import BadEvent, IllegalTransition, SessionView, TrialLedgerError, replay
from trialledger.core.atif import trajectory
from trialledger.core.boundedjson import UnsafeJSON, bounded_loads
from trialledger.core.canonical import NS
from trialledger.core.cost import Price, session_cost, total_cost
from trialledger.core.events import (
    CODEX_STREAM_TYPES,
    SessionSeeded,
    SessionSeededData,
    VerificationFailed,
    VerificationRecorded,
)
from trialledger.core.steps import NOT_RUN
from trialledger.store import Ledger
from trialledger.store.jobs import ADHOC, Jobs, NoJob

OURS = "trialledger"  # our name inside a trial folder, and of the job's own rows' file
ROWS_FILE = "trialledger.json"
FORMAT = 1  # of trialledger.json
# A trial that ended otherwise than scored, as Harbor names the failure where it has a
# name (its error policy table, `models/trial/error_policy.py`), else in its fashion.
VERIFIER_FAILURES = {"no_reward": "RewardFileNotFoundError",
                     "bad_reward": "VerifierOutputParseError",
                     "timeout": "VerifierTimeoutError", "error": "VerifierError"}
UNRUN = {"environment_failed": "EnvironmentFailedError", "no_solution": "NoSolutionError"}
# A step that could not be set up (closed `step_not_run`), by its gap: Harbor's exception
# for it and whether it leaves the trial's reward valid (Harbor's error table; the job's
# figures say the same, migration 0018). Not retried, nothing graded: as we ran it.
STEP_NOT_RUN = {"step_setup_failed": ("RuntimeError", True),
                "step_healthcheck_failed": ("HealthcheckError", False)}


class ExportRefused(TrialLedgerError):
    """An export that would overwrite something (its folder exists and is not empty)."""


@dataclass(frozen=True)
class Exported:
    """What `export_job` wrote."""

    folder: Path
    trials: int
    earlier_attempts: int
    files_missing: int  # kept files not on this machine (or changed since), left out


def job_uuid(name: str) -> str:
    """The job's id in Harbor's files: the same for every export of the job."""
    return str(uuid.uuid5(NS, f"job:{name}"))


def trial_folder_name(task: str, trial_id: str) -> str:
    """`<task>__<7 characters>`, as Harbor names a trial's folder (unique per trial)."""
    return f"{task[:32].rstrip('_-')}__{trial_id.replace('-', '')[:7]}"


def task_checksum(task_dir: str) -> str:
    """sha256 over the task folder's files (relative path and bytes, in order), when the
    folder is on this machine; `unknown` otherwise. Not Harbor's dirhash (which Harbor
    itself is retiring): a stable fingerprint of the same files."""
    root = Path(task_dir)
    if not root.is_dir():
        return "unknown"
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _policy(*, retry: bool, grade: bool, valid: bool) -> dict[str, bool]:
    return {"should_retry": retry, "should_grade": grade, "has_valid_reward": valid}


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.replace("-", "_").split("_"))


def exception_of(view: SessionView) -> dict[str, Any] | None:
    """Harbor's `exception_info` for how a session ended, None when it was scored; its
    policy (`policy_override`, and the `policy` Harbor computes from it) is our decision."""
    decision, last = view.decision, view.events[-1].at
    failed = next((e for e in view.events if e.type == "verification.failed"), None)
    if view.outcome == "verify" and decision is not None and decision.reward_valid:
        return None
    not_run = next((e for e in reversed(view.events) if e.type == "gap.recorded"
                    and e.data.code in STEP_NOT_RUN), None) \
        if view.close_reason == NOT_RUN else None
    if not_run is not None:
        kind, valid = STEP_NOT_RUN[not_run.data.code]
        message = not_run.data.detail or not_run.data.code
        policy = _policy(retry=False, grade=False, valid=valid)
    elif failed is not None:
        kind = VERIFIER_FAILURES.get(failed.data.reason, "VerifierError")
        message = failed.data.detail or failed.data.reason
        policy = _policy(retry=False, grade=True, valid=False)
    elif view.outcome == "retry" and decision is not None:
        kind = _camel(decision.cause.kind if decision.cause else decision.rule) + "Error"
        message = decision.error or (decision.cause.message if decision.cause else None) or (
            f"rule {decision.rule}: retries exhausted")
        policy = _policy(retry=True, grade=False, valid=False)
    elif view.outcome == "verify" and decision is not None:  # verified, reward not valid
        kind = _camel(decision.rule) + "Error"
        message = decision.error or f"rule {decision.rule}: the reward does not count"
        policy = _policy(retry=False, grade=True, valid=False)
    elif view.outcome in ("interrupted", "pending"):
        kind, message = "CancelledError", f"the session was {view.outcome}"
        policy = _policy(retry=False, grade=False, valid=False)
    else:
        kind = _camel(decision.rule) + "Error" if decision else "UnverifiedError"
        message = (decision.error if decision else None) or "not verified"
        policy = _policy(retry=False, grade=False, valid=False)
    return {"exception_type": kind, "exception_message": message, "exception_traceback": "",
            "occurred_at": last, "policy_override": policy, "policy": policy}


def _seed(view: SessionView) -> SessionSeededData:
    first = view.events[0]
    if not isinstance(first, SessionSeeded):  # replay refuses a log that opens otherwise
        raise TypeError("a session's log opens with session.seeded")
    return first.data


def _at(view: SessionView, kind: str) -> str | None:
    return next((e.at for e in view.events if e.type == kind), None)


def trial_result(view: SessionView | None, *, trial: Mapping[str, Any], name: str,
                 uri: str, config: dict[str, Any], checksum: str, agent: Mapping[str, Any],
                 prices: Mapping[str, Price] | None = None) -> dict[str, Any]:
    """Harbor's TrialResult of one attempt (`view`), or of a trial that never ran; its
    `cost_usd` by the job's `prices` (SPEC §18: null when unknown)."""
    dataset = trial["dataset"] or ADHOC
    result: dict[str, Any] = {
        "schema_version": 1, "task_name": trial["task"], "trial_name": name, "trial_uri": uri,
        "task_id": {"path": trial["task_dir"]},
        "source": None if dataset == ADHOC else dataset, "task_checksum": checksum,
        "config": config}
    if view is None:
        reason = UNRUN.get(trial["state"], "CancelledError")
        policy = _policy(retry=False, grade=False, valid=False)
        return {**result, "id": trial["trial_id"], "agent_info": {
            "name": agent["name"], "version": "unknown",
            "model_info": {"name": agent["model"]} if agent["model"] else None},
            "verifier_result": None, "reward_valid": False, "exception_info": {
                "exception_type": reason, "exception_message": trial["detail"] or trial["state"],
                "exception_traceback": "", "occurred_at": agent["created_at"],
                "policy_override": policy, "policy": policy}}
    seed = _seed(view)
    model = seed.model
    usage = view.usage
    exception = exception_of(view)
    rewards = view.rewards
    return {**result, "id": view.session_id, "agent_info": {
        "name": seed.agent.name, "version": seed.agent.version,
        "model_info": {"name": model} if model else None},
        "agent_result": None if usage is None else {
            "n_input_tokens": usage.input_tokens, "n_cache_tokens": usage.cached_input_tokens,
            "n_output_tokens": usage.output_tokens,
            "cost_usd": session_cost(usage, model=model, agent=seed.agent.name, prices=prices),
            "metadata": {"reasoning_output_tokens": usage.reasoning_output_tokens,
                         "total_tokens": usage.total_tokens}},
        "verifier_result": {"rewards": rewards} if rewards else None,
        "reward_valid": bool(rewards) and (exception is None
                                          or exception["policy"]["has_valid_reward"]),
        "exception_info": exception,
        "started_at": view.events[0].at, "finished_at": view.events[-1].at,
        "agent_execution": {"started_at": _at(view, "agent.launched"),
                            "finished_at": _at(view, "agent.exited")},
        "verifier": {"started_at": _at(view, "cleanup.reported"),
                     "finished_at": next((e.at for e in view.events
                                          if e.type.startswith("verification.")), None)}}


def step_result(name: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """Harbor's StepResult of one step session, from its TrialResult (`trial_result`)."""
    return {"step_name": name, **{key: result.get(key) for key in (
        "agent_result", "verifier_result", "exception_info", "agent_execution", "verifier")}}


def attempt_folder(row: Mapping[str, Any]) -> str:
    """An earlier session's folder under `trialledger/attempts/`: its attempt's number, and
    for a step session the step's (an attempt of a multi-step task is several sessions)."""
    step = row["step_index"]
    return str(row["attempt"]) if step is None else f"{row['attempt']}.{step}"


def step_folder(row: Mapping[str, Any]) -> str:
    """A step session's folder under `steps/`: its step's name (Harbor's), unless the name
    is not one safe folder name (a log imported from elsewhere): then `step-<index>`."""
    name = row["step_name"]
    if isinstance(name, str) and name not in ("", ".", "..") and "/" not in name \
            and "\0" not in name:
        return name
    return f"step-{row['step_index']}"


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")


def codex_stdout(view: SessionView) -> str:
    """The session's Codex stream as `codex exec --json` printed it (Harbor keeps it as
    `agent/codex.txt`): each stream event back under Codex's own type name, a line we
    could not parse as it was."""
    lines = []
    for event in view.events:
        if event.type == "codex.unknown":
            lines.append(str(event.data.model_dump()["line"]))
        elif event.type in CODEX_STREAM_TYPES:
            kind = {v: k for k, v in RENAMED.items()}.get(event.type, event.type)
            data = event.data.model_dump(exclude_unset=True)
            lines.append(json.dumps({"type": kind, **data}, ensure_ascii=False))
    return "".join(line + "\n" for line in lines)


def _copy_rollouts(view: SessionView, agent: Path) -> None:
    """The Codex rollouts the session archived (SPEC §8, `sandbox_logs_dir`), when they
    are on this machine: under `agent/`, at their paths in Codex's home, as Harbor keeps
    them (`agent/sessions/…`)."""
    if not any(e.type == "archive.copied" for e in view.events):
        return
    source = artifacts.session_folder(_seed(view).settings.sandbox_logs_dir, view.session_id)
    if not artifacts.on_this_machine(source, view.session_id):
        return
    tree = AgentTree(source)
    found, _ = tree.find(".", "rollout-*.jsonl")
    for path in found:
        relative = path.removeprefix("./")
        if relative.split("/")[0] in ("verifier", "artifacts"):
            continue
        try:
            data = tree.read(path, ROLLOUT_FILE_LIMIT)
        except UnsafeAgentFile:
            continue
        target = agent / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _write_attempt(folder: Path, view: SessionView, log: Sequence[Mapping[str, Any]],
                   result: dict[str, Any] | None, *, log_path: Path) -> int:
    """One session's files under `folder` (its `result.json` unless None: a step's result
    is its trial's); the count of kept files left out."""
    if result is not None:
        _write_json(folder / "result.json", result)
    _write_json(folder / "agent" / "trajectory.json", trajectory(view))
    if _seed(view).agent.name == "codex":
        (folder / "agent" / "codex.txt").write_text(codex_stdout(view), encoding="utf-8")
        _copy_rollouts(view, folder / "agent")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in log),
                        encoding="utf-8")
    kept = [entry for e in view.events
            if isinstance(e, (VerificationRecorded, VerificationFailed)) for entry in e.data.files]
    if not kept:
        return 0
    settings = _seed(view).settings
    source = artifacts.session_folder(settings.sandbox_logs_dir, view.session_id)
    if not artifacts.on_this_machine(source, view.session_id):
        return len(kept)
    missing = 0
    for entry in kept:
        try:
            data = artifacts.read_kept(source, entry)
        except artifacts.ArtifactRefused:
            missing += 1
            continue
        target = folder / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return missing


def _refuse_existing(out: Path) -> None:
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ExportRefused(f"{out}: exists and is not an empty folder (give a new one; "
                            "nothing was written)")


async def export_job(ledger: Ledger, name: str, out: Path) -> Exported:
    """Write job `name` as Harbor 0.26's job folder at `out` (absent or empty)."""
    _refuse_existing(out)
    jobs = Jobs(ledger)
    rows = await jobs.rows_of(name)
    config = await jobs.config(name)
    figures = {"tasks": await jobs.tasks(name), "passk": await jobs.passk(name),
               "reward_means": await jobs.reward_means(name)}
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        temp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from Harbor's other users
        done = await _write_job(ledger, rows, config, figures, out, temp)
        _refuse_existing(out)  # again: another writer may have made it meanwhile
        if out.exists():
            out.rmdir()
        os.replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return done


async def _write_job(ledger: Ledger, rows: dict[str, Any], config: dict[str, Any],
                     figures: dict[str, Any], out: Path, temp: Path) -> Exported:
    agent = {"name": config["agent"], "model": config.get("model") or None,
             "created_at": rows["job"]["created_at"]}
    job_id = job_uuid(rows["job"]["name"])
    trials: list[dict[str, Any]] = []
    folders: dict[str, str] = {}
    earlier = missing = 0
    checksums: dict[str, str] = {}
    prices = await Jobs(ledger).prices(rows["job"]["name"])
    costs: list[float | None] = []  # every session's, the earlier attempts' too
    for trial in rows["queue"]:
        folder_name = trial_folder_name(trial["task"], trial["trial_id"])
        folders[trial["trial_id"]] = folder_name
        folder = temp / folder_name
        t_config = trial_config(trial, folder_name, out, config, job_id)
        _write_json(folder / "config.json", t_config)
        checksum = checksums.setdefault(trial["task_dir"], task_checksum(trial["task_dir"]))
        sessions = sorted(await ledger.sessions(trial_id=trial["trial_id"]),
                          key=lambda s: (s["attempt"], s["step_index"] or 0, s["created_at"],
                                         s["session_id"]))
        last_attempt = sessions[-1]["attempt"] if sessions else None
        steps: list[dict[str, Any]] = []  # a multi-step trial's last attempt, Harbor's
        uri = (out / folder_name).as_uri()
        if not sessions:
            result = trial_result(None, trial=trial, name=folder_name, uri=uri,
                                  config=t_config, checksum=checksum, agent=agent)
            _write_json(folder / "result.json", result)
        for index, row in enumerate(sessions):
            view = await ledger.view(row["session_id"])
            log = await ledger.export(row["session_id"])
            result = trial_result(view, trial=trial, name=folder_name, uri=uri,
                                  config=t_config, checksum=checksum, agent=agent,
                                  prices=prices)
            costs.append((result.get("agent_result") or {}).get("cost_usd"))
            if row["step_index"] is not None and row["attempt"] == last_attempt:
                # A step of the kept attempt: its files where Harbor's multi-step trial
                # keeps them; its result is one of the trial's `step_results`.
                steps.append(step_result(row["step_name"], result))
                step = step_folder(row)
                missing += _write_attempt(folder / "steps" / step, view, log, None,
                                          log_path=folder / OURS / "steps" / step /
                                          "session.jsonl")
                if index == len(sessions) - 1:  # the trial's reward by its strategy
                    rewards = (await Jobs(ledger).trial(trial["trial_id"]) or {}).get("rewards")
                    result = {**result, "step_results": steps,
                              "verifier_result": {"rewards": rewards} if rewards else None}
                    _write_json(folder / "result.json", result)
            elif index == len(sessions) - 1:
                missing += _write_attempt(folder, view, log, result,
                                          log_path=folder / OURS / "session.jsonl")
            else:
                earlier += 1
                place = folder / OURS / "attempts" / attempt_folder(row)
                missing += _write_attempt(place, view, log, result,
                                          log_path=place / "session.jsonl")
        trials.append(result)
    _write_json(temp / "config.json", job_config(rows, config, out))
    _write_json(temp / "result.json", job_result(rows, trials, figures, job_id, earlier,
                                                       cost_usd=total_cost(costs)))
    _write_json(temp / ROWS_FILE, {"format": FORMAT, "rows": rows, "folders": folders})
    return Exported(out, len(trials), earlier, missing)


# --- the import of an exported folder (`import-harbor`, when DIR/trialledger.json is there) -


# What each row of `trialledger.json` holds (`Jobs.rows_of`): field → the types it may have.
Fields = dict[str, tuple[type, ...]]
JOB_FIELDS: Fields = {"name": (str,), "config": (str,), "k": (int,), "max_attempts": (int,),
              "created_at": (str,)}
ROW_FIELDS: dict[str, Fields] = {
    "queue": {"trial_id": (str,), "task": (str,), "k_index": (int,), "task_dir": (str,),
              "state": (str,), "detail": (str, type(None)), "dataset": (str, type(None))},
    "skipped": {"task": (str,), "dataset": (str, type(None)), "reason": (str,)},
    "task_fields": {"task": (str,), "field": (str,), "reason": (str,)},
    "prices": {"model": (str,), "input": (float, int), "cached_input": (float, int),
               "output": (float, int), "reasoning": (float, int)},
}


def _check(row: Any, fields: Mapping[str, tuple[type, ...]]) -> None:
    assert isinstance(row, dict) and set(row) == set(fields)
    for name, types in fields.items():
        assert isinstance(row[name], types) and not isinstance(row[name], bool)


def _rows_file(tree: AgentTree) -> tuple[dict[str, Any], dict[str, str]]:
    """The job's rows and each trial's folder, from `trialledger.json`, checked for shape."""
    try:
        doc = bounded_loads(tree.read(ROWS_FILE, RESULT_LIMIT), limit=RESULT_LIMIT)
    except (UnsafeAgentFile, UnsafeJSON) as error:
        raise HarborJobInvalid(f"{ROWS_FILE}: {getattr(error, 'rule', error)}") from None
    try:
        assert isinstance(doc, dict) and doc.get("format") == FORMAT
        rows, folders = doc["rows"], doc["folders"]
        assert isinstance(rows, dict) and isinstance(folders, dict)
        rows.setdefault("prices", [])  # an export from before price tables (SPEC §18)
        _check(rows["job"], JOB_FIELDS)
        for key, fields in ROW_FIELDS.items():
            assert isinstance(rows[key], list)
            for row in rows[key]:
                _check(row, fields)
        for trial in rows["queue"]:
            name = folders[trial["trial_id"]]
            assert isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
    except (AssertionError, KeyError, TypeError):
        raise HarborJobInvalid(f"{ROWS_FILE}: not the rows of a job as export-harbor writes "
                               "them") from None
    return rows, folders


def _logs(tree: AgentTree, folder: str, trial_id: str) -> list[list[dict[str, Any]]]:
    """A trial folder's session logs (earlier attempts first), each checked by replay."""
    found, refused = tree.find(f"{folder}/{OURS}", "session.jsonl")
    if refused:
        raise HarborJobInvalid(f"trial {folder}: {refused[0].path}: {refused[0].rule}")
    logs = []
    for path in found:
        try:
            text = tree.read(path, ROLLOUT_FILE_LIMIT).decode("utf-8")
            events = [json.loads(line) for line in text.splitlines() if line.strip()]
            view = replay(events)
        except (UnsafeAgentFile, UnicodeDecodeError, ValueError, BadEvent, IllegalTransition,
                TypeError, AttributeError) as error:
            raise HarborJobInvalid(f"trial {folder}: {path}: {error}; nothing was "
                                   "imported") from None
        seed = _seed(view)
        if seed.trial_id != trial_id:
            raise HarborJobInvalid(f"trial {folder}: {path} is a session of another trial")
        logs.append(((seed.attempt, seed.step.index if seed.step else 0), events))
    return [events for _, events in sorted(logs, key=lambda pair: pair[0])]


def _last_step(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """What a trial's result says of its last session: of a multi-step trial its last
    step's result (the trial's own `verifier_result` is its strategy's), else itself."""
    steps = result.get("step_results")
    return _object(steps[-1]) if isinstance(steps, list) and steps else result


async def import_export(ledger: Ledger, job: Path) -> list[Agreement]:
    """An exported job back into a store: every session log as it was, then the job's own
    rows, so its trials, rewards and summary are the exported ones. Everything is read and
    checked first; a job of that name with other rows is refused before anything is
    stored."""
    tree = job_tree(job)
    rows, folders = _rows_file(tree)
    prepared = []
    for trial in rows["queue"]:
        folder = folders[trial["trial_id"]]
        logs = _logs(tree, folder, trial["trial_id"])
        prepared.append((folder, logs, _result(tree, folder) if logs else None))
    jobs = Jobs(ledger)
    try:
        stored = await jobs.rows_of(str(rows["job"]["name"]))
    except NoJob:
        stored = None
    if stored is not None and stored["job"] != rows["job"]:
        raise HarborJobInvalid(f"job {rows['job']['name']} is already in this store with "
                               "another configuration; nothing was imported")
    agreements = []
    for folder, logs, result in prepared:
        for events in logs:
            existed = bool(await ledger.sessions(session_id=events[0].get("session_id")))
            session_id = await ledger.import_log(events)
        if not logs or result is None:
            continue
        view = await ledger.view(session_id)
        decision = view.decision
        verdict, harbor_valid = _harbor_verdict(result)
        info = _object(result.get("exception_info"))
        policy = info.get("policy")
        agreements.append(Agreement(
            trial=folder, session_id=session_id, status="unchanged" if existed else "imported",
            harbor_exception=info.get("exception_type"),
            harbor_policy={k: bool(v) for k, v in policy.items()}
            if isinstance(policy, dict) else None,
            harbor_verdict=verdict, harbor_reward_valid=harbor_valid,
            harbor_rewards=_object(_last_step(result).get("verifier_result")).get("rewards"),
            our_rule=decision.rule if decision else "-",
            our_action=decision.action if decision else "-",
            our_reward_valid=bool(decision and decision.reward_valid and view.rewards),
            our_rewards=view.rewards, our_evidence=_evidence(view),
            harbor_tokens=_harbor_tokens(result), our_tokens=_our_tokens(view),
            rewards_appended=False))
    await jobs.restore(rows)
    return agreements
