"""Running a multi-step task (docs/SPEC.md §17, "Multi-step tasks"): one sandbox serves every
step of an attempt, in order, each step a session of its own; the `min_reward` gate; a
`retry` restarting the trial from step 1 in a fresh sandbox; the trial's reward by `mean`
or `final`. Real runs: the oracle and nop through `trialledger run`, Codex against the
scripted endpoint."""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.runs import in_process, run_trial
from tests.session.test_runner import FAST
from trialledger.adapters.demo import samples
from trialledger.adapters.demo.endpoint import message, shell, status
from trialledger.adapters.session.steprun import upload
from trialledger.adapters.tasks.task import Task
from trialledger.core.events import SessionSeeded

STEPS = """{strategy}
[[steps]]
name = "one"
{gate}
[[steps]]
name = "two"
[[steps]]
name = "three"
"""
REWARD = 'echo "$1" > /logs/verifier/reward.txt'


def three_steps(folder: Path, *, strategy: str = "", gate: str = "") -> Path:
    """Each step writes a file its tests check. `one` has its own solution and test;
    `two` a workdir (given.txt, setup.sh) and its own test; `three` the task's solution
    and test (0.5 when every file is there). The task's tests/ carries `lib.sh`, which
    each step's merged tests source."""
    (folder / "steps").mkdir(parents=True)
    (folder / "task.toml").write_text(STEPS.format(strategy=strategy, gate=gate))
    samples.executable(folder / "tests" / "lib.sh", f"give() {{ {REWARD}; }}\n")
    samples.executable(folder / "tests" / "test.sh", ". /tests/lib.sh\n"
                       "test -f one.txt && test -f two.txt && test -f three.txt "
                       "&& give 0.5 || give 0\n")
    samples.executable(folder / "solution" / "solve.sh", "echo 3 > three.txt\n")
    for name in ("one", "two", "three"):
        (folder / "steps" / name).mkdir()
        (folder / "steps" / name / "instruction.md").write_text(f"write {name}.txt\n")
    one = folder / "steps" / "one"
    samples.executable(one / "solution" / "solve.sh", "echo 1 > one.txt\n")
    samples.executable(one / "tests" / "test.sh", ". /tests/lib.sh\n"
                       "test -f one.txt && give 1 || give 0\n")
    two = folder / "steps" / "two"
    (two / "workdir").mkdir()
    (two / "workdir" / "given.txt").write_text("given\n")
    (two / "workdir" / "setup.sh").write_text("id -u > setup-uid.txt; pwd > setup-pwd.txt\n")
    samples.executable(two / "solution" / "solve.sh", "cp given.txt two.txt\n")
    samples.executable(two / "tests" / "test.sh", ". /tests/lib.sh\n"
                       'test "$(cat two.txt)" = given && test -f one.txt '
                       '&& test "$(cat setup-pwd.txt)" = /app '
                       '&& test "$(cat setup-uid.txt)" = "$(id -u)" && give 1 || give 0\n')
    return folder


