"""Multi-step tasks (docs/SPEC.md §17, "Multi-step tasks"): `[[steps]]` and `steps/<name>/`
read as Harbor 0.26 reads them; a bad step one line, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.runs import in_process
from trialledger.adapters.demo import samples
from trialledger.adapters.jobs.queue import load_tasks
from trialledger.adapters.tasks.collect import CollectHook
from trialledger.adapters.tasks.steps import StepInvalid
from trialledger.adapters.tasks.task import NoVerifier, Task, TaskInvalid, require_verifier
from trialledger.core.steps import AttemptEnd, StepRun, attempt_end, trial_reward

TWO_STEPS = ("[[steps]]\nname = 'write'\nmin_reward = 1\n"
             "[[steps]]\nname = 'check'\nmin_reward = {reward = 0.5, style = 1}\n"
             "[steps.agent]\ntimeout_sec = 30\nuser = 'agent'\n"
             "[steps.verifier]\ntimeout_sec = 20\nenv = {MODE = 'strict'}\n")


def multi_step(folder: Path, toml: str = TWO_STEPS, *, steps: tuple[str, ...] = (
        "write", "check"), root_tests: bool = True) -> Path:
    """A multi-step task: no root instruction.md, each step's prompt in its folder; the
    task's tests/test.sh; `check` has its own test.sh and a workdir with setup.sh."""
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    if root_tests:
        samples.executable(folder / "tests" / "test.sh", "#!/bin/sh\nexit 0\n")
        (folder / "tests" / "shared.txt").write_text("shared\n")
    for name in steps:
        (folder / "steps" / name).mkdir(parents=True)
        (folder / "steps" / name / "instruction.md").write_text(f"do {name}\n")
    if "check" in steps:
        samples.executable(folder / "steps" / "check" / "tests" / "test.sh", "#!/bin/sh\n")
        samples.executable(folder / "steps" / "check" / "workdir" / "setup.sh", "touch x\n")
        samples.executable(folder / "steps" / "check" / "solution" / "solve.sh", "true\n")
    return folder


def test_steps_are_read_as_harbor_reads_them(tmp_path: Path) -> None:
    task = Task.load(multi_step(tmp_path / "task"))
    assert task.instruction == "" and task.reward_strategy == "mean"
    write, check = task.steps
    assert (write.name, write.index, write.instruction) == ("write", 1, "do write\n")
    assert write.min_reward == {"reward": 1.0} and write.workdir is None
    assert write.setup is None and write.solution is None  # the task's solution/
    tests = task.folder / "tests"
    assert write.tests == (tests,) and write.test_script == tests / "test.sh"
    home = task.folder / "steps" / "check"
    assert check.min_reward == {"reward": 0.5, "style": 1.0}
    assert check.tests == (tests, home / "tests")  # merged in this order: the step's wins
    assert check.test_script == home / "tests" / "test.sh"
    assert (check.workdir, check.setup) == (home / "workdir", home / "workdir" / "setup.sh")
    assert check.solution == home / "solution"
    assert check.settings == {"timeout_s": 30.0, "verifier_timeout_s": 20.0}
    assert check.users == {"agent": "agent"} and check.verifier_env == {"MODE": "strict"}
    assert task.ignored_fields == {}
    assert check.gate_failure({"reward": 1.0, "style": 1}) is None
    assert check.gate_failure({"reward": 1.0}) == "style=-inf below min_reward 1.0"
    assert write.gate_failure(None) == "reward=-inf below min_reward 1.0"
    final = Task.load(multi_step(tmp_path / "final", "multi_step_reward_strategy = 'final'\n"
                                 + TWO_STEPS))
    assert final.reward_strategy == "final"


