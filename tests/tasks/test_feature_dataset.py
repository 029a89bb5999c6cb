"""The dataset of Harbor 0.26 task features (tests/data/features/, docs/tasks.md): real task
folders in Harbor's format — users per phase, collect hooks, separate verifiers (over the
images built offline), multi-step tasks and compose environments — run as a user runs a
dataset: `job run` with the oracle (1 on every task) and nop (0 on every task), trials of
different tasks at once while a verifier's image builds."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import anyio
import pytest

from tests.images import base_images, module_private_storage  # noqa: F401 (fixtures)
from tests.runs import in_process
from tests.sandbox.test_container import outside_address
from trialledger.adapters.sandbox.process import LocalRun

pytestmark = pytest.mark.usefixtures("base_images")  # the images the tasks name
DATASET = Path(__file__).parents[1] / "data" / "features"


def test_the_oracle_scores_1_and_nop_0_on_every_feature_task(tmp_path: Path) -> None:
    tasks = sorted(path.name for path in DATASET.iterdir())
    assert len(tasks) >= 6
    for agent, expected in (("oracle", 1.0), ("nop", 0.0)):
        done = in_process("job", "run", agent, str(DATASET), "--agent", agent, "-n", "3",
                          "--db", str(tmp_path / "jobs.db"),
                          "--cache-dir", str(tmp_path / "cache"), "--json")
        assert done.returncode == 0, done.stderr + undecided(tmp_path / "jobs.db", agent)
        trials = {trial["task"]: trial for trial in map(json.loads, done.stdout.splitlines())}
        rewards = {task: trial["reward"] for task, trial in trials.items()}
        assert rewards == dict.fromkeys(tasks, expected), done.stdout + done.stderr
        # a session per step; nop fails the first step's min_reward: the second never runs
        assert len(trials["steps-gate"]["sessions"]) == (2 if agent == "oracle" else 1)


def undecided(db: Path, job: str) -> str:
    """What a failure needs to be read: each trial that ended without a decision, with its
    final session's timeline, and each task whose environment failed."""
    summary = json.loads(in_process("job", "show", job, "--db", str(db), "--json").stdout)
    lines = [f"environment failed: {summary['environment_failed']}"]
    for trial in summary["trials"]:
        if not (trial["scored"] == 1 or (trial["state"], trial["outcome"]) == ("done", "verify")):
            lines.append(json.dumps(trial))
            if trial["final_session_id"]:
                lines.append(in_process("show", trial["final_session_id"],
                                        "--db", str(db)).stdout)
    return "\n".join(lines)


def test_a_multi_step_task_in_a_sandbox_per_phase_is_refused_in_one_line(
        tmp_path: Path) -> None:
    """Over an image the steps share one container (Harbor's): `verifier_isolation =
    strict` (a sandbox per phase) cannot give them one, and says so before any session."""
    done = in_process("run", str(DATASET / "steps-image"), "--agent", "oracle",
                      "--db", str(tmp_path / "t.db"), "--cache-dir", str(tmp_path / "cache"),
                      "--set", "verifier_isolation=strict")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "steps share one container" in done.stderr and "Traceback" not in done.stderr


def steps_image_with(tmp_path: Path, step: str, solve_sh: str, grade: str) -> float:
    """The reward of `steps-image` run by the oracle with `step`'s solution replaced by
    `solve_sh` and the final step's tests giving 1 when the shell test `grade` holds."""
    task = tmp_path / "steps-image"
    shutil.copytree(DATASET / "steps-image", task)
    (task / "steps" / step / "solution" / "solve.sh").write_text(f"#!/bin/sh\n{solve_sh}")
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/sh\nif {grade}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    done = in_process("job", "run", "variant", str(task), "--agent", "oracle",
                      "--db", str(tmp_path / "t.db"), "--cache-dir", str(tmp_path / "cache"),
                      "--json")
    assert done.returncode == 0, done.stderr
    reward: float = json.loads(done.stdout)["reward"]
    return reward


def test_a_link_the_agent_left_in_the_way_of_a_steps_workdir_is_replaced(
        tmp_path: Path) -> None:
    """Step 1's agent makes `data` (where step 2's workdir/ brings data/more.txt) a link to
    a folder outside the workdir: the upload, by the container's root, replaces the link
    with a folder and writes nothing through it."""
    assert steps_image_with(
        tmp_path, "fetch",
        "cp data/seed.txt out.txt\nmkdir -p /elsewhere\nrm -r data\nln -s /elsewhere data\n",
        '[ -d data ] && [ ! -L data ] && [ -f data/more.txt ] && [ -z "$(ls -A /elsewhere)" ]'
    ) == 1.0


