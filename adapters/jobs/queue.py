"""Running a job (docs/SPEC.md §13): tasks × k trials, `concurrency` sessions at a time,
resumable, each trial held under a lease while it runs.

The walk: `JobRunner` claims a trial from the job's queue (`_work`) → the trial runs under
its lease (`Trial.hold`, adapters/jobs/trial.py: the one trial rule `run` follows too — its
next attempt read from its sessions each time, a dead holder's sessions recovered first)
→ each attempt is a session (`SessionRunner.run_session`) → the trial is settled `done`
(`_hold`), or, when its lease ended first, left to its next holder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

from trialledger.adapters.codex.install import find_codex
from trialledger.adapters.images.environment import (
    BuildState,
    BuildWait,
    Cache,
    Environment,
    EnvironmentUnavailable,
)
from trialledger.adapters.images.imagestore import prepared_and_held
from trialledger.adapters.jobs.trial import Lease, Trial, TrialRun, first_of
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.session.runner import RunOptions, SessionRunner
from trialledger.adapters.session.scripted import SCRIPTED, NoSolution, solve_script
from trialledger.adapters.tasks.config import WrongType
from trialledger.adapters.tasks.files import TaskFileTooLarge, file_limit
from trialledger.adapters.tasks.steps import StepInvalid
from trialledger.adapters.tasks.task import (
    NoVerifier,
    Task,
    TaskInvalid,
    UnsupportedField,
    is_task_folder,
    require_verifier,
)
from trialledger.adapters.tasks.verifiermode import prepare_task, refuse_outside_range
from trialledger.core.cost import Price
from trialledger.core.policy import get_policy
from trialledger.core.seed import validate_seed
from trialledger.core.settings import TASK_FILE_MAX_BYTES
from trialledger.core.summary import pass_at_k_for_task
from trialledger.store import Ledger, StoreUnavailable
from trialledger.store.jobs import Claim, JobRefused, Jobs

log = logging.getLogger(__name__)
T = TypeVar("T")
LEASE_S = 60.0


@dataclass(frozen=True)
class TaskSelection:
    """The tasks a job runs, and a dataset's tasks skipped as unsupported (name → why)."""

    tasks: list[Task]
    skipped: dict[str, str] = field(default_factory=dict)
    datasets: dict[str, str] = field(default_factory=dict)  # task → its dataset folder's name
    #   (a skipped task's too)


def load_tasks(paths: Sequence[Path], include: Sequence[str] = (),
               exclude: Sequence[str] = (), *, max_bytes: int = TASK_FILE_MAX_BYTES,
               in_range: bool = True) -> TaskSelection:
    """Task folders, or dataset folders whose subfolders are tasks; filtered by globs on the
    task name (a folder's base name); two tasks of one name are refused. A dataset's task
    that asks for a field this runner refuses (`UnsupportedField`, docs/SPEC.md §15), has
    no `tests/test.sh` (`NoVerifier`), a file over `max_bytes` (`TaskFileTooLarge`, the
    `task_file_max_bytes` setting), a task.toml value of the wrong type (`WrongType`) or
    a separate verifier outside range mode (`in_range` False, docs/SPEC.md §17) is skipped
    with the reason; a task folder named alone is refused."""
    folders: list[tuple[Path, bool]] = []  # (folder, inside a dataset)
    datasets: dict[str, str] = {}  # a dataset's task → the dataset's name (else `adhoc`)
    for path in paths:
        if is_task_folder(path):
            folders.append((path, False))
        elif path.is_dir():
            inside = sorted(p for p in path.iterdir() if is_task_folder(p))
            if not inside:
                raise TaskInvalid(f"{path}: neither a task (no instruction.md) nor a dataset "
                                  f"(no subfolder with one)")
            folders.extend((folder, True) for folder in inside)
            datasets.update({folder.resolve().name: path.resolve().name for folder in inside})
        else:
            raise TaskInvalid(f"{path}: no such task or dataset folder")
    chosen: dict[str, Task] = {}
    skipped: dict[str, str] = {}
    for folder, in_dataset in folders:
        name = folder.resolve().name
        if include and not any(fnmatch.fnmatchcase(name, glob) for glob in include):
            continue
        if any(fnmatch.fnmatchcase(name, glob) for glob in exclude):
            continue
        if name in chosen:
            raise TaskInvalid(f"two tasks are named {name} ({chosen[name].folder} and "
                              f"{folder.resolve()}); a job's task names must be unique")
        try:
            chosen[name] = refuse_outside_range(require_verifier(
                Task.load(folder, max_bytes=max_bytes)), in_range=in_range)
        except (UnsupportedField, NoVerifier, TaskFileTooLarge, WrongType,
                StepInvalid) as error:
            if not in_dataset:
                raise
            skipped[name] = str(error)
    if not chosen:
        why = f"; skipped: {'; '.join(skipped.values())}" if skipped else ""
        raise TaskInvalid(f"no task left to run (check the paths and --include/--exclude)"
                          f"{why}")
    return TaskSelection([chosen[name] for name in sorted(chosen)], skipped,
                         {name: datasets[name] for name in [*chosen, *skipped]
                          if name in datasets})