def test_a_steps_network_modes_and_collect_hooks_are_read(tmp_path: Path) -> None:
    """Over the task's for the step's phases; its hooks after the task's; its allowlist
    the task's (one serves the session). A host task cannot switch a step's network."""
    toml = ("[agent]\nnetwork_mode = 'allowlist'\nallowed_hosts = ['a.example']\n"
            "[[steps]]\nname = 'write'\n[steps.agent]\nnetwork_mode = 'no-network'\n"
            "[steps.verifier]\nnetwork_mode = 'allowlist'\nallowed_hosts = ['a.example']\n"
            "[[steps.verifier.collect]]\ncommand = 'ls'\nuser = 'agent'\n")
    folder = multi_step(tmp_path / "task", toml, steps=("write",))
    task = Task.load(folder)
    (write,) = task.steps
    assert write.network_modes == {"agent": "no-network", "verifier": "allowlist"}
    assert write.collect == (CollectHook("ls", user="agent"),)
    assert task.allowed_hosts is not None and task.collect == ()
    assert "[[verifier.collect]] user" in task.unhonoured(in_range=False)
    samples.executable(folder / "solution" / "solve.sh", "true\n")
    done = in_process("run", str(folder), "--agent", "oracle", "--db", str(tmp_path / "t.db"))
    refusal = done.stderr.splitlines()[-1]  # (after the warning about the hook's user)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "[[steps]] 'write': a step's network_mode needs an image" in refusal


def test_a_step_without_a_test_script_of_its_own_or_the_tasks_has_no_verifier(
        tmp_path: Path) -> None:
    task = Task.load(multi_step(tmp_path / "task", root_tests=False))
    assert task.steps[1].test_script is not None and task.steps[0].test_script is None
    with pytest.raises(NoVerifier, match=r"step .write. has no tests/test\.sh"):
        require_verifier(task)


# (task.toml, steps/ folders made, what the one-line refusal says)
BAD = [
    ("[[steps]]\nname = 'one'\n", (), "no folder steps/one/"),
    ("[[steps]]\nname = 'one'\n", ("one:bare",), "no steps/one/instruction.md"),
    ("[[steps]]\nname = '../up'\n", (), "not a portable folder name"),
    ("[[steps]]\nname = 'CON'\n", (), "not a portable folder name"),
    ("[[steps]]\nname = 'one'\n[[steps]]\nname = 'ONE'\n", ("one",), "must be unique"),
    ("[[steps]]\nname = 3\n", (), "#1 name = 3: expected a string"),
    ("steps = 'one'\n", (), "steps = 'one': expected an array of tables"),
    ("[[steps]]\nname = 'one'\nmin_reward = 'high'\n", ("one",),
     "min_reward = 'high': expected a number or a table"),
    ("[[steps]]\nname = 'one'\nmin_reward = {reward = true}\n", ("one",),
     "expected a number or a table"),
    ("multi_step_reward_strategy = 'max'\n[[steps]]\nname = 'one'\n", ("one",),
     "multi_step_reward_strategy = 'max': expected 'mean' or 'final'"),
    ("[[steps]]\nname = 'one'\n[steps.agent]\ntimeout_sec = -1\n", ("one",),
     "agent.timeout_sec = -1: expected a positive number"),
    ("[[steps]]\nname = 'one'\nagent = 'x'\n", ("one",), "agent = 'x': expected a table"),
    ("[[steps]]\nname = 'one'\n[steps.healthcheck]\ncommand = ''\n", ("one",),
     "[[steps]] 'one' healthcheck command: a shell command is needed"),
    ("[[steps]]\nname = 'one'\nartifacts = [{source = '/a', destination = '/abs'}]\n",
     ("one",), "destination '/abs' must be a relative path"),
    ("[[steps]]\nname = 'one'\nartifacts = [{source = '/a', service = 'db'}]\n",
     ("one",), "from service 'db': the task has no such compose service"),
    ("[[steps]]\nname = 'one'\n[steps.verifier]\ncollect = [{command = 'true', "
     "service = 'db'}]\n", ("one",),
     "[[steps]] 'one': [[verifier.collect]] 1 service = 'db': the task has no such compose"),
    ("[[steps]]\nname = 'one'\n[steps.verifier]\ncollect = [{timeout_sec = 1}]\n",
     ("one",), "[[steps]] 'one': [[verifier.collect]] 1 command = None"),
    ("[environment]\ndocker_image = 'localhost/task:1'\n[[steps]]\nname = 'one'\n"
     "[steps.verifier.environment]\nrootfs = 'root.tar'\n", ("one",),
     "[[steps]] 'one' verifier.environment.rootfs: the separate verifier's image is a"),
    ("[environment]\ndocker_image = 'localhost/task:1'\n[[steps]]\nname = 'one'\n"
     "[steps.verifier]\nenvironment_mode = 'shared'\n[steps.verifier.environment]\n", ("one",),
     "[steps.verifier] environment_mode = 'shared' is incompatible"),
    ("[[steps]]\nname = 'one'\n[steps.agent]\nallowed_hosts = ['a.example']\n", ("one",),
     "[[steps]] 'one' [steps.agent] allowed_hosts is only valid when"),
    ("[[steps]]\nname = 'one'\n[steps.agent]\nnetwork_mode = 'offline'\n", ("one",),
     "[[steps]] 'one': [steps.agent] network_mode must be one of"),
    ("[[steps]]\nname = 'one'\n[steps.verifier]\nnetwork_mode = 'public'\n"
     "allowed_hosts = ['a.example']\n", ("one",),
     "[[steps]] 'one' [steps.verifier] allowed_hosts is only valid when"),
    ("[agent]\nnetwork_mode = 'allowlist'\nallowed_hosts = ['a.example']\n[[steps]]\n"
     "name = 'one'\n[steps.agent]\nnetwork_mode = 'allowlist'\nallowed_hosts = ['b.example']\n",
     ("one",), "[[steps]] 'one' [steps.agent] allowed_hosts: its phase would reach other "
               "hosts than [agent]'s; one allowlist serves the whole session here"),
    ("[[steps]]\nname = 'one'\n[steps.verifier]\nenv = {K = '${NOT_SET_ANYWHERE_XYZ}'}\n",
     ("one",), "NOT_SET_ANYWHERE_XYZ"),
]


