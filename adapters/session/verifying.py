"""After a session's agent (docs/SPEC.md §1, §15, §17): the probe of a `failed-live`
sandbox, the archive of Codex's rollouts, the collection pass (collect hooks, then the
task's artifacts), and the verifier — in the agent's sandbox, or (a separate verifier) in a
container of its own once the agent's is stopped — with its files kept. A part of
`SessionRunner` (adapters/session/runner.py), as `ContainerPhases` is of the sandbox.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from trialledger.adapters.images.environment import Environment
from trialledger.adapters.sandbox.agentfiles import UnsafeAgentFile
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.bwrap import VERIFIER_STDOUT
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.session import artifacts, capture, separateverifier
from trialledger.adapters.session.recorder import Recorder
from trialledger.adapters.session.sessions import RunOptions
from trialledger.adapters.tasks import artifacts as taskartifacts
from trialledger.adapters.tasks import collect as taskcollect
from trialledger.adapters.tasks.config import MAIN_SERVICE
from trialledger.adapters.tasks.steps import Step
from trialledger.adapters.tasks.task import Task
from trialledger.core import redact
from trialledger.core.events import SCHEMA_VERSION
from trialledger.core.settings import Settings
from trialledger.store.writer import now

PROBE_LIMIT_S = 10.0


class AfterTheAgent:
    """The phases after the agent (a part of `SessionRunner`)."""

    # Set by SessionRunner's construction
    task: Task
    options: RunOptions
    environment: Environment
    step: Step | None  # the step of a multi-step task its sessions run (None: not one)

    async def _collect(self, rec: Recorder, sandbox: LocalSandbox, settings: Settings,
                       secrets: Sequence[str], hooks: Sequence[taskcollect.CollectHook],
                       modes: dict[str, int]) -> list[dict[str, Any]]:
        """Harbor's collection pass (docs/SPEC.md §17): `main`'s hooks in order, then the
        task's artifacts, then each compose service's hooks (in its container, as its
        user, with its environment) and artifacts (read from its layers, as its user); the
        `files` entries of all, for the verifier; the artifacts' permission bits into
        `modes`."""
        env = {**sandbox.base_env(), **phase_env(sandbox)}
        mine = [hook for hook in hooks if hook.service == MAIN_SERVICE]
        outputs = await taskcollect.run_hooks(rec, mine, sandbox, settings, secrets, env)
        outputs += await taskartifacts.keep(rec, [a for a in self.task.artifacts
                                                  if a.service == MAIN_SERVICE],
                                            sandbox, settings, secrets, modes)
        number = len(mine) + 1
        for name, box in sandbox.service_boxes():
            theirs = [hook for hook in hooks if hook.service == name]
            outputs += await taskcollect.run_hooks(rec, theirs, box, settings, secrets,
                                                   box.hook_env(), first=number)
            number += len(theirs)
            if entries := [a for a in self.task.artifacts if a.service == name]:
                outputs += await taskartifacts.keep(rec, entries, box, settings, secrets,
                                                    modes)
        return outputs

    async def _probe(self, rec: Recorder, sandbox: LocalSandbox, settings: Settings) -> None:
        result = await sandbox.probe(max(0.1, min(PROBE_LIMIT_S, rec.left())),
                                     command=self.options.probe_command)
        await rec.add("sandbox.probed", {"alive": result.alive, "detail": result.detail})

    async def _archive(self, rec: Recorder, sandbox: LocalSandbox, settings: Settings,
                       secrets: Sequence[str]) -> None:
        if settings.sandbox_logs_dir is None:
            return
        tree = sandbox.agent_files(sandbox.session_dir)
        if not (await anyio.to_thread.run_sync(capture.rollouts, tree, "rollout-*"))[0]:
            await rec.add("archive.skipped", {"reason": "no_source", "detail": None})
            return
        limit = rec.left() - 1.0
        if limit <= 0:
            await rec.add("archive.skipped", {"reason": "no_time", "detail": None})
            return
        target = Path(settings.sandbox_logs_dir) / rec.session_id
        try:
            target.mkdir(parents=True, exist_ok=True, mode=0o700)
            with anyio.fail_after(limit):
                result = await anyio.to_thread.run_sync(
                    copy_archive, tree, target, secrets, abandon_on_cancel=True)
        except TimeoutError:
            await rec.add("archive.skipped",
                          {"reason": "timeout", "detail": f"copy ran past {limit:.1f} s"})
            return
        except OSError as error:
            await rec.add("archive.skipped", {"reason": "error", "detail": str(error)})
            return
        await rec.append([{"type": "gap.recorded", "at": now(), "data": refused.gap()}
                          for refused in result.refused])
        await rec.add("archive.copied", {"files": result.files, "bytes": result.size})

    async def _verify_separately(self, rec: Recorder, sandbox: LocalSandbox,
                                 settings: Settings, secrets: Sequence[str],
                                 kept: Sequence[dict[str, Any]], modes: Mapping[str, int]
                                 ) -> None:
        """docs/SPEC.md §17: the agent's container stopped, then the verifier in a fresh
        container of its own with the declared artifacts copied in
        (adapters/session/separateverifier.py)."""
        separate = self.task.separate_verifier
        assert separate is not None and self.environment.verifier is not None
        with separateverifier.tests_kept_apart(sandbox) as tests:
            if self.step is None or self.step.index == len(self.task.steps):
                await separateverifier.stop_agent(sandbox)
            else:  # a step before the last: its container serves the next step, as Harbor
                with contextlib.suppress(OSError):  # keeps it, on its baseline network
                    await sandbox.use_baseline()
            make = functools.partial(separateverifier.verifier_sandbox, self.task,
                                     self.environment.verifier, runtime=self.options.runtime,
                                     switch=self.options.switch,
                                     sandbox_uid=self.options.sandbox_uid, tests=tests)
            with anyio.CancelScope(shield=True):  # (made is discarded, never dropped)
                try:
                    verifier = await anyio.to_thread.run_sync(make)
                except SandboxRefused as error:
                    await rec.append([_not_run(f"the verifier's container: {error}", kept)])
                    return
            try:
                folder = artifacts.session_folder(settings.sandbox_logs_dir, rec.session_id)
                await anyio.to_thread.run_sync(separateverifier.bring_artifacts, verifier,
                                               self.task.artifacts, folder, modes)
                env = {**phase_env(verifier),
                       **self.task.verifier_env}
                await self._verify(rec, verifier, settings, secrets, kept, env=env,
                                   bundled=separate.bundled)
            finally:
                with anyio.CancelScope(shield=True):
                    await verifier.close()
                    await anyio.to_thread.run_sync(verifier.discard)

    async def _verify(self, rec: Recorder, sandbox: LocalSandbox, settings: Settings,
                      secrets: Sequence[str], kept: Sequence[dict[str, Any]] = (), *,
                      env: Mapping[str, str] | None = None, bundled: bool = False) -> None:
        """The verifier and its capture; `kept`: the task's artifacts, listed first; `env`
        (default `verifier_env`); `bundled`: `/tests` is the image's own (§17)."""
        if sandbox.tests is None and not bundled:
            await rec.append([_not_run("the task has no tests/test.sh", kept)])
            return
        run = await sandbox.verify(settings.verifier_timeout_s,
                                   verifier_env(self.task, sandbox) if env is None else env)
        if run.error is not None:
            await rec.append([_not_run(run.error, kept)])
            return
        ended = anyio.current_time()
        tree = sandbox.agent_files(run.logs, role="verifier")
        found = await anyio.to_thread.run_sync(functools.partial(
            capture.read_reward, tree, run.return_code, run.timed_out,
            from_exit_code=self.task.reward_from_exit_code, limit=settings.task_file_max_bytes))
        printed = await anyio.to_thread.run_sync(_printed, tree)
        output = verifier_output(printed, "", secrets)
        files, gaps = await _keep_verifier_files(
            tree, artifacts.session_folder(settings.sandbox_logs_dir, rec.session_id), secrets,
            ended + settings.session_close_timeout_s - anyio.current_time())
        await rec.append(gaps + [  # only once its files are kept (SPEC §15)
            {"type": kind, "at": now(), "data": {**data, **output, "files": [*kept, *files]},
             "schema": SCHEMA_VERSION[kind]}
            if kind.startswith("verification.") else
            {"type": kind, "at": now(), "data": data} for kind, data in found])


