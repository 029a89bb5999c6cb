"""`export-harbor` (docs/SPEC.md §18): a job as Harbor 0.26's job folder, every file
validated by Harbor's own models, and its round trip through `import-harbor`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harbor_models import models
from tests.runs import codex_path, make_task
from trialledger import cli
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, shell, status
from trialledger.core.events import CODEX_STREAM_TYPES

SOLVE = "#!/bin/sh\necho solved > answer.txt\n"
CHECK = "grep -qx solved answer.txt\n"
MULTI = 'echo \'{"reward": 1, "style": 0.5}\' > "$TRIALLEDGER_VERIFIER_DIR/reward.json"\n'


@pytest.fixture(scope="module")
def harbor() -> dict[str, Any]:
    return models()


def shown(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def validated(harbor: dict[str, Any], out: Path) -> dict[str, Any]:
    """Every file of an exported folder through Harbor's own models: the job's config and
    result, each trial's (and each earlier attempt's) config, result and trajectory."""
    job = {"config": harbor["job_config"].JobConfig.model_validate_json(
               (out / "config.json").read_text()),
           "result": harbor["job_result"].JobResult.model_validate_json(
               (out / "result.json").read_text()),
           "trials": {}, "earlier": {}}
    trajectory = harbor["trajectory"].Trajectory
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        harbor["trial_config"].TrialConfig.model_validate_json(
            (folder / "config.json").read_text())
        result = harbor["trial_result"].TrialResult.model_validate_json(
            (folder / "result.json").read_text())
        job["trials"][folder.name] = result
        if (folder / "agent" / "trajectory.json").exists():
            trajectory.model_validate_json((folder / "agent" / "trajectory.json").read_text())
        for attempt in sorted((folder / "trialledger" / "attempts").glob("*")):
            job["earlier"].setdefault(folder.name, []).append(
                harbor["trial_result"].TrialResult.model_validate_json(
                    (attempt / "result.json").read_text()))
            trajectory.model_validate_json((attempt / "agent" / "trajectory.json").read_text())
    return job


def round_trip(capsys: pytest.CaptureFixture[str], name: str, db: Path | str, out: Path,
               fresh: Path | str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`job show --json` of the job, and of its export imported into a fresh store."""
    code, before, err = shown(capsys, "job", "show", name, "--json", "--db", str(db))
    assert code == 0, err
    code, _, err = shown(capsys, "import-harbor", "--db", str(fresh), str(out))
    assert code == 0, err
    code, after, err = shown(capsys, "job", "show", name, "--json", "--db", str(fresh))
    assert code == 0, err
    return json.loads(before), json.loads(after)


def test_an_oracle_job_exports_as_harbor_writes_it_and_imports_back_the_same(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], harbor: dict[str, Any]) -> None:
    """Scored, unscored (no reward file; no solution: never ran) and several reward names,
    k = 2: Harbor's models accept every file, the unscored trials carry their reason as
    Harbor's exception with our decision as its policy, the metrics are §13's figures,
    and the import gives the same summary."""
    data = tmp_path / "data"
    make_task(data / "alpha", instruction="write answer.txt", test_sh=CHECK, solve_sh=SOLVE)
    make_task(data / "broken", test_sh="exit 0\n")  # no solution/solve.sh
    make_task(data / "silent", test_sh="true\n", solve_sh=SOLVE, exit_code_reward=False)
    make_task(data / "multi", test_sh=MULTI, solve_sh=SOLVE, exit_code_reward=False)
    db, out = tmp_path / "jobs.db", tmp_path / "jobs" / "check"
    assert cli.main(["job", "run", "check", str(data), "--agent", "oracle", "-k", "2",
                     "--db", str(db)]) == 1  # trials left unscored
    capsys.readouterr()
    code, printed, err = shown(capsys, "export-harbor", "check", str(out), "--db", str(db))
    assert code == 0, err
    assert printed.strip() == f"wrote 8 trial(s) and 0 earlier attempt(s) to {out}"
    job = validated(harbor, out)
    assert (job["config"].job_name, job["config"].n_attempts) == ("check", 2)
    assert [str(d.path) for d in job["config"].datasets] == [str(data)]
    trials = job["trials"]
    assert len(trials) == 8 and not job["earlier"]
    by_task: dict[str, list[Any]] = {}
    for result in trials.values():
        by_task.setdefault(result.task_name, []).append(result)
    assert all(r.reward_valid and r.verifier_result.rewards == {"reward": 1.0}
               for r in by_task["alpha"])
    assert all(r.verifier_result.rewards == {"reward": 1.0, "style": 0.5}
               for r in by_task["multi"])
    for task, kind, retry, grade in (("broken", "NoSolutionError", False, False),
                                     ("silent", "RewardFileNotFoundError", False, True)):
        for result in by_task[task]:
            info = result.exception_info
            assert not result.reward_valid and info.exception_type == kind
            assert (info.policy.should_retry, info.policy.should_grade) == (retry, grade)
    assert all((out / name / "verifier").is_dir() for name, r in trials.items()
               if r.task_name == "alpha")  # the verifier's kept files
    assert all((out / name / "agent" / "oracle.txt").read_text() == ""  # (SOLVE says
               for name, r in trials.items() if r.task_name == "alpha")  # nothing) as Harbor's
    stats = job["result"].stats
    assert (stats.n_completed_trials, stats.n_errored_trials, stats.n_retries) == (8, 4, 0)
    assert stats.cost_usd == 0  # the oracle asks no model (SPEC §18)
    (evals,) = stats.evals.values()
    before, after = round_trip(capsys, "check", db, out, tmp_path / "fresh.db")
    assert after == before
    means = {r["name"]: r["mean"] for r in before["reward_means"] if r["task"] is None}
    assert evals.metrics == [means] and means == {"reward": 0.5, "style": 0.125}
    assert [t["final_session_id"] for t in after["trials"]] == [
        t["final_session_id"] for t in before["trials"]]


