"""The session runner: drives the real Codex CLI in the local sandbox and records it live.

Order (SPEC §1): seed (skipped grants as gaps) → config.toml → launch → stdout events as
they arrive → stderr tail (redacted) → rollout usage → `agent.exited` →
`cleanup.reported` (the machine decides) → the probe when `failed-live` → the archive →
the task's collect hooks (adapters/tasks/collect.py), then its artifacts, kept unless the
sandbox is lost (adapters/tasks/artifacts.py) → the
verifier when `graded`, its files kept (SPEC §15) → `verification.*` →
`session.closed`. Capture (stderr, rollout, archive) runs in
the budget `session_close_timeout_s` from the agent's end; the archive last, under its own
timeout ending 1 s before the budget. Cancelling at any point keeps what was appended and
closes the session with reason `cancelled`. A `lost` session is retried as a new session.
The agent's phase, launch to cleanup report, is adapters/session/agentrun.py's; what comes
after it, adapters/session/verifying.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import os
import secrets as tokens
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from trialledger.adapters.codex.install import (
    CodexInstall,
    codex_install,
    codex_version,
    execute_only,
    find_codex,
)
from trialledger.adapters.images.environment import HOST, Environment, resolve_inside
from trialledger.adapters.jobs.trial import Trial
from trialledger.adapters.jobs.trial import next_attempt as next_attempt  # its old home
from trialledger.adapters.proxy.upstream import MODEL_ROUTES, Upstream
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.folders import sweep_stale_sessions
from trialledger.adapters.sandbox.identity import cache_dir
from trialledger.adapters.sandbox.leftovers import sweep_image_views, sweep_session_cgroups
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.session import artifacts, scripted, steprun
from trialledger.adapters.session.agentrun import TheAgent
from trialledger.adapters.session.journal import journal_dir
from trialledger.adapters.session.preflight import check_store_room
from trialledger.adapters.session.recorder import Recorder
from trialledger.adapters.session.sessions import OpenSandbox as OpenSandbox
from trialledger.adapters.session.sessions import RunOptions as RunOptions
from trialledger.adapters.session.sessions import SessionResult as SessionResult
from trialledger.adapters.session.verifying import phase_env
from trialledger.adapters.tasks.healthcheck import run_healthcheck
from trialledger.adapters.tasks.mcpservers import operator_allows
from trialledger.adapters.tasks.steps import Step
from trialledger.adapters.tasks.task import Task
from trialledger.core.events import StepInfo
from trialledger.core.seed import SkippedGrant, ValidSeed, validate_seed
from trialledger.core.settings import Settings
from trialledger.store import LeaseLost, Ledger
from trialledger.store.ledger import HEARTBEAT_S, StoreUnavailable
from trialledger.store.writer import Fence, now

_swept = False
_beating: dict[str, int] = {}  # runner id → this process's sessions running under it


def _sweep_once() -> None:
    """A runner removes the session folders crashed runners left (once per process)."""
    global _swept
    if not _swept:
        _swept = True
        sweep_session_cgroups()  # (first: a cgroup's owner is known by its folder)
        sweep_stale_sessions()
        sweep_image_views()  # (their sessions' holds went with the crashed runners)


def _call_max_s(raw: Mapping[str, Any]) -> float:
    """The proxy's deadline per model call (`model_call_max_s`, SPEC §14): a value that is
    no positive number refuses the seed before Codex starts, so the default serves then."""
    default: float = Settings.model_fields["model_call_max_s"].default
    value = raw.get("model_call_max_s", default)
    valid = (isinstance(value, int | float) and not isinstance(value, bool)
             and 0 < value < float("inf"))
    return float(value) if valid else default


class SessionRunner(TheAgent):
    """Runs one session of a task from seed to close."""

    def __init__(self, ledger: Ledger, task: Task, options: RunOptions,
                 environment: Environment = HOST) -> None:
        self.ledger, self.task, self.options = ledger, task, options
        self.environment = environment  # prepared before any session (prepare.prepare)
        if options.agent not in scripted.AGENTS:
            raise scripted.UnknownAgent(f"agent {options.agent!r}: expected one of "
                                        f"{', '.join(scripted.AGENTS)}")
        self.scripted = options.agent in scripted.SCRIPTED
        self.codex: str | None = None
        self.install: CodexInstall | None = None
        prepared = dict(environment.step_verifiers)
        unready = [separate for separate, image in (
            (task.separate_verifier, environment.verifier),
            *((separate, prepared.get(name)) for name, separate in task.step_verifiers))
            if separate is not None and (image is None or not environment.plain
                                         or options.isolation != "bwrap")]
        if unready:
            raise SandboxRefused(f"{task.folder / 'task.toml'}: {unready[0].named}: a separate "
                                 f"verifier needs range mode (a root runner after setup, "
                                 f"under bwrap) and its image prepared "
                                 f"(verifiermode.prepare_task)")
        if options.agent == "oracle":
            scripted.solve_script(task)  # NoSolution now, before any session is seeded
        elif not self.scripted:
            self.codex = find_codex(options.codex_bin)
            self.install = execute_only(codex_install(self.codex), cache_dir())  # non-dumpable
        if task.steps:
            steprun.refuse_here(task, environment, self._settings())
        self.step: Step | None = None  # the step this runner's sessions run (for_step)
        self._trial_key = uuid.uuid4().hex[:12]  # run_session's sessions share one trial
        self.last: SessionResult | None = None  # the session run last, with its view
        _sweep_once()

    def _seed(self, attempt: int, retry_of: str | None, sandbox: LocalSandbox,
              trial_id: str | None, step: StepInfo | None = None) -> ValidSeed:
        seed: dict[str, Any] = {
            "trial_id": trial_id or f"{self.task.name}:{self._trial_key}",
            "attempt": attempt,
            "retry_of": retry_of,
            "runner_id": self.options.runner_id,
            "task": self.task.name,
            "instruction": self.task.instruction,
            "agent": ({"name": "codex", "version": codex_version(self.codex)}
                      if self.codex is not None
                      else {"name": self.options.agent, "version": scripted.VERSION}),
            "model": None if self.scripted else self.options.model,
            # Our runner records every model call, so its sessions are decided under v3
            # (SPEC §14) unless the caller names another policy.
            "settings": {"policy": "v3", **self._settings()},
            "grants": [] if self.scripted else self._grants(),
            **({"step": step.model_dump()} if step is not None else {}),
        }
        root = self.environment.root
        resolve = ((lambda path: resolve_inside(root, path)) if root is not None
                   else os.path.realpath)
        valid = validate_seed(seed, private_roots=sandbox.private_roots,
                              resolve=resolve, api_key=self.options.api_key)
        refused = ({} if self.scripted else self.task.mcp_servers.refused(
            self.options.grants, self.options.task_mcp_hosts))
        return dataclasses.replace(valid, skipped=(
            *valid.skipped, *(SkippedGrant(name, why) for name, why in refused.items())))

    def _task_grants(self) -> list[dict[str, Any]]:
        """The task's HTTP MCP servers as optional grants: none an operator's grant names
        (the operator's wins), none at a host that is no public one unless the operator
        allows it (docs/SPEC.md §15)."""
        return self.task.mcp_servers.grants(self.options.grants, self.options.task_mcp_hosts)

    def _grants(self) -> list[Mapping[str, Any]]:
        """The operator's grants, then the task's (`_task_grants`)."""
        return [*self.options.grants, *self._task_grants()]

    def _grant_upstreams(self) -> list[Upstream]:
        """Where the sandbox's MCP forwarders lead: an operator's grant anywhere, a task's
        server only to public addresses unless the operator allowed its host."""
        return [*(Upstream(str(g["url"])) for g in self.options.grants
                  if g.get("kind") == "mcp" and g.get("url")),
                *(Upstream(str(g["url"]), public_only=not operator_allows(
                    str(g["url"]), self.options.task_mcp_hosts))
                  for g in self._task_grants())]

    def _settings(self) -> dict[str, Any]:
        """The task's settings under the caller's, with the workdir made explicit: an
        explicit one wins, else the image's WorkingDir (or /), else /app on the host."""
        raw = {**self.task.settings, **self.options.overrides}
        if raw.get("workdir") is None:
            raw["workdir"] = self.environment.workdir if self.environment.root else "/app"
        if raw.get("verifier_isolation") is None:  # docs/SPEC.md §15: image and rootfs
            # sessions live in one container, as Harbor's do (a pristine verifier asked
            # for needs a sandbox of its own)
            harbor = self.environment.root is not None and raw.get("verifier_root") != "pristine"
            raw["verifier_isolation"] = "harbor" if harbor else "strict"
        return raw

    async def run_trial(self) -> list[SessionResult]:
        """Run the task as a new trial (`Trial.fresh`, adapters/jobs/trial.py: `lost` sessions
        retried as new attempts up to `max_attempts`); the sessions it ran."""
        return (await Trial.fresh(self.ledger, self.task.name).run(self)).ran

    async def run_session(self, *, attempt: int = 1, retry_of: str | None = None,
                          trial_id: str | None = None, lease: str | None = None
                          ) -> SessionResult:
        """One session: seed, run, capture, decide, probe, archive, verify, close — with a
        heartbeat in the store all along, so `recover` leaves it alone. `trial_id`: the
        trial it belongs to (a job's), else this runner's current trial; `lease`: that
        job trial's lease token, which fences every append (`LeaseLost` once taken over:
        the new holder recovers the session)."""
        async with self._alive():
            return await self._run_session(
                attempt=attempt, retry_of=retry_of, trial_id=trial_id,
                fence=(trial_id, lease) if trial_id is not None and lease is not None else None)

    async def run_steps(self, *, attempt: int = 1, retry_of: str | None = None,
                        trial_id: str | None = None, lease: str | None = None
                        ) -> list[SessionResult]:
        """One attempt of a multi-step task: each step a session, all in one sandbox, until
        one cannot go on (adapters/session/steprun.py); the step sessions it ran."""
        async with self._alive():
            ran: list[SessionResult] = await steprun.run_attempt(
                self, attempt=attempt, retry_of=retry_of, trial_id=trial_id, lease=lease)
            return ran

    def for_step(self, step: Step) -> SessionRunner:
        """This runner as it runs one step's session: the task as the step sees it."""
        one = copy.copy(self)
        one.task, one.step = steprun.step_task(self.task, step), step
        one.environment = self.environment.for_step(step.name)
        return one

    @contextlib.asynccontextmanager
    async def _alive(self) -> AsyncIterator[None]:
        """A heartbeat in the store while sessions run, so `recover` leaves them alone."""
        check_store_room(self.ledger.db)  # before anything is written or started
        beating = asyncio.ensure_future(self._heartbeat())
        _beating[self.options.runner_id] = _beating.get(self.options.runner_id, 0) + 1
        try:
            yield
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            await self._last_beat()

    async def _last_beat(self) -> None:
        """When this process's last session under the runner's id ends, clear its
        heartbeat: a runner that stops cleanly is not alive (`recover --runner ID` need not
        wait for the heartbeat to age). Shielded and bounded: a cancelled run clears too."""
        runner_id = self.options.runner_id
        _beating[runner_id] -= 1
        if _beating[runner_id] > 0:  # a job's other trials still run under it
            return
        del _beating[runner_id]
        with anyio.CancelScope(shield=True), anyio.move_on_after(5), \
                contextlib.suppress(StoreUnavailable):
            await self.ledger.clear_heartbeat(runner_id)

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(StoreUnavailable):  # a blink: the next beat
                await self.ledger.heartbeat(self.options.runner_id)
            await asyncio.sleep(HEARTBEAT_S)

    async def _run_session(self, *, attempt: int, retry_of: str | None,
                           trial_id: str | None, fence: Fence | None) -> SessionResult:
        session_id = str(uuid.uuid4())
        opened = await self.open_sandbox(session_id)
        try:
            return await self.session_in(opened, session_id, attempt=attempt,
                                          retry_of=retry_of, trial_id=trial_id, fence=fence)
        finally:
            await opened.close()

    async def open_sandbox(self, key: str) -> OpenSandbox:
        """The sandbox (and its network) a session runs in — for a multi-step task, every
        step session of one attempt (adapters/session/steprun.py)."""
        settings_raw = self._settings()
        token = f"tl-session-{tokens.token_urlsafe(24)}"  # Codex's key: the proxy's alone
        network = Network(  # an oracle or nop session: no proxy (its own namespace still)
            None if self.scripted else Upstream(
                self.options.model_base_url, token=token,
                authorization=(f"Bearer {self.options.api_key}"
                               if self.options.api_key else None),
                routes=MODEL_ROUTES, call_max_s=_call_max_s(settings_raw)),
            [] if self.scripted else self._grant_upstreams(),
            # An image's sandbox has a network of its own: private, or (public) connected
            # outward by slirp4netns (docs/SPEC.md §15); a host task's public is the host's.
            isolated=(not self.task.allow_internet or self.environment.root is not None),
            outward=self.task.allow_internet)  # (an allowlist's: the sandbox's own)
        make = functools.partial(
            LocalSandbox,
            session_key=key,
            workdir=str(settings_raw["workdir"]),
            workspace=self.task.workspace,
            tests=self.task.tests,
            codex=self.install,
            readonly_paths=self.options.readonly_paths,
            protected_paths=[self.task.folder, *self.options.protected_paths, journal_dir()],
            isolation=self.options.isolation,
            runtime=self.options.runtime,
            no_new_privileges=self.task.no_new_privileges,
            raise_oom_score_adj=bool(settings_raw.get("raise_oom_score_adj", False)),
            verifier_root=str(settings_raw.get("verifier_root", "agent")),
            sandbox_uid=self.options.sandbox_uid,
            network=network,
            environment=self.environment,
            limits=self.task.limits,
            users=self.task.users,
            switch=self.options.switch,
            lifetime=str(settings_raw["verifier_isolation"]),
            task_env=self.task.env,
            allowed_hosts=self.task.allowed_hosts,
            compose=self.task.compose,
            network_modes=({"healthcheck": modes["environment"], "agent": modes["agent"],
                            "verifier": modes["verifier"]}
                           if (modes := self.task.network_modes) else None),
            # (a step's verifier mode only where its verifier runs in this container)
            later_modes=[mode for step in self.task.steps for phase, mode in
                         step.network_modes.items()
                         if phase == "agent" or step.separate_verifier is None],
        )
        # Made (and below discarded) in a worker thread: its bwrap check, folders and
        # cgroups block for tens of milliseconds, which the trials beside it would wait out.
        # Shielded, so a sandbox made is always discarded, never dropped by a cancellation.
        with anyio.CancelScope(shield=True):
            sandbox = await anyio.to_thread.run_sync(make)
        return OpenSandbox(sandbox, network, token)

    async def session_in(self, opened: OpenSandbox, session_id: str | None = None, *,
                         attempt: int,
                          retry_of: str | None, trial_id: str | None, fence: Fence | None,
                          step: StepInfo | None = None,
                          prepare: Callable[[Recorder, LocalSandbox, Settings],
                                            Awaitable[None]] | None = None,
                          before_close: Callable[[Recorder], Awaitable[None]] | None = None
                          ) -> SessionResult:
        """One session seeded, driven and closed in an open sandbox; `step`: the step of a
        multi-step task it runs, `prepare` run after its seed (the step's workdir, setup.sh
        and healthcheck; it closes the session when the step cannot run), `before_close`
        before its `session.closed` (the step's gate)."""
        sandbox = opened.sandbox
        session_id = session_id or str(uuid.uuid4())
        valid = self._seed(attempt, retry_of, sandbox, trial_id, step)
        seeded = await self.ledger.start(valid, session_id=session_id,
                                         secrets=[opened.token, *self.task.secrets], fence=fence)
        recorder = Recorder(self.ledger, seeded,
                            store_retry_s=self.options.store_retry_s, fence=fence)
        sandbox.egress_sink = _egress_gaps(recorder)
        try:
            if prepare is not None:  # (it closes the session when its step cannot run)
                await prepare(recorder, sandbox, valid.data.settings)
            if not recorder.closed:
                await self._drive(recorder, sandbox, valid, seeded.secrets, before_close)
        finally:
            if not recorder.closed:
                # A lost lease: the trial's new holder recovers this session. A held
                # trial's close waits for the store at most a third of its lease, then
                # is journalled, so its session folders go within its lease.
                with anyio.CancelScope(shield=True), anyio.move_on_after(
                        self._close_wait_s()), contextlib.suppress(LeaseLost):
                    await recorder.add("session.closed", {"reason": "cancelled"})
        self.last = SessionResult(session_id, await recorder.view())
        return self.last

    def _close_wait_s(self) -> float:
        """How long a stopped session's `session.closed` waits for the store: the runner's
        `store_retry_s`, or for a job trial at most a third of its lease."""
        lease_s = self.options.lease_s
        return self.options.store_retry_s if lease_s is None else min(
            self.options.store_retry_s, lease_s / 3)

    async def _drive(self, rec: Recorder, sandbox: LocalSandbox, valid: ValidSeed,
                     secrets: Sequence[str],
                     before_close: Callable[[Recorder], Awaitable[None]] | None = None
                     ) -> None:
        settings = valid.data.settings
        # The oracle's solution goes into the session's layer before anything mounts it
        # (a healthcheck starts an image's container).
        try:
            oracle = (await self._oracle_launch(sandbox) if self.options.agent == "oracle"
                      else None)
        except OSError as error:  # a later step's container: it ended, or refused the copy
            await self._not_launched(rec, sandbox, f"the solution could not be copied in: "
                                                   f"{error}")
            return

        if self.task.healthcheck is not None and not await self._healthcheck(rec, sandbox):
            return  # the sandbox is lost and the session closed
        if self.options.agent == "nop":
            await self._run_nothing(rec, sandbox, settings)
        elif not await self._launch_and_run(rec, sandbox, valid, secrets, oracle):
            return  # nothing could be spawned: the session is closed
        if rec.action == "probe":
            await self._probe(rec, sandbox, settings)
        await self._archive(rec, sandbox, settings, secrets)
        modes: dict[str, int] = {}  # the artifacts' permission bits (a separate verifier's)
        kept = await self._collect(rec, sandbox, settings, secrets, self.task.collect, modes)
        if oracle is not None and oracle.oracle is not None:  # its output, kept (SPEC §15)
            folder = artifacts.session_folder(settings.sandbox_logs_dir, rec.session_id)
            entry = await anyio.to_thread.run_sync(functools.partial(
                scripted.keep_oracle_log, sandbox, oracle.oracle, folder, secrets))
            kept = [*([entry] if entry is not None else []), *kept]
        if rec.action == "verify" and self.task.separate_verifier is not None:
            await self._verify_separately(rec, sandbox, settings, secrets, kept, modes)
        elif rec.action == "verify":
            await self._verify(rec, sandbox, settings, secrets, kept)
        if before_close is not None:
            await before_close(rec)
        await rec.add("session.closed", {"reason": "normal"})

    async def _healthcheck(self, rec: Recorder, sandbox: LocalSandbox) -> bool:
        """The task's healthcheck before the agent (docs/SPEC.md §15): as the image's user,
        `bash -c` (`sh` without bash) in the workdir with the image's `Env`, `HOME` and
        `[environment] env`. False when it failed: `sandbox.lost` (R1), the session closed."""
        check = self.task.healthcheck
        assert check is not None
        image = sandbox.image
        shell = "bash" if image is None or image.has("bash") else "sh"
        env = {**sandbox.base_env(), **phase_env(sandbox)}

        async def attempt(timeout_s: float) -> tuple[int | None, str]:
            try:
                return await sandbox.run_check([shell, "-c", check.command], timeout_s, env=env)
            except OSError as error:  # the container could not be started
                return 127, str(error)

        failure = await run_healthcheck(check, attempt)
        if failure is None:
            return True
        await rec.add("sandbox.lost", {"detail": failure})
        await rec.add("session.closed", {"reason": "normal"})
        return False

EGRESS_GAPS = 20  # refused connections listed one by one (docs/SPEC.md §15)


def _egress_gaps(rec: Recorder) -> Callable[[str], Awaitable[None]]:
    """What an allowlist's egress proxy calls with each refused host or address: gap
    `egress_refused`, the first `EGRESS_GAPS` of a session one by one, then one that says
    more were refused."""
    refused = 0

    async def record(detail: str) -> None:
        nonlocal refused
        refused += 1
        if rec.closed or refused > EGRESS_GAPS + 1:
            return
        if refused > EGRESS_GAPS:
            detail = f"more connections were refused; the first {EGRESS_GAPS} are listed"
        await rec.capture([{"type": "gap.recorded", "at": now(),
                            "data": {"code": "egress_refused", "detail": detail}}])

    return record