@pytest.mark.parametrize(("toml", "made", "says"), BAD, ids=[s for _, _, s in BAD])
def test_a_bad_step_is_refused_in_one_line(tmp_path: Path, toml: str, made: tuple[str, ...],
                                           says: str) -> None:
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "task.toml").write_text(toml)
    samples.executable(folder / "tests" / "test.sh", "#!/bin/sh\n")
    for entry in made:
        name, _, bare = entry.partition(":")
        (folder / "steps" / name).mkdir(parents=True)
        if not bare:
            (folder / "steps" / name / "instruction.md").write_text("go\n")
    (folder / "steps").mkdir(exist_ok=True)
    with pytest.raises(TaskInvalid) as refused:
        Task.load(folder)
    assert says in str(refused.value) and "\n" not in str(refused.value)
    done = in_process("run", str(folder), "--agent", "oracle", "--db", str(tmp_path / "t.db"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr


def test_a_step_folder_that_leads_out_is_refused(tmp_path: Path) -> None:
    folder = multi_step(tmp_path / "task", "[[steps]]\nname = 'out'\n", steps=())
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "instruction.md").write_text("read the host\n")
    (folder / "steps").mkdir()
    os.symlink(outside, folder / "steps" / "out")
    with pytest.raises(StepInvalid, match="steps/out leads out of the task folder"):
        Task.load(folder)


def test_an_unknown_step_key_is_warned_by_name(tmp_path: Path) -> None:
    task = Task.load(multi_step(tmp_path / "task", "[[steps]]\nname = 'write'\ncolour = 1\n"
                                "[steps.agent]\nmood = 'calm'\n", steps=("write",)))
    assert set(task.ignored_fields) == {"[[steps]] 'write' colour",
                                        "[[steps]] 'write' agent.mood"}


def test_a_dataset_lists_a_multi_step_task_and_skips_a_bad_one(tmp_path: Path) -> None:
    data = tmp_path / "data"
    multi_step(data / "good")
    bad = data / "bad"
    bad.mkdir(parents=True)
    (bad / "task.toml").write_text("[[steps]]\nname = 'gone'\n")
    (bad / "steps").mkdir()
    (data / "undeclared" / "steps").mkdir(parents=True)
    (data / "undeclared" / "task.toml").write_text("[agent]\ntimeout_sec = 5\n")
    samples.write_task(data / "plain", instruction="hi", test_sh="exit 0\n", toml=None,
                       workspace=None, exit_code_reward=True)
    selection = load_tasks([data])
    assert [task.name for task in selection.tasks] == ["good", "plain"]
    assert "no folder steps/gone/" in selection.skipped["bad"]
    assert "declares no [[steps]]" in selection.skipped["undeclared"]
    alone = in_process("run", str(data / "good"), "--agent", "oracle",
                       "--db", str(tmp_path / "t.db"))  # step 'write' has no solution
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
    assert "step 'write': no solution/solve.sh, which the oracle agent runs" in alone.stderr


# --- the trial's rules over its steps (core/steps.py) ---------------------------------------

GATES: list[dict[str, float] | None] = [{"reward": 1.0}, None, None]


def ran(name: str, rewards: dict[str, float] | None, finished: bool = True) -> StepRun:
    return StepRun(name, finished, rewards)


@pytest.mark.parametrize(("runs", "end"), [
    ([], AttemptEnd(over=False, retry=False)),
    ([ran("a", {"reward": 1.0})], AttemptEnd(over=False, retry=False)),
    ([ran("a", {"reward": 0.0})],
     AttemptEnd(over=True, retry=False, stopped="step 'a': reward=0.0 below min_reward 1.0")),
    ([ran("a", {"style": 1.0})],
     AttemptEnd(over=True, retry=False, stopped="step 'a': reward=-inf below min_reward 1.0")),
    ([ran("a", {"reward": 1.0}), ran("b", None)],
     AttemptEnd(over=True, retry=False, stopped="step 'b': no verification result")),
    ([ran("a", {"reward": 1.0}), StepRun("b", True, None, not_run=True)],
     AttemptEnd(over=True, retry=False, stopped="step 'b': no verification result",
                rerun=True)),
    ([StepRun("a", True, {"reward": 1.0}, agent_failed=True),
      StepRun("b", True, None, not_run=True)],
     AttemptEnd(over=True, retry=False, stopped="step 'b': no verification result")),
    ([ran("a", {"reward": 1.0}), ran("b", None, finished=False)],
     AttemptEnd(over=True, retry=True)),
    ([ran("a", {"reward": 1.0}), ran("b", {"reward": 0.0}), ran("c", {"reward": 0.0})],
     AttemptEnd(over=True, retry=False)),
], ids=["none", "gate-holds", "gate-fails", "gate-key-missing", "no-result", "not-set-up",
        "not-set-up-after-an-agent-failure", "retry", "complete"])
def test_an_attempt_goes_on_stops_or_is_retried_as_harbors(runs: list[StepRun],
                                                           end: AttemptEnd) -> None:
    assert attempt_end(runs, GATES) == end


def test_the_trials_reward_is_harbors_mean_or_final() -> None:
    steps: list[dict[str, float] | None] = [{"reward": 1.0}, None, {"reward": 0.0, "x": 1.0}]
    assert trial_reward(steps, "mean") == {"reward": 0.5, "x": 0.5}  # None: not counted
    assert trial_reward(steps, "final") == {"reward": 0.0, "x": 1.0}
    assert trial_reward([{"reward": 1.0}, None], "final") is None
    assert trial_reward([None, {}], "mean") is None and trial_reward([], "mean") is None