def test_an_existing_folder_is_refused_and_nothing_is_left_beside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    make_task(data / "alpha", instruction="write answer.txt", test_sh=CHECK, solve_sh=SOLVE)
    db = tmp_path / "jobs.db"
    assert cli.main(["job", "run", "one", str(data), "--agent", "oracle", "--db",
                     str(db)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, _, err = shown(capsys, "export-harbor", "one", str(out), "--db", str(db))
    assert code == 2 and err.count("\n") == 1 and "not an empty folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "jobs.db", "out"]
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    code, _, err = shown(capsys, "export-harbor", "nope", str(tmp_path / "x"), "--db", str(db))
    assert code == 2 and err.strip() == "trialledger: no job named nope"
    assert not (tmp_path / "x").exists()


TASKS = {  # name: (test.sh, exit code is the reward, the endpoint's replies)
    "flaky": ("exit 0\n", True, [status(429), message("after a retry")]),
    "down": ("exit 0\n", True, [status(429)]),  # every attempt: retries exhausted
    "silent": ("true\n", False, [message("done")]),  # the verifier writes no reward
    "tool": ("grep -q hello out.txt\n", True, [shell("echo hello > out.txt"),
                                               message("wrote it")]),
}


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    routes = {f"[task {n}]": r for n, (_, _, r) in TASKS.items() if n != "tool"}
    with ScriptedEndpoint([message("unrouted")], routes=routes,
                          turns={"[task tool]": TASKS["tool"][2]}) as server:
        yield server


def test_a_codex_job_with_retries_keeps_earlier_attempts_inside_their_trial(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint: ScriptedEndpoint,
        harbor: dict[str, Any]) -> None:
    """Real Codex, max 2 attempts: a 429 retried once, one retried until the attempts ran
    out, a verifier that writes no reward, a tool call. Each trial's earlier attempts are
    inside its own folder (never a job-level folder), the kept attempt is the last, its
    trajectory has the tool call and its output, `agent/` has Codex's stdout as Harbor
    keeps it (`codex.txt`, read back into the same stream events) and its archived
    rollouts, and the import gives the same summary."""
    data = tmp_path / "data"
    for name, (test_sh, by_exit, _) in TASKS.items():
        make_task(data / name, instruction=f"[task {name}] do the task", test_sh=test_sh,
                  exit_code_reward=by_exit)
    db, out = tmp_path / "jobs.db", tmp_path / "out"
    prices = tmp_path / "prices.toml"
    prices.write_text('[m]\ninput = 2\ncached_input = 0.5\noutput = 8\nreasoning = 16\n')
    assert cli.main(["job", "run", "bench", str(data), "-n", "2", "--max-attempts", "2",
                     "--db", str(db), "--prices", str(prices),
                     "--model-base-url", endpoint.url, "--model", "m",
                     "--codex-bin", codex_path(), "--set", "request_max_retries=0",
                     "--set", "stream_max_retries=0",
                     "--set", f"sandbox_logs_dir={tmp_path / 'kept'}"]) == 1
    capsys.readouterr()
    code, printed, err = shown(capsys, "export-harbor", "bench", str(out), "--db", str(db))
    assert code == 0, err
    assert "wrote 4 trial(s) and 2 earlier attempt(s)" in printed
    job = validated(harbor, out)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(job["trials"])
    tasks = {r.task_name: (name, r) for name, r in job["trials"].items()}
    assert set(tasks) == set(TASKS)
    for task in ("flaky", "down"):
        name, kept = tasks[task]
        (earlier,) = job["earlier"][name]
        assert earlier.exception_info.policy.should_retry
        assert earlier.started_at < kept.started_at and earlier.id != kept.id
    assert tasks["flaky"][1].verifier_result.rewards == {"reward": 1.0}
    down = tasks["down"][1].exception_info
    assert down.policy.should_retry and not tasks["down"][1].reward_valid
    assert tasks["silent"][1].exception_info.exception_type == "RewardFileNotFoundError"
    assert job["result"].stats.n_retries == 2
    steps = json.loads((out / tasks["tool"][0] / "agent" / "trajectory.json").read_text()
                       )["steps"]
    (tool,) = [s for s in steps if s.get("tool_calls")]
    assert "echo hello > out.txt" in tool["tool_calls"][0]["arguments"]["cmd"]
    assert tool["metrics"]["prompt_tokens"] > 0
    tool_folder = out / tasks["tool"][0]
    assert list((tool_folder / "agent").glob("sessions/**/rollout-*.jsonl"))  # archived
    stdout = (tool_folder / "agent" / "codex.txt").read_text().splitlines()
    session = [json.loads(line) for line in
               (tool_folder / "trialledger" / "session.jsonl").read_text().splitlines()]
    streamed = [(e["type"], e["data"]) for e in session if e["type"] in CODEX_STREAM_TYPES]
    assert [(r.type, r.data) for r in map(parse_stream_line, stdout)] == streamed
    before, after = round_trip(capsys, "bench", db, out, tmp_path / "fresh.db")
    assert after == before
    costs = []  # each attempt's cost by SPEC §18's formula from its own token counts
    for result in [r for _, r in tasks.values()] + [e for es in job["earlier"].values()
                                                    for e in es]:
        usage = result.agent_result
        if usage is None:
            continue
        cached, reasoning = usage.n_cache_tokens, usage.metadata["reasoning_output_tokens"]
        assert usage.cost_usd == pytest.approx(
            ((usage.n_input_tokens - cached) * 2 + cached * 0.5
             + (usage.n_output_tokens - reasoning) * 8 + reasoning * 16) / 1e6)
        costs.append(usage.cost_usd)
    assert costs and before["cost_usd"] is not None and before["cost_usd"] > 0
    assert job["result"].stats.cost_usd == pytest.approx(before["cost_usd"])
    assert {t["task"]: t["attempts"] for t in after["trials"]} == {
        "down": 2, "flaky": 2, "silent": 1, "tool": 1}


def test_the_import_of_an_export_checks_it_whole_before_storing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Back into its own store it changes nothing; a log moved to another trial's folder,
    or a row of the wrong type, is one line, exit 2, and nothing is stored."""
    data = tmp_path / "data"
    make_task(data / "alpha", instruction="write answer.txt", test_sh=CHECK, solve_sh=SOLVE)
    db, out = tmp_path / "jobs.db", tmp_path / "out"
    assert cli.main(["job", "run", "two", str(data), "--agent", "oracle", "-k", "2",
                     "--db", str(db)]) == 0
    assert cli.main(["export-harbor", "two", str(out), "--db", str(db)]) == 0
    capsys.readouterr()
    code, printed, err = shown(capsys, "import-harbor", "--db", str(db), str(out))
    assert code == 0 and "2 unchanged since an earlier import" in printed, err
    first, second = sorted(p for p in out.iterdir() if p.is_dir())
    log = second / "trialledger" / "session.jsonl"
    kept = log.read_bytes()
    log.write_bytes((first / "trialledger" / "session.jsonl").read_bytes())
    fresh = tmp_path / "fresh.db"
    code, _, err = shown(capsys, "import-harbor", "--db", str(fresh), str(out))
    assert code == 2 and err.count("\n") == 1 and "is a session of another trial" in err
    assert not fresh.exists()
    log.write_bytes(kept)
    rows = json.loads((out / "trialledger.json").read_text())
    rows["rows"]["queue"][0]["k_index"] = "0"
    (out / "trialledger.json").write_text(json.dumps(rows))
    code, _, err = shown(capsys, "import-harbor", "--db", str(fresh), str(out))
    assert code == 2 and err.count("\n") == 1 and "not the rows of a job" in err
    assert not fresh.exists()


def test_the_round_trip_on_both_databases(db: str, tmp_path: Path,
                                          request: pytest.FixtureRequest,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A job's rows read and restored by each store: the summary comes back the same."""
    data = tmp_path / "data"
    make_task(data / "alpha", instruction="write answer.txt", test_sh=CHECK, solve_sh=SOLVE)
    make_task(data / "broken", test_sh="exit 0\n")
    assert cli.main(["job", "run", "both", str(data), "--agent", "oracle", "--db", db]) == 1
    out = tmp_path / "out"
    assert cli.main(["export-harbor", "both", str(out), "--db", db]) == 0
    fresh = (request.getfixturevalue("postgres").create_database()
             if db.startswith("postgresql") else str(tmp_path / "fresh.db"))
    capsys.readouterr()
    before, after = round_trip(capsys, "both", db, out, fresh)
    assert after == before and after["no_solution"] == {"broken": before["no_solution"]["broken"]}


def test_a_multi_step_trial_exports_each_step_and_imports_back_the_same(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], harbor: dict[str, Any]) -> None:
    """Three steps in one attempt (rewards 1, 1, 0.5; `mean`): the trial's result is
    Harbor's multi-step one — `step_results` per step, `verifier_result` the strategy's —
    each step's files are in Harbor's `steps/<name>/` (its trajectory, its verifier's
    reward), none at the trial's root, and the import restores the job from their logs."""
    from tests.session.test_step_runs import three_steps

    data = tmp_path / "data"
    three_steps(data / "steps")
    db, out = tmp_path / "jobs.db", tmp_path / "jobs" / "steps"
    assert cli.main(["job", "run", "steps", str(data), "--agent", "oracle",
                     "--db", str(db)]) == 0
    capsys.readouterr()
    code, printed, err = shown(capsys, "export-harbor", "steps", str(out), "--db", str(db))
    assert code == 0, err
    assert printed.strip() == f"wrote 1 trial(s) and 0 earlier attempt(s) to {out}"
    job = validated(harbor, out)
    ((folder, result),) = job["trials"].items()
    assert [s.step_name for s in result.step_results] == ["one", "two", "three"]
    assert [s.verifier_result.rewards for s in result.step_results] == [
        {"reward": 1.0}, {"reward": 1.0}, {"reward": 0.5}]
    assert result.verifier_result.rewards == {"reward": pytest.approx(2.5 / 3)}
    trial = out / folder
    assert sorted(p.name for p in (trial / "steps").iterdir()) == ["one", "three", "two"]
    assert not (trial / "agent").exists() and not (trial / "verifier").exists()
    for name, reward in (("one", "1"), ("two", "1"), ("three", "0.5")):
        harbor["trajectory"].Trajectory.model_validate_json(
            (trial / "steps" / name / "agent" / "trajectory.json").read_text())
        assert (trial / "steps" / name / "verifier" / "reward.txt").read_text().strip() == reward
    assert not (trial / "trialledger" / "attempts").exists()
    before, after = round_trip(capsys, "steps", db, out, tmp_path / "fresh.db")
    assert after == before


def test_a_step_that_could_not_be_set_up_exports_as_harbors_step_exception(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], harbor: dict[str, Any]) -> None:
    """Step two's setup.sh fails: Harbor records a `RuntimeError` on that step (its error
    table's policy for it) and no verifier result for it; the trial's reward is step one's,
    valid, in the job's figures as in Harbor's; the import restores the job."""
    from tests.session.test_step_runs import three_steps

    data = tmp_path / "data"
    folder = three_steps(data / "steps")
    (folder / "steps" / "two" / "workdir" / "setup.sh").write_text("echo broken; exit 3\n")
    db, out = tmp_path / "jobs.db", tmp_path / "jobs" / "steps"
    assert cli.main(["job", "run", "steps", str(data), "--agent", "oracle",
                     "--db", str(db)]) == 0  # scored: step one's reward, as Harbor's
    capsys.readouterr()
    code, _, err = shown(capsys, "export-harbor", "steps", str(out), "--db", str(db))
    assert code == 0, err
    ((_, result),) = validated(harbor, out)["trials"].items()
    one, two = result.step_results
    assert one.exception_info is None and two.verifier_result is None
    assert two.exception_info.exception_type == "RuntimeError"
    assert two.exception_info.exception_message == "step 'two': setup.sh exited with 3: broken"
    assert two.exception_info.policy.has_valid_reward  # (Harbor's table for it)
    assert result.verifier_result.rewards == {"reward": 1.0} and result.reward_valid
    before, after = round_trip(capsys, "steps", db, out, tmp_path / "fresh.db")
    assert after == before


@pytest.mark.parametrize("name", ["..", ".", "", "a/../../b", "x\0y", None])
def test_a_step_name_that_is_not_one_folder_is_written_by_its_index(name: str | None) -> None:
    """A step's name comes from a log, which may be an imported one: a name that would
    leave `steps/` (or is no name) becomes `step-<index>`; a Harbor name is kept."""
    from trialledger.adapters.jobs.harborexport import step_folder

    assert step_folder({"step_name": name, "step_index": 2}) == "step-2"
    assert step_folder({"step_name": "fix the bug", "step_index": 2}) == "fix the bug"