def grant_fingerprint(grant: Mapping[str, Any]) -> dict[str, Any]:
    """What a job stores of a grant: its name, kind, required flag and a hash of the rest
    (url and headers) — never the headers themselves."""
    rest = json.dumps({k: grant.get(k) for k in ("url", "headers")}, sort_keys=True)
    return {"name": grant.get("name"), "kind": grant.get("kind"),
            "required": bool(grant.get("required")),
            "fingerprint": hashlib.sha256(rest.encode()).hexdigest()[:16]}


def job_config(options: RunOptions, k: int, max_attempts: int) -> dict[str, Any]:
    """The configuration a job is created with and resumed under (no secrets, no paths,
    no endpoint URL: those may change between machines and resumes)."""
    return {"agent": options.agent, "model": options.model,
            "settings": dict(options.overrides),
            "grants": [grant_fingerprint(g) for g in options.grants],
            "k": k, "max_attempts": max_attempts}


def check_inputs(tasks: Sequence[Task], options: RunOptions) -> None:
    """What a session would refuse at its seed, asked before anything is written (a job
    row, a session): each task's settings under the caller's (core's `Settings`), the
    policy they name, the grants and, for Codex, its binary. `SeedRejected`,
    `UnknownPolicy` or `CodexNotFound`, each one line saying what to change."""
    if options.agent not in SCRIPTED:
        find_codex(options.codex_bin)
    for task in tasks:
        settings = {"policy": "v3", **task.settings, **options.overrides}
        if settings.get("workdir") is None:  # the image's, known once it is prepared
            settings["workdir"] = "/app"
        seed = validate_seed({
            "trial_id": "-", "attempt": 1, "runner_id": options.runner_id, "task": task.name,
            "instruction": task.instruction, "agent": {"name": options.agent, "version": "-"},
            "model": options.model or None, "settings": settings, "grants": list(options.grants)})
        get_policy(seed.data.settings.policy or "v3")


@dataclass
class TrialDone:
    """What a finished trial reports to the progress display."""

    trial_id: str
    task: str
    k_index: int
    outcome: str  # the final session's outcome (pending when none ran)
    sessions: list[str]
    reward: float | None = None  # its one reward (`job_trials.reward`: None for several)
    wall_s: float | None = None  # its sessions' wall time of work (SPEC §13)
    rewards: dict[str, float] | None = None  # every name, `reward` first; None: unscored