def rows(db: Path, query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(query).fetchall()


def run(folder: Path, db: Path, agent: str) -> tuple[int, list[dict[str, Any]]]:
    done = in_process("run", str(folder), "--agent", agent, "--db", str(db), "--json")
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize(("strategy", "reward"), [("", 2.5 / 3), ("final", 0.5)],
                         ids=["mean", "final"])
def test_the_oracle_runs_each_step_in_one_sandbox_and_the_trial_takes_its_strategy(
        tmp_path: Path, strategy: str, reward: float) -> None:
    toml = f'multi_step_reward_strategy = "{strategy}"' if strategy else ""
    folder = three_steps(tmp_path / "task", strategy=toml)
    code, said = run(folder, tmp_path / "t.db", "oracle")
    *sessions, trial = said
    assert code == 0
    assert [s["rewards"] for s in sessions] == [{"reward": 1.0}, {"reward": 1.0},
                                                {"reward": 0.5}]
    assert trial["reward_strategy"] == (strategy or "mean") and trial["steps"] == 3
    assert trial["rewards"] == {"reward": pytest.approx(reward)}
    found = rows(tmp_path / "t.db", "SELECT step_name, step_index, step_count, attempt, "
                 "outcome, created_at, closed_at FROM sessions ORDER BY created_at")
    assert [r[:5] for r in found] == [("one", 1, 3, 1, "verify"), ("two", 2, 3, 1, "verify"),
                                      ("three", 3, 3, 1, "verify")]
    for before, after in itertools.pairwise(found):
        assert after[5] >= before[6]  # step k+1 seeded once step k's session closed
    assert rows(tmp_path / "t.db", "SELECT code FROM gaps") == []


def test_a_gate_on_a_key_the_verifier_never_writes_stops_the_attempt(tmp_path: Path) -> None:
    folder = three_steps(tmp_path / "task", gate="min_reward = {reward = 1, style = 1}")
    code, said = run(folder, tmp_path / "t.db", "oracle")
    first, trial = said
    assert first["rewards"] == {"reward": 1.0} and trial["steps"] == 1
    assert trial["rewards"] == {"reward": 1.0} and code == 0
    assert rows(tmp_path / "t.db", "SELECT step_name FROM sessions") == [("one",)]
    assert rows(tmp_path / "t.db", "SELECT code, detail FROM gaps") == [
        ("steps_stopped", "step 'one': style=-inf below min_reward 1.0")]


def test_nop_runs_nothing_in_every_step(tmp_path: Path) -> None:
    folder = three_steps(tmp_path / "task")
    code, said = run(folder, tmp_path / "t.db", "nop")
    *sessions, trial = said
    assert [s["rewards"] for s in sessions] == [{"reward": 0.0}] * 3
    assert trial["rewards"] == {"reward": 0.0} and code == 0


def test_an_oracle_without_a_steps_solution_or_the_tasks_is_refused(tmp_path: Path) -> None:
    folder = three_steps(tmp_path / "task")
    (folder / "solution" / "solve.sh").unlink()  # step three has none of its own
    done = in_process("run", str(folder), "--agent", "oracle", "--db", str(tmp_path / "t.db"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "step 'three': no solution/solve.sh" in done.stderr


@pytest.mark.anyio
async def test_a_step_decided_retry_restarts_the_trial_from_step_1_in_a_fresh_sandbox(
        tmp_path: Path) -> None:
    folder = tmp_path / "task"
    (folder / "task.toml").parent.mkdir(parents=True)
    (folder / "task.toml").write_text("[[steps]]\nname = 'one'\n[[steps]]\nname = 'two'\n")
    for name in ("one", "two"):
        (folder / "steps" / name).mkdir(parents=True)
        (folder / "steps" / name / "instruction.md").write_text(f"write {name}\n")
    samples.executable(folder / "steps" / "one" / "tests" / "test.sh",
                       f"give() {{ {REWARD}; }}\n"
                       "test -f one.txt && ! test -e first.txt && give 1 || give 0\n")
    samples.executable(folder / "tests" / "test.sh", f"give() {{ {REWARD}; }}\n"
                       "test -f one.txt && test -f two.txt && give 1 || give 0\n")
    script = [shell("echo x > first.txt"), status(429),  # attempt 1, step one: retry
              shell("echo 1 > one.txt"), message(),  # attempt 2, step one
              shell("echo 2 > two.txt"), message()]  # attempt 2, step two
    results = await run_trial(str(tmp_path / "t.db"), Task.load(folder), script,
                              settings=FAST, max_attempts=2)
    assert [(r.attempt, r.outcome, r.view.rewards) for r in results] == [
        (1, "retry", None), (2, "verify", {"reward": 1.0}), (2, "verify", {"reward": 1.0})]
    seeds = [seed.data for r in results
             if isinstance(seed := r.view.events[0], SessionSeeded)]
    assert [(s.step.name, s.step.index) for s in seeds if s.step] == [
        ("one", 1), ("one", 1), ("two", 2)]
    assert seeds[1].retry_of == results[0].session_id and seeds[2].retry_of is None
    assert rows(tmp_path / "t.db", "SELECT code FROM gaps WHERE code = 'steps_stopped'") == []


def test_a_job_counts_a_multi_step_trial_once_with_its_strategys_reward(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    three_steps(data / "multi")
    samples.write_task(data / "plain", instruction="hi", test_sh="exit 0\n", toml=None,
                       workspace=None, exit_code_reward=True)
    samples.executable(data / "plain" / "solution" / "solve.sh", "true\n")
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "steps", str(data), "--agent", "oracle", "--db", db)
    assert done.returncode == 0, done.stderr
    shown = json.loads(in_process("job", "show", "steps", "--db", db, "--json").stdout)
    multi = next(t for t in shown["trials"] if t["task"] == "multi")
    assert multi["rewards"] == {"reward": pytest.approx(2.5 / 3)} and multi["attempts"] == 1
    assert multi["steps"] == [{"name": "one", "reward": 1.0}, {"name": "two", "reward": 1.0},
                              {"name": "three", "reward": 0.5}]
    final = rows(tmp_path / "t.db", "SELECT session_id FROM sessions "
                 "WHERE step_name = 'three'")
    assert [(multi["final_session_id"],)] == final
    means = {t["task"]: t["mean"] for t in shown["tasks"]}
    assert means == {"multi": pytest.approx(2.5 / 3), "plain": 1.0,
                     None: pytest.approx((2.5 / 3 + 1) / 2)}
    lines = in_process("job", "show", "steps", "--db", db, "--trials").stdout
    assert "multi k=0 verify reward 0.833333 steps: one 1, two 1, three 0.5 (1 attempt" in lines


@pytest.mark.parametrize(("broken", "scored"), [("setup", True), ("healthcheck", False)])
def test_a_job_scores_a_trial_stopped_before_a_step_as_harbors_error_table_does(
        tmp_path: Path, broken: str, scored: bool) -> None:
    """Step two cannot be set up: its setup.sh failing (Harbor's `RuntimeError`) leaves the
    trial's reward — step one's — valid; its healthcheck failing (`HealthcheckError`) does
    not (migration 0018)."""
    folder = three_steps(tmp_path / "data" / "multi")
    if broken == "setup":
        (folder / "steps" / "two" / "workdir" / "setup.sh").write_text("exit 3\n")
    else:
        toml = folder / "task.toml"
        toml.write_text(toml.read_text().replace(
            'name = "two"\n', 'name = "two"\nhealthcheck = { command = "exit 1", '
                             'interval_sec = 0.1, retries = 1 }\n'))
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "steps", str(tmp_path / "data"), "--agent", "oracle",
                      "--db", db)
    assert done.returncode == (0 if scored else 1), done.stderr
    shown = json.loads(in_process("job", "show", "steps", "--db", db, "--json").stdout)
    (trial,) = shown["trials"]
    assert trial["scored"] == int(scored)
    assert trial["rewards"] == ({"reward": 1.0} if scored else None)
    assert trial["steps"] == [{"name": "one", "reward": 1.0}, {"name": "two", "reward": None}]


def test_a_jobs_figures_per_reward_name_take_a_multi_step_trials_strategy(
        tmp_path: Path) -> None:
    """With several reward names every figure is per name: a `mean` trial's value of
    each is its mean over the steps (a name a step lacks counting 0), never its last
    step's own."""
    task = tmp_path / "data" / "named"
    (task / "steps").mkdir(parents=True)
    (task / "task.toml").write_text('[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n')
    for name, rewards in (("one", '{"reward": 1, "style": 0, "extra": 1}'),
                          ("two", '{"reward": 0, "style": 1}')):
        step = task / "steps" / name
        step.mkdir()
        (step / "instruction.md").write_text(f"step {name}\n")
        samples.executable(step / "solution" / "solve.sh", "true\n")
        samples.executable(step / "tests" / "test.sh",
                           f"echo '{rewards}' > /logs/verifier/reward.json\n")
    db = tmp_path / "t.db"
    done = in_process("job", "run", "named", str(task.parent), "--agent", "oracle",
                      "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert dict(rows(db, "SELECT name, mean FROM job_tasks WHERE task = 'named'")) == {
        "reward": 0.5, "style": 0.5, "extra": 0.5}


def test_a_failing_setup_stops_the_attempt_before_the_steps_agent(tmp_path: Path) -> None:
    """As Harbor 0.26's `_run_step_setup`: the step's exception — no agent, no verifier,
    no later step; the trial's reward is over the steps with a result."""
    folder = three_steps(tmp_path / "task")
    (folder / "steps" / "two" / "workdir" / "setup.sh").write_text(
        "id -u > setup-uid.txt; echo broken; exit 3\n")
    code, said = run(folder, tmp_path / "t.db", "oracle")
    *sessions, trial = said
    assert code == 0 and trial["steps"] == 2
    assert [s["rewards"] for s in sessions] == [{"reward": 1.0}, None]
    assert trial["rewards"] == {"reward": 1.0}
    assert rows(tmp_path / "t.db", "SELECT step_name, outcome, close_reason FROM sessions "
                "ORDER BY created_at") == [("one", "verify", "normal"),
                                           ("two", "interrupted", "step_not_run")]
    assert sorted(rows(tmp_path / "t.db", "SELECT code, detail FROM gaps")) == [
        ("agent_activation_interrupted", "the session closed before a final decision"),
        ("step_setup_failed", "step 'two': setup.sh exited with 3: broken"),
        ("steps_stopped", "step 'two': no verification result")]
    assert rows(tmp_path / "t.db", "SELECT COUNT(*) FROM events e JOIN sessions s "
                "ON s.session_id = e.session_id WHERE s.step_name = 'two' "
                "AND e.type = 'agent.launched'") == [(0,)]


def test_a_step_that_could_not_be_set_up_reruns_the_trial_while_attempts_are_left(
        tmp_path: Path) -> None:
    """Harbor's queue retries a trial for a step's `RuntimeError` when told to retry: under
    `--max-attempts 2` the trial runs again from step 1 in a fresh sandbox, and its reward
    is its last attempt's."""
    folder = three_steps(tmp_path / "task")
    (folder / "steps" / "two" / "workdir" / "setup.sh").write_text("exit 3\n")
    one = folder / "steps" / "one" / "solution" / "solve.sh"
    done = in_process("run", str(folder), "--agent", "oracle", "--db", str(tmp_path / "t.db"),
                      "--json", "--max-attempts", "2")
    assert done.returncode == 0, done.stderr
    *_, trial = [json.loads(line) for line in done.stdout.splitlines()]
    assert trial["rewards"] == {"reward": 1.0}
    sessions = rows(tmp_path / "t.db", "SELECT session_id, step_name, attempt, retry_of, "
                    "close_reason FROM sessions ORDER BY created_at")
    assert [(s[1], s[2], s[4]) for s in sessions] == [
        ("one", 1, "normal"), ("two", 1, "step_not_run"),
        ("one", 2, "normal"), ("two", 2, "step_not_run")]
    assert sessions[2][3] == sessions[1][0]  # attempt 2 retries attempt 1's last session
    # ... but not after an earlier step's agent failed (Harbor never retries that one)
    one.write_text(one.read_text() + "exit 4\n")
    done = in_process("run", str(folder), "--agent", "oracle", "--db", str(tmp_path / "f.db"),
                      "--json", "--max-attempts", "2")
    assert done.returncode == 0, done.stderr
    assert rows(tmp_path / "f.db", "SELECT step_name, attempt FROM sessions "
                "ORDER BY created_at") == [("one", 1), ("two", 1)]


@pytest.mark.parametrize("passes", [True, False], ids=["passes", "fails"])
def test_a_steps_healthcheck_runs_after_its_setup_and_a_failure_stops_the_attempt(
        tmp_path: Path, passes: bool) -> None:
    """`[steps.healthcheck]` as Harbor runs it: after the step's setup.sh (it sees what
    setup.sh wrote), before the agent; failing, it is the step's exception."""
    check = "test -f setup-uid.txt" if passes else "echo down; exit 1"
    folder = three_steps(tmp_path / "task")
    toml = folder / "task.toml"
    toml.write_text(toml.read_text().replace(
        'name = "two"\n', f'name = "two"\nhealthcheck = {{ command = "{check}", '
                         f'interval_sec = 0.1, retries = 2 }}\n'))
    code, said = run(folder, tmp_path / "t.db", "oracle")
    *sessions, trial = said
    gaps = rows(tmp_path / "t.db", "SELECT code, detail FROM gaps")
    if passes:
        assert [s["rewards"] for s in sessions] == [{"reward": 1.0}, {"reward": 1.0},
                                                    {"reward": 0.5}]
        assert gaps == []
    else:
        assert [s["rewards"] for s in sessions] == [{"reward": 1.0}, None]
        assert sorted(gaps) == [
            ("agent_activation_interrupted", "the session closed before a final decision"),
            ("step_healthcheck_failed", "step 'two': healthcheck failed after 2 retries: "
                                        "echo down; exit 1: the last try exited 1: down"),
            ("steps_stopped", "step 'two': no verification result")]
    assert code == 0 and trial["rewards"] == {"reward": 1.0 if not passes else
                                              pytest.approx(2.5 / 3)}


def test_the_tasks_healthcheck_runs_once_before_the_first_step(tmp_path: Path) -> None:
    """As Harbor, which checks the environment when it starts, not per step."""
    folder = three_steps(tmp_path / "task")
    toml = folder / "task.toml"
    toml.write_text('[environment.healthcheck]\ncommand = "echo >> checked.txt"\n'
                    + toml.read_text())
    samples.executable(folder / "steps" / "two" / "tests" / "test.sh", ". /tests/lib.sh\n"
                       'test "$(wc -l < checked.txt)" = 1 && give 1 || give 0\n')
    code, said = run(folder, tmp_path / "t.db", "oracle")
    assert code == 0 and said[1]["rewards"] == {"reward": 1.0}


def kept_by_step(tmp_path: Path, top: str, two: str, like: str) -> list[tuple[Any, ...]]:
    """`three_steps` with `top` before its steps and `two` in step two's table, run by the
    oracle: each session's step and the files its verification lists under `like`."""
    folder = three_steps(tmp_path / "task")
    toml = folder / "task.toml"
    toml.write_text(top + toml.read_text().replace('name = "two"\n', f'name = "two"\n{two}'))
    code, _ = run(folder, tmp_path / "t.db", "oracle")
    assert code == 0
    return rows(tmp_path / "t.db", "SELECT s.step_name, f.path, f.sha256 FROM "
                "verification_files f JOIN sessions s ON s.session_id = f.session_id "
                f"WHERE f.path LIKE '{like}' ORDER BY s.created_at, f.path")


def test_a_steps_artifacts_are_collected_after_the_tasks_in_its_session(
        tmp_path: Path) -> None:
    kept = kept_by_step(tmp_path, 'artifacts = ["/app/one.txt"]\n',
                        'artifacts = ["/app/two.txt"]\n', "artifacts/app/%")
    assert [(step, path) for step, path, _ in kept] == [
        ("one", "artifacts/app/one.txt"), ("two", "artifacts/app/one.txt"),
        ("two", "artifacts/app/two.txt"), ("three", "artifacts/app/one.txt")]


def test_a_steps_collect_hooks_run_after_the_tasks_in_its_session(tmp_path: Path) -> None:
    """Harbor's `_collect_hooks_for`: the task's hooks, then the step's, after its agent."""
    kept = kept_by_step(tmp_path, '[[verifier.collect]]\ncommand = "echo task"\n',
                        '[[steps.verifier.collect]]\ncommand = "cat two.txt"\n', "collect/%")
    task, two = hashlib.sha256(b"task\n").hexdigest(), hashlib.sha256(b"given\n").hexdigest()
    assert kept == [("one", "collect/1.txt", task), ("two", "collect/1.txt", task),
                    ("two", "collect/2.txt", two), ("three", "collect/1.txt", task)]


def test_the_upload_never_follows_a_link_the_agent_left(tmp_path: Path) -> None:
    source, work, host = tmp_path / "workdir", tmp_path / "work", tmp_path / "host"
    for folder in (source / "sub", work, host):
        folder.mkdir(parents=True)
    (source / "sub" / "file.txt").write_text("step\n")
    (source / "top.txt").write_text("top\n")
    (work / "sub").symlink_to(host)  # planted by an earlier step's agent
    (work / "top.txt").symlink_to(host / "top.txt")
    upload(source, work, None)
    assert list(host.iterdir()) == []
    assert not (work / "sub").is_symlink() and (work / "sub" / "file.txt").read_text() == "step\n"
    assert not (work / "top.txt").is_symlink() and (work / "top.txt").read_text() == "top\n"


def test_a_killed_job_resumes_a_multi_step_trial_from_step_1_never_two_at_once(
        tmp_path: Path) -> None:
    """`job run` is SIGKILLed while step two's solution runs: the resumed job recovers the
    open step session, starts the trial again from step 1 (the attempt's first session
    names the last one before), and no step of the killed attempt still runs once the
    resumed one starts — step sessions never overlap."""
    import subprocess
    import sys

    from tests.jobs.test_trial import killed_while_sleeping
    from tests.store.test_leases import _sleeping, sleep_marker

    marker = sleep_marker(70)  # the sleep step two runs
    folder = three_steps(tmp_path / "data" / "multi")
    samples.executable(folder / "steps" / "two" / "solution" / "solve.sh",
                       f"sleep {marker}; cp given.txt two.txt\n")
    db = tmp_path / "t.db"
    argv = ["job", "run", "steps", str(tmp_path / "data"), "--agent", "oracle", "--db", str(db)]
    killed_while_sleeping(*argv, marker=marker)
    samples.executable(folder / "steps" / "two" / "solution" / "solve.sh",
                       "cp given.txt two.txt\n")
    resumed = subprocess.run([sys.executable, "-m", "trialledger.cli", *argv],
                             capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr
    assert not _sleeping(marker)  # the killed attempt's step is not left running
    found = rows(db, "SELECT attempt, step_name, close_reason, outcome, created_at, "
                     "closed_at, retry_of, session_id FROM sessions ORDER BY created_at")
    assert [r[:3] for r in found] == [
        (1, "one", "normal"), (1, "two", "recovered"),
        (2, "one", "normal"), (2, "two", "normal"), (2, "three", "normal")], found
    assert found[2][6] == found[1][7]  # the new attempt's first session follows the last
    for before, after in itertools.pairwise(found):
        assert after[4] >= before[5]  # never two step sessions at once
    shown = json.loads(in_process("job", "show", "steps", "--db", str(db), "--json").stdout)
    (trial,) = shown["trials"]
    assert trial["rewards"] == {"reward": pytest.approx(2.5 / 3)}