def test_a_later_steps_agent_finds_no_grader_of_the_step_before(
        tmp_path: Path) -> None:
    """As Harbor resets them after a shared verifier: step 1's `/tests` (the task's final
    test.sh among them) and its `/logs/verifier` are emptied before step 2's agent runs
    in the same container."""
    assert steps_image_with(
        tmp_path, "extend",
        "cat data/more.txt >> out.txt\nls -A /tests /logs/verifier > seen.txt 2>&1\n",
        "[ -f out.txt ] && ! grep -q test.sh seen.txt && ! grep -q reward seen.txt") == 1.0


def _steps_image_and_an_outside_server(tmp_path: Path) -> tuple[socket.socket, str, Path]:
    """A copy of the `steps-image` task, a server listening on this machine's outside
    address, and the shell line that reaches it (exit 0) or not."""
    outside = socket.create_server((outside_address(), 0))
    address, port = outside.getsockname()[:2]
    reach = f"(bash -c 'echo > /dev/tcp/{address}/{port}') 2>/dev/null"
    task = tmp_path / "steps-image"
    shutil.copytree(DATASET / "steps-image", task)
    return outside, reach, task


def test_each_steps_phases_run_on_their_own_network_mode(tmp_path: Path) -> None:
    """Harbor's network plan per step: a step's `[steps.agent]` / `[steps.verifier]`
    `network_mode` over the task's for that step's phases, in the one container — step 1's
    agent cut off, step 2's agent public (the task's), step 2's verifier cut off."""
    outside, reach, task = _steps_image_and_an_outside_server(tmp_path)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace(
        '# its workdir/ brings data/seed.txt and a setup.sh\n',
        '\n[steps.agent]\nnetwork_mode = "no-network"\n').replace(
        '# its workdir/ merges data/more.txt into data/',
        '\n[steps.verifier]\nnetwork_mode = "no-network"\n'))
    for step in ("fetch", "extend"):
        solve = task / "steps" / step / "solution" / "solve.sh"
        solve.write_text(solve.read_text() + f"{reach} && echo reached > {step}.net "
                                             f"|| echo cut > {step}.net\n")
    (task / "tests" / "test.sh").write_text(
        f'#!/bin/sh\nif [ "$(cat fetch.net)" = cut ] && [ "$(cat extend.net)" = reached ] '
        f'&& ! {reach}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    with outside:
        done = in_process("job", "run", "nets", str(task), "--agent", "oracle",
                          "--db", str(tmp_path / "t.db"),
                          "--cache-dir", str(tmp_path / "cache"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reward"] == 1.0, done.stdout


def test_a_later_steps_setup_runs_on_the_environments_network_not_the_last_phases(
        tmp_path: Path) -> None:
    """Step 2's `setup.sh` runs on `[environment]`'s network (no-network), never on the
    public one step 1's verifier had (its own `[steps.verifier]` mode): the container is
    put back on its baseline after a step's verifier and before the next step, and a
    command of ours (setup, healthcheck, hook) takes the baseline itself — the test fails
    only with all three taken out, each of which alone would suffice."""
    outside, reach, task = _steps_image_and_an_outside_server(tmp_path)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace(
        'workdir = "/app"\n', 'workdir = "/app"\nnetwork_mode = "no-network"\n').replace(
        '# its workdir/ brings data/seed.txt and a setup.sh\n',
        '\n[steps.verifier]\nnetwork_mode = "public"\n'))
    step_test = task / "steps" / "fetch" / "tests" / "test.sh"
    step_test.write_text(step_test.read_text() + f"{reach} && echo reached > /app/verifier.net "
                                                 f"|| echo cut > /app/verifier.net\n")
    setup = task / "steps" / "extend" / "workdir" / "setup.sh"
    setup.write_text(f"#!/bin/sh\n{reach} && echo reached > setup.net || echo cut > setup.net\n")
    setup.chmod(0o755)
    (task / "tests" / "test.sh").write_text(
        '#!/bin/sh\nif [ "$(cat verifier.net)" = reached ] && [ "$(cat setup.net)" = cut ]; '
        'then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    with outside:
        done = in_process("job", "run", "baseline", str(task), "--agent", "oracle",
                          "--db", str(tmp_path / "t.db"),
                          "--cache-dir", str(tmp_path / "cache"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reward"] == 1.0, done.stdout


def test_a_run_closed_twice_closes_its_descriptors_once() -> None:
    """A container stopped early (a separate verifier's) and again at the session's end:
    the second close must not close a descriptor another thread has opened since under
    the same number (it broke a concurrent image build's pipe)."""
    async def go() -> None:
        read, write = os.pipe()
        os.close(write)
        process = await anyio.open_process(["true"])
        run = LocalRun(process, status_fd=read, info_fd=None, isolation="runc", marker="m")
        await run.aclose()
        again, other = os.pipe()  # the lowest free numbers: `read`'s comes back
        try:
            assert again == read
            await run.aclose()
            os.fstat(again)  # still open
        finally:
            os.close(again)
            os.close(other)
    anyio.run(go)