@dataclass
class JobRunner:
    """Works one job's queue on this machine: `concurrency` trials at a time."""

    ledger: Ledger
    name: str
    tasks: Sequence[Task]
    options: RunOptions
    k: int = 1
    add: bool = False  # a resume may add tasks the job does not have yet (SPEC §13 --add)
    datasets: Mapping[str, str] = field(default_factory=dict)  # task → dataset (else adhoc)
    skipped: Mapping[str, str] = field(default_factory=dict)  # a dataset's invalid tasks → why
    concurrency: int = 1
    lease_s: float = LEASE_S
    cache: Cache = field(default_factory=Cache)
    engine: str | None = None
    pull: bool = False  # a docker_image missing from local storage is pulled (§15)
    force_build: bool = False  # a docker_image task is built from its Dockerfile (§15)
    owner: int | None = None  # the sandbox uid entries are made for (root runner)
    on_trial: Callable[[TrialDone], Awaitable[None] | None] | None = None
    prices: Mapping[str, Price] | None = None  # the job's price table (§18; None: keep its own)
    environments: dict[str, Environment] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # task → why its environment failed
    # task → what its environment's build waits on now: the live display holds this very
    # dict (changed in place, never replaced; SPEC §16)
    waits: dict[str, BuildWait] = field(default_factory=dict)
    _stopping: anyio.Event = field(default_factory=anyio.Event)
    _preparing: bool = field(default=True, init=False)  # until every environment is tried
    _own: bool = field(default=True, init=False)  # the job's own `job run`, not a worker
    _changed: anyio.Event = field(default_factory=anyio.Event, init=False)  # a task is ready
    # since when the store has failed held trials with none settled (anyio's clock), and
    # the pause before the next claim: the job stops past the runner's `store_retry_s`
    _store_failing: float | None = field(default=None, init=False)
    _store_pause: float = field(default=0.25, init=False)
    # the session image store's images of every environment prepared, held until the run
    # ends so that `cache prune` keeps them for trials not started yet (SPEC §16)
    _held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, init=False)

    def __post_init__(self) -> None:
        self.jobs = Jobs(self.ledger)
        self.by_name = {task.name: task for task in self.tasks}
        self.max_attempts = max(1, self.options.max_attempts)

    def stop_claiming(self) -> None:
        """Finish the trials running now, start no other (the first SIGINT/SIGTERM)."""
        self._stopping.set()
        self._wake()

    def _wake(self) -> None:
        """Tell the waiting workers something changed (a task is ready, preparing ended, or
        a held trial ended: settled, or released to be run again)."""
        self._changed.set()
        self._changed = anyio.Event()

    async def run(self, *, define: bool = True) -> None:
        """Create or resume the job (`define`; a worker joins one as it is), prepare each
        task's environment once while working the queue of the tasks ready so far, until
        no trial is left queued or held. (Its figures are the store's to read: `job run`
        reads its summary once, after.)"""
        self._own = define  # the job's own run: only it marks tasks unrunnable (§12)
        if define:
            await self.jobs.define(self.name,
                                   job_config(self.options, self.k, self.max_attempts),
                                   [(t.name, str(t.folder)) for t in self.tasks],
                                   add=self.add, datasets=self.datasets,
                                   skipped=self.skipped,
                                   ignored={t.name: t.unhonoured(self.cache.plain)
                                            for t in self.tasks},
                                   prices=self.prices,
                                   strategies={t.name: t.reward_strategy
                                               for t in self.tasks if t.steps})
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.prepare_environments)
                for _ in range(max(1, self.concurrency)):
                    tg.start_soon(self._work)
        except BaseExceptionGroup as group:  # the store's error alone: its one line
            if group.split(StoreUnavailable)[1] is not None:
                raise
            raise first_of(group, StoreUnavailable) from None
        finally:
            self._held.close()  # (a view's unmount: milliseconds)

    async def prepare_environments(self) -> None:
        """Every task's environment, `concurrency` at a time (builds of different images
        run at once, §12); a task's trials are claimable as soon as its own is ready."""
        limiter = anyio.CapacityLimiter(max(1, self.concurrency))
        try:
            async with anyio.create_task_group() as tg:
                for task in self.tasks:
                    tg.start_soon(self._prepare, task, limiter)
        finally:
            self._preparing = False
            self._wake()

    async def _prepare(self, task: Task, limiter: anyio.CapacityLimiter) -> None:
        """One task's environment, before any of its trials is claimed; a task whose
        environment fails is `environment_failed` (with the reason), an oracle job's task
        without `solution/solve.sh` is `no_solution` (SPEC §15), and none of it runs."""
        async with limiter:
            if self._stopping.is_set():
                return
            if self.options.agent == "oracle":
                try:
                    solve_script(task)
                except NoSolution as error:
                    self.failed[task.name] = str(error)
                    await self.jobs.no_solution(self.name, task.name, str(error))
                    return

            def heard(state: BuildState, step: tuple[int, int] | None,
                      name: str = task.name) -> None:  # from the preparing thread
                self.waits[name] = BuildWait(state, step)

            def ready() -> Environment:  # held until the job's run ends
                return prepared_and_held(functools.partial(
                    prepare_task, task, self.cache, owner=self.owner, engine=self.engine,
                    pull=self.pull, force_build=self.force_build, progress=heard), self._held)

            try:
                env = await anyio.to_thread.run_sync(ready)
            except EnvironmentUnavailable as error:
                if not self._own:  # another machine may prepare it: its trials stay queued
                    log.warning("task %s: its environment cannot be prepared on this worker "
                                "(%s); its trials stay queued", task.name, error)
                    return
                self.failed[task.name] = str(error)
                await self.jobs.environment_failed(self.name, task.name, str(error))
                return
            finally:
                self.waits.pop(task.name, None)
        await self.jobs.requeue_environment(self.name, [task.name])
        self.environments[task.name] = env
        self._wake()

    async def _work(self) -> None:
        """Claim and run trials of the tasks ready so far; when none is claimable but some
        are held by others (their holder may die: its lease then expires and the trial is
        taken over) or environments are still being prepared, wait."""
        while not self._stopping.is_set():
            changed, preparing = self._changed, self._preparing
            ready = sorted(self.environments)
            claim = await self.riding_out(functools.partial(
                self.jobs.claim, self.name, self.options.runner_id, self.lease_s, tasks=ready))
            if claim is not None:
                failed = await self._hold(claim)
                if failed is not None:
                    await self._store_failed(failed)
            elif preparing or await self.riding_out(functools.partial(
                    self.jobs.held, self.name, tasks=ready)) > 0:
                with anyio.move_on_after(min(5.0, self.lease_s / 3)):
                    await changed.wait()
            else:
                return

    async def riding_out(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, retried with backoff while the store is unavailable, for up to the
        runner's `store_retry_s` (then `StoreUnavailable`: the job run stops, one line)."""
        deadline, pause = anyio.current_time() + self.options.store_retry_s, 0.25
        while True:
            try:
                return await call()
            except StoreUnavailable:
                if anyio.current_time() + pause > deadline:
                    raise
                await anyio.sleep(pause)
                pause = min(pause * 2, 5.0)

    async def _store_failed(self, error: StoreUnavailable) -> None:
        """A held trial was stopped because the store failed it (`_hold`): go on after a
        pause (0.25 s, doubling up to 5 s) — unless the store has failed every trial since
        longer than the runner's `store_retry_s`, with none settled: then `error` is raised
        and the job run stops, one line (a store that answers claims but fails every run
        would otherwise claim, stop and release the same trial for ever)."""
        now = anyio.current_time()
        if self._store_failing is None:
            self._store_failing = now
        elif now - self._store_failing > self.options.store_retry_s:
            raise error
        await anyio.sleep(self._store_pause)
        self._store_pause = min(self._store_pause * 2, 5.0)

    async def _hold(self, claim: Claim) -> StoreUnavailable | None:
        """Run a claimed trial under its lease (`Trial.hold`), then settle it `done`. A
        trial whose lease ended first (not renewed in time, or taken over) is left to its
        next holder: released if the store takes the release, else its lease expires —
        never settled `done`. So is a trial the store failed, in its run or its settling
        (its next holder finds it decided, or runs it again): that failure is returned."""
        lease = Lease(self.jobs, claim, self.lease_s)
        settled = False
        try:
            ran = await Trial(self.ledger, claim.trial_id, lease=lease).hold(
                functools.partial(self._runner, claim.task))
            if ran is None:
                return lease.store_failed
            try:
                done = await self._done(claim, ran)
                settled = await self.jobs.settle(claim, "done", detail=ran.error)
            except StoreUnavailable as error:
                log.warning("trial %s (%s): the store failed its settling (%s); left to "
                            "its next holder", claim.trial_id, claim.task, error)
                return error
            if settled:
                self._store_failing, self._store_pause = None, 0.25
            if settled and self.on_trial is not None:
                said = self.on_trial(done)
                if said is not None:
                    await said
            return None
        finally:
            await lease.end(settled=settled)
            self._wake()  # a worker waiting on this held trial looks again (none: it ends)

    def _runner(self, task: str, switch: DeadManSwitch) -> SessionRunner:
        """The session runner of a held trial of `task`: its sandboxes keep the lease's
        deadline (`switch`)."""
        options = dataclasses.replace(self.options, max_attempts=self.max_attempts,
                                      switch=switch, lease_s=self.lease_s)
        return SessionRunner(self.ledger, self.by_name[task], options, self.environments[task])

    async def _done(self, claim: Claim, ran: TrialRun) -> TrialDone:
        """What the progress display shows of a trial that ended: its final outcome, its
        rewards and wall time of work as `job show --trials` reads them from the store (the
        same row: the two never disagree); none of either when an error ended it."""
        ids = [s["session_id"] for s in ran.sessions]
        if ran.error is not None:
            outcome = (ran.sessions[-1]["outcome"] if ran.sessions else None) or "error"
            return TrialDone(claim.trial_id, claim.task, claim.k_index, outcome, ids)
        outcome = ran.sessions[-1]["outcome"] if ran.sessions else "pending"
        row = await self.jobs.trial(claim.trial_id) or {}
        wall_s = row.get("wall_s")
        return TrialDone(claim.trial_id, claim.task, claim.k_index, outcome, ids,
                         row.get("reward"), None if wall_s is None else float(wall_s),
                         row.get("rewards"))


async def worker_runner(ledger: Ledger, name: str, base: RunOptions, *,
                        agent: str | None = None, **kwargs: Any) -> JobRunner:
    """A runner joining job `name` as it was created: its agent (a worker's own `agent`, when
    it names one, must be the job's), model, settings, grants (whose fingerprints must match
    the worker's own `--grants`) and attempts from the store, the endpoint and secrets from
    the worker, its tasks from the folders the job recorded."""
    jobs = Jobs(ledger)
    config = await jobs.config(name)
    if agent is not None and agent != config["agent"]:
        raise JobRefused(f"job {name} runs the {config['agent']} agent, not --agent {agent}")
    if config["agent"] == "codex" and not base.model_base_url:
        raise JobRefused(f"job {name} runs Codex: the worker needs --model-base-url")
    mine = [grant_fingerprint(g) for g in base.grants]
    if mine != config["grants"]:
        raise JobRefused(f"job {name} was created with other grants than this worker's "
                         f"--grants (names, kinds, urls or headers differ)")
    options = dataclasses.replace(base, agent=config["agent"], model=config["model"],
                                  overrides=config["settings"],
                                  max_attempts=int(config["max_attempts"]))
    tasks = []
    max_bytes = file_limit(config["settings"])  # the job's, as its tasks were loaded
    for task, folder in await jobs.task_folders(name):
        if not is_task_folder(Path(folder)):
            raise TaskInvalid(f"job {name}: task {task}'s folder {folder} is not on this "
                              f"machine (run the worker where the task folders are)")
        # under the name the job recorded (a job created before names were folder names)
        tasks.append(dataclasses.replace(Task.load(Path(folder), max_bytes=max_bytes),
                                         name=task))
    return JobRunner(ledger, name, tasks, options, k=int(config["k"]), **kwargs)


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """The unbiased pass@k estimator 1 − C(n−c, k)/C(n, k) (None when n < k)."""
    return None if n < k else pass_at_k_for_task(n, c, k)


__all__ = ["JobRefused", "JobRunner", "TaskSelection", "TrialDone", "check_inputs", "job_config",
           "load_tasks", "pass_at_k"]
