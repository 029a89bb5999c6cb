"""One attempt of a multi-step task (docs/SPEC.md §17), as Harbor's `trial/multi_step.py`
runs it: one sandbox serves every step in order; each step is a session of its own.

Per step: its session seeded (`step` {name, index, count}, the attempt's number) →
`steps/<name>/workdir/` uploaded into the workdir, its `setup.sh` run there and then its
`healthcheck`, as the step's agent user (a failure of either is Harbor's step exception:
gap `step_setup_failed` or `step_healthcheck_failed`, no agent, no verifier, the session
closed `step_not_run`, the attempt stopped) → the agent (Codex with the step's prompt, the
oracle with the step's solution, nop) → the task's artifacts and the step's → its tests
(the step's merged over the task's) → the gate (core/steps.py `attempt_end`): when the
attempt cannot go on, gap `steps_stopped` before `session.closed`. Step k+1 starts only
once step k's session is closed; a step decided `retry` ends the attempt (adapters/jobs/trial.py
retries the trial from step 1 in a fresh sandbox).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import anyio

from trialledger.adapters.images.environment import Environment
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.bwrap import TESTS_INSIDE, VERIFIER_LOGS_INSIDE
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.session.recorder import Recorder
from trialledger.adapters.session.sessions import SessionResult, StepSessions
from trialledger.adapters.session.verifying import phase_env
from trialledger.adapters.tasks.healthcheck import run_healthcheck
from trialledger.adapters.tasks.steps import Step
from trialledger.adapters.tasks.task import Task
from trialledger.core.events import StepInfo
from trialledger.core.settings import Settings
from trialledger.core.steps import NOT_RUN, AttemptEnd, StepRun, attempt_end

SETUP_SHOWN = 300  # characters of a failing setup.sh's output in its gap
Close = Callable[[Recorder], Awaitable[None]]  # the step's gate, before its session closes


def refuse_here(task: Task, environment: Environment, settings: Mapping[str, object]
                ) -> None:
    """SandboxRefused, by name, where a multi-step task is not run: a host task whose
    workdir is / (each step's `workdir/` would go over the host's folder itself) or with a
    step's own network mode; over an
    image, a sandbox per phase (`verifier_isolation = strict`: Harbor's steps share one
    container)."""
    where = task.folder / "task.toml"
    if environment.root is None and str(settings["workdir"]) == "/":
        raise SandboxRefused(f"{where}: steps: a host task's multi-step run needs a workdir "
                             f"other than /")
    differs = [step for step in task.steps if any(
        task.network_modes.get(phase) != mode for phase, mode in step.network_modes.items())]
    if environment.root is None and differs:
        named = differs[0]
        raise SandboxRefused(f"{where}: [[steps]] {named.name!r}: a step's network_mode needs "
                             f"an image or rootfs environment (its container switches "
                             f"networks per phase); a host task's phases share the host's")
    if environment.root is not None and settings["verifier_isolation"] != "harbor":
        raise SandboxRefused(f"{where}: steps: over an image the steps share one container "
                             f"(verifier_isolation = harbor), not a sandbox per phase")


def step_task(task: Task, step: Step) -> Task:
    """The task as one step's session sees it: the step's prompt, its timeouts, users,
    `[steps.verifier] env`, artifacts and phases' network modes over the task's (a
    separate verifier's phase too), its own verifier mode, its collect hooks after the
    task's; the task's
    healthcheck in the first step only (Harbor checks the environment once, when it
    starts)."""
    separate = step.separate_verifier  # (the task's, unless the step resolves its own)
    if separate is not None and "verifier" in step.network_modes:
        separate = dataclasses.replace(separate, phase_mode=step.network_modes["verifier"])
    return dataclasses.replace(task, instruction=step.instruction,
                               network_modes={**task.network_modes, **step.network_modes},
                               separate_verifier=separate,
                               settings={**task.settings, **step.settings},
                               users={**task.users, **step.users},
                               verifier_env={**task.verifier_env, **step.verifier_env},
                               artifacts=step.artifacts or task.artifacts,
                               collect=(*task.collect, *step.collect),
                               healthcheck=task.healthcheck if step.index == 1 else None)


def finished(result: SessionResult) -> bool:
    """Whether a step session ends its step (adapters/jobs/trial.py `step_finishes`): decided
    `verify`, `unverified` and closed by its runner, or closed `NOT_RUN`."""
    return result.outcome in ("verify", "unverified") or result.close_reason == NOT_RUN


async def run_attempt(runner: StepSessions, *, attempt: int, retry_of: str | None,
                      trial_id: str | None, lease: str | None) -> list[SessionResult]:
    """Every step of one attempt in one sandbox, until one cannot go on (`attempt_end`);
    the step sessions it ran."""
    task = runner.task
    gates = [step.min_reward for step in task.steps]
    fence = (trial_id, lease) if trial_id is not None and lease is not None else None
    results: list[SessionResult] = []
    runs: list[StepRun] = []
    opened = await runner.open_sandbox(f"steps-{os.urandom(8).hex()}")
    try:
        for step in task.steps:
            if step.index > 1:
                forget_rollouts(opened.sandbox)
            info = StepInfo(name=step.name, index=step.index, count=len(task.steps))
            one = runner.for_step(step)
            opened.sandbox.use_modes({phase: mode for phase, mode in one.task.network_modes.items()
                                      if phase == "agent" or step.separate_verifier is None})
            close = functools.partial(gate, step, tuple(runs), gates)
            result = await one.session_in(
                opened, attempt=attempt, retry_of=retry_of if step.index == 1 else None,
                trial_id=trial_id, fence=fence, step=info,
                prepare=functools.partial(prepare, one, step, close), before_close=close)
            results.append(result)
            runs.append(StepRun(step.name, finished(result), result.view.rewards))
            if attempt_end(runs, gates).over:
                break
    finally:
        await opened.close()
    runner.last = results[-1] if results else runner.last
    return results


def forget_rollouts(sandbox: LocalSandbox) -> None:
    """Codex's rollouts of the previous step (archived with its session) removed from the
    shared Codex home, so a step's usage and archive are its own."""
    rollouts = sandbox.session_dir / "sessions"
    if rollouts.is_symlink():
        rollouts.unlink()
    else:
        shutil.rmtree(rollouts, ignore_errors=True)


async def prepare(runner: StepSessions, step: Step, close: Close, rec: Recorder,
                  sandbox: LocalSandbox, settings: Settings) -> None:
    """Before the step's agent: its tests staged for its verifier; in a container, the
    network back on `[environment]`'s mode (what the previous step's phases switched it to
    ends with them, as Harbor's phase policies do) and the previous step's `/tests` and
    `/logs/verifier` emptied (Harbor's reset after a shared verifier: no later step's agent
    reads a grader); its workdir uploaded, its `setup.sh`
    run in the workdir and its healthcheck, as the step's agent user. When setup.sh or
    the healthcheck fails, the session is closed `NOT_RUN` here (after `close`, the
    gate). A copy that fails, or a command that cannot start (the container ended), is a
    gap: the agent's launch then finds the sandbox lost, and the trial is retried."""
    sandbox.tests = await anyio.to_thread.run_sync(stage_tests, step, sandbox)
    if step.index > 1 and sandbox.container is not None:
        try:  # as Harbor: back on the baseline network (its phase policies end with their
            await sandbox.use_baseline()  # phase), the last step's grader and output gone
            for inside in (TESTS_INSIDE, VERIFIER_LOGS_INSIDE):
                await sandbox.clear_inside(inside)
        except OSError as error:  # (the container ended: the agent cannot start either)
            await rec.add("gap.recorded", {"code": "step_setup_failed",
                                           "detail": f"step {step.name!r}: {error}"})
    if step.workdir is not None and not await upload_workdir(step, rec, sandbox):
        return
    failed = await run_setup(runner, step, rec, sandbox, settings) if step.setup else None
    if failed is None and step.healthcheck is not None:
        failed = await step_healthcheck(runner, step, rec, sandbox)
    if failed is not None:
        code, detail = failed
        await rec.add("gap.recorded", {"code": code, "detail": f"step {step.name!r}: {detail}"})
        await close(rec)
        await rec.add("session.closed", {"reason": NOT_RUN})


async def upload_workdir(step: Step, rec: Recorder, sandbox: LocalSandbox) -> bool:
    """`steps/<name>/workdir/` into the workdir (False, and a gap, when it failed)."""
    assert step.workdir is not None
    try:
        if sandbox.image is not None:  # into the step's container, by its root
            await sandbox.copy_into(step.workdir, sandbox.agent_workdir, user=None, merge=True)
        else:
            await anyio.to_thread.run_sync(
                upload, step.workdir, sandbox.host_work,
                sandbox.agent_owner if sandbox.runs_as.switches else None)
    except OSError as error:  # (the container ended; what a daemon left raced the copy)
        await rec.add("gap.recorded", {"code": "step_setup_failed",
                                       "detail": f"step {step.name!r}: its workdir/ could "
                                                 f"not be uploaded: {error}"})
        return False
    return True


def stage_tests(step: Step, sandbox: LocalSandbox) -> Path | None:
    """The step's tests: its `tests/` merged over the task's (its `test.sh`, if any, over
    the task's), staged in the session folder; None when neither has a `test.sh`."""
    if step.test_script is None:
        return None
    target = sandbox.root / f"step-tests-{step.index}"
    for layer in step.tests:
        shutil.copytree(layer, target, symlinks=True, dirs_exist_ok=True)
    return target


def _shell(sandbox: LocalSandbox) -> str:
    """`bash`, or `sh` in an image without bash."""
    return "bash" if sandbox.image is None or sandbox.image.has("bash") else "sh"


async def run_setup(runner: StepSessions, step: Step, rec: Recorder, sandbox: LocalSandbox,
                    settings: Settings) -> tuple[str, str] | None:
    """`bash <workdir>/setup.sh` (`sh` without bash) in the workdir as the step's agent
    user, within the step's agent timeout: None when it exited 0 (or could not start: a
    gap, the sandbox's trouble), else (gap code, detail)."""
    env = {**sandbox.base_env(), **phase_env(sandbox)}
    script = f"{sandbox.agent_workdir.rstrip('/')}/setup.sh"
    try:
        ran = await sandbox.run_command([_shell(sandbox), script], settings.timeout_s,
                                        env=env, user=runner.task.users.get("agent"))
    except OSError as error:
        await rec.add("gap.recorded", {"code": "step_setup_failed",
                                       "detail": f"step {step.name!r}: setup.sh could not "
                                                 f"start: {error}"})
        return None
    if ran.code == 0:
        return None
    why = "timed out" if ran.code is None else f"exited with {ran.code}"
    said = ran.output.decode("utf-8", errors="replace").strip()[-SETUP_SHOWN:]
    return "step_setup_failed", f"setup.sh {why}" + (f": {said}" if said else "")


async def step_healthcheck(runner: StepSessions, step: Step, rec: Recorder,
                           sandbox: LocalSandbox) -> tuple[str, str] | None:
    """The step's healthcheck as Harbor runs it after setup.sh: `bash -c` in the workdir
    as the step's agent user, with Docker's tries (adapters/tasks/healthcheck.py). None when it
    passed (or could not start: a gap), else (gap code, detail)."""
    check = step.healthcheck
    assert check is not None
    env = {**sandbox.base_env(), **phase_env(sandbox)}

    async def attempt(timeout_s: float) -> tuple[int | None, str]:
        ran = await sandbox.run_command([_shell(sandbox), "-c", check.command], timeout_s,
                                        env=env, user=runner.task.users.get("agent"))
        return ran.code, ran.output.decode("utf-8", errors="replace")

    try:
        failure = await run_healthcheck(check, attempt)
    except OSError as error:
        await rec.add("gap.recorded", {"code": "step_healthcheck_failed",
                                       "detail": f"step {step.name!r}: the healthcheck could "
                                                 f"not start: {error}"})
        return None
    return None if failure is None else ("step_healthcheck_failed", failure)


async def gate(step: Step, runs: Sequence[StepRun],
               gates: Sequence[Mapping[str, float] | None], rec: Recorder) -> None:
    """Before the step's session closes: gap `steps_stopped` when the attempt stops here
    early (no verification result, or its `min_reward` failed) — never after a `retry`
    (the trial is retried) nor after the last step."""
    rewards = next((dict(stored.event.data.rewards) for stored in rec.log
                    if stored.event.type == "verification.recorded"), None)
    now_runs = [*runs, StepRun(step.name, rec.action != "retry", rewards)]
    end: AttemptEnd = attempt_end(now_runs, gates)
    if end.stopped is not None and step.index < len(gates):
        await rec.add("gap.recorded", {"code": "steps_stopped", "detail": end.stopped})


def upload(source: Path, target: Path, owner: tuple[int, int] | None) -> None:
    """`source` copied into `target` (an agent's folder) as Harbor's `upload_dir` does,
    merged over what is there, owned by `owner`. Never through a link the agent left:
    each folder is opened without following links, and an entry in the way of a copied one
    is replaced."""
    top = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _upload_into(source, top, owner)
    finally:
        os.close(top)


def _upload_into(source: Path, folder: int, owner: tuple[int, int] | None) -> None:
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    for entry in os.scandir(source):
        mode = entry.stat(follow_symlinks=False).st_mode
        if entry.is_symlink():
            _clear(entry.name, folder, keep_folder=False)
            os.symlink(os.readlink(entry.path), entry.name, dir_fd=folder)
            if owner is not None:
                os.chown(entry.name, *owner, dir_fd=folder, follow_symlinks=False)
        elif entry.is_dir(follow_symlinks=False):
            _clear(entry.name, folder, keep_folder=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(entry.name, stat.S_IMODE(mode), dir_fd=folder)
            inner = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | flags, dir_fd=folder)
            try:
                if owner is not None:
                    os.fchown(inner, *owner)
                _upload_into(Path(entry.path), inner, owner)
            finally:
                os.close(inner)
        elif entry.is_file(follow_symlinks=False):
            _clear(entry.name, folder, keep_folder=False)
            out = os.open(entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags,
                          stat.S_IMODE(mode), dir_fd=folder)
            try:
                with open(entry.path, "rb") as readable, os.fdopen(out, "wb",
                                                                     closefd=False) as w:
                    shutil.copyfileobj(readable, w)
                os.fchmod(out, stat.S_IMODE(mode))
                if owner is not None:
                    os.fchown(out, *owner)
            finally:
                os.close(out)


def _clear(name: str, folder: int, *, keep_folder: bool) -> None:
    """Remove what is at `name` in `folder` (a real folder kept when `keep_folder`)."""
    try:
        found = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(found.st_mode):
        if not keep_folder:
            shutil.rmtree(name, dir_fd=folder)  # (fd-based: links are never followed)
    else:
        os.unlink(name, dir_fd=folder)