def _not_run(detail: str, kept: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`verification.failed {reason: error}` of a verifier that could not run, listing the
    task's artifacts when any were kept (schema 3)."""
    data = {"reason": "error", "detail": detail}
    if not kept:
        return {"type": "verification.failed", "at": now(), "data": data}
    return {"type": "verification.failed", "at": now(), "data": {**data, "files": list(kept)},
            "schema": SCHEMA_VERSION["verification.failed"]}


def phase_env(sandbox: LocalSandbox) -> dict[str, str]:
    """docs/SPEC.md §15: the image's `Env` < the container's own (`[environment] env`, a
    separate verifier's `env`, §17; over a compose file's `main` environment), and `HOME`,
    unless one of those sets it, the image's (its `Env`'s, else its user's home)."""
    env = sandbox.image.phase_env() if sandbox.image is not None else {}
    return {**env, **sandbox.task_env}


def verifier_env(task: Task, sandbox: LocalSandbox) -> dict[str, str]:
    """The verifier's: `phase_env` < `[verifier] env`."""
    return {**phase_env(sandbox), **task.verifier_env}


async def _keep_verifier_files(tree: Any, folder: Path, secrets: Sequence[str],
                               budget_s: float) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]]]:
    """SPEC §15's verifier capture pass: the verifier's files copied into the session's
    artifact folder (`verifier/`) within `budget_s`; their `files` entries, and the gaps
    (`unsafe_agent_file` per refusal, `verifier_output_truncated` when some were left)."""
    def truncated(detail: str) -> dict[str, Any]:
        return {"type": "gap.recorded", "at": now(),
                "data": {"code": "verifier_output_truncated", "detail": detail}}

    budget_s = max(0.0, budget_s)
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with anyio.fail_after(budget_s + 1.0):  # the copy stops itself between files
            kept = await anyio.to_thread.run_sync(functools.partial(
                capture.keep_files, tree, folder, artifacts.VERIFIER, secrets,
                budget_s=budget_s), abandon_on_cancel=True)
    except TimeoutError:
        return [], [truncated(f"the copy ran past its budget of {budget_s:.1f} s")]
    except OSError as error:
        return [], [truncated(f"the copy into {folder} failed: {error}")]
    gaps = [{"type": "gap.recorded", "at": now(), "data": refused.gap()}
            for refused in kept.refused]
    if kept.left_out:
        why = (f"the capture budget of {budget_s:.1f} s ran out" if kept.out_of_time else
               f"each pass keeps at most {capture.MAX_KEPT_FILES} files and "
               f"{capture.MAX_KEPT_BYTES} bytes")
        gaps.append(truncated(f"{kept.left_out} file(s) not kept: {why}"))
    return kept.files, gaps


def _printed(tree: Any) -> str:
    """The end of what the verifier printed (`test-stdout.txt`, read safely)."""
    try:
        return bytes(tree.tail(VERIFIER_STDOUT, 8192)).decode("utf-8", errors="replace")
    except UnsafeAgentFile:
        return ""


def verifier_output(stdout: str, stderr: str, secrets: Sequence[str]) -> dict[str, str]:
    """Schema 2 of a verification event: the verifier's stdout and stderr tails, redacted
    as `agent.stderr` is (scrubbed, lines cut, the last 2,000 characters; empty ones left
    out)."""
    return {name: redact(text, secrets) for name, text in
            (("stdout_tail", stdout), ("stderr_tail", stderr)) if text.strip()}


def copy_archive(tree: Any, target: Path, secrets: Sequence[str]) -> capture.ArchiveResult:
    """The archive copy (a seam: tests slow it down to exercise the budget)."""
    return capture.copy_archive(tree, target, secrets)
