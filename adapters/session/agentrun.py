"""The agent's phase of a session (a part of `SessionRunner`, adapters/session/runner.py):
what it is launched with — Codex with its proxy and config.toml, the oracle's `solve.sh`,
nop's nothing — its `agent.launched`, its stdout events as they arrive, its end, its
stderr tail (redacted) and native usage, and its cleanup report (SPEC §1, §11, §15).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from trialledger.adapters.codex.config import API_KEY_ENV, codex_config, render
from trialledger.adapters.codex.stream import stream_events
from trialledger.adapters.sandbox.container import survivors_gap
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.session import capture, scripted
from trialledger.adapters.session.journal import journal_record
from trialledger.adapters.session.recorder import Recorder
from trialledger.adapters.session.verifying import AfterTheAgent
from trialledger.adapters.tasks.task import Task
from trialledger.core import redact, scrub
from trialledger.core.events import SCHEMA_VERSION
from trialledger.core.seed import ValidSeed
from trialledger.core.settings import Settings
from trialledger.store.ledger import StoreUnavailable
from trialledger.store.writer import now

CLEANUP_LIMIT_S = 10.0
# How long a launch that failed under harbor waits for the container to be seen ending
# (then the container's end is the recorded reason)
CONTAINER_END_WAIT_S = 1.0


@dataclass(frozen=True)
class Launch:
    """What the agent's process is started with, and what `agent.launched` says of it."""

    argv: list[str]
    env: dict[str, str]
    stdin: bytes
    config_sha256: str
    model_proxy: bool
    oracle: scripted.OraclePlaces | None = None  # where the oracle's files are



def agent_env(settings: Settings, task: Task, sandbox: LocalSandbox, api_key: str | None
              ) -> dict[str, str]:
    """docs/SPEC.md §5: the allowlist (or the sandbox's base environment: over an image,
    the image's Env and its user's HOME), then the harness's own."""
    env = sandbox.base_env()  # PATH (the image's over an image), LANG, LC_ALL
    env["HOME"] = str(sandbox.session_dir)
    if settings.inherit_sandbox_environment:
        if (image := sandbox.image) is not None:
            env.update(image.phase_env())
        env.update(sandbox.task_env)  # the variables the task declares (its [environment]
        # env over a compose file's `main` environment); never the harness's own
    if (helpers := sandbox.codex_path_dir) is not None:
        env["PATH"] = f"{env.get('PATH', '/usr/bin:/bin')}:{helpers}"
    env["CODEX_HOME"] = str(sandbox.session_dir)
    env[API_KEY_ENV] = api_key or "unused"
    return env


class TheAgent(AfterTheAgent):
    """The agent's phase (a part of `SessionRunner`)."""

    async def _launch_and_run(self, rec: Recorder, sandbox: LocalSandbox, valid: ValidSeed,
                              secrets: Sequence[str], oracle: Launch | None = None) -> bool:
        """Launch Codex or the oracle's `solve.sh` (`oracle`, placed already), record it to
        its end and cleanup; False when it could not be spawned (the session is then lost
        and closed)."""
        settings = valid.data.settings
        launch = oracle or await self._codex_launch(rec, sandbox, valid)
        try:
            run = await sandbox.launch(launch.argv, env=launch.env, stdin=launch.stdin)
        except OSError as error:  # (joining a container that just ended, too)
            await self._not_launched(rec, sandbox, f"the agent could not be spawned: {error}")
            return False
        try:
            await rec.append([self._launched(sandbox, settings, launch, rec)])
            await self._run_and_capture(rec, sandbox, run, settings, secrets, launch.oracle)
        finally:
            with anyio.CancelScope(shield=True):
                await run.stop(0.5)
                await run.aclose()
                if not rec.captured:  # stopped (a signal): capture anyway, in the budget
                    await self._capture_after_stop(rec, sandbox, run, settings, secrets,
                                                   launch.oracle)
        return True

    @staticmethod
    async def _not_launched(rec: Recorder, sandbox: LocalSandbox, detail: str) -> None:
        """The agent could not be launched: the sandbox is lost (why the container ended,
        if it did, else `detail`) and the session closed."""
        why = await sandbox.container_ended(CONTAINER_END_WAIT_S)
        await rec.add("sandbox.lost", {"detail": why or detail})
        await rec.add("session.closed", {"reason": "normal"})

    def _launched(self, sandbox: LocalSandbox, settings: Settings, launch: Launch,
                  rec: Recorder) -> dict[str, Any]:
        """The `agent.launched` event of a launch."""
        return {"type": "agent.launched", "at": now(),
                "schema": SCHEMA_VERSION["agent.launched"], "data": {
                    "argv": launch.argv, "workdir": settings.workdir,
                    "env_keys": sorted(launch.env), "config_sha256": launch.config_sha256,
                    "oom_score_adj": sandbox.oom_score_adj,
                    "isolation": sandbox.launched_isolation,
                    "runner_id": self.options.runner_id,
                    "environment": self.environment.record(),
                    "limits": sandbox.limits_record(), "model_proxy": launch.model_proxy,
                    "identity": sandbox.identity_record(),
                    "journal": journal_record(rec.session_id)}}

    async def _run_nothing(self, rec: Recorder, sandbox: LocalSandbox,
                           settings: Settings) -> None:
        """The nop agent (SPEC §15): launched, exited 0, nothing left to clean up."""
        await rec.append([self._launched(sandbox, settings, Launch(
            argv=[], env={}, stdin=b"", config_sha256=scripted.NO_CONFIG, model_proxy=False),
            rec)])
        rec.capture_deadline = anyio.current_time() + settings.session_close_timeout_s
        rec.captured = True
        await rec.add("agent.exited", {"return_code": 0, "timed_out": False})
        await rec.add("cleanup.reported", {"confirmed": True, "error": None})

    async def _oracle_launch(self, sandbox: LocalSandbox) -> Launch:
        """The oracle (SPEC §15): `solve.sh` copied in and run as Harbor runs it."""
        places = await scripted.place_solution(self.task, sandbox, self.step)
        return Launch(argv=scripted.oracle_argv(places, sandbox),
                       env=scripted.oracle_env(self.task, sandbox), stdin=b"",
                       config_sha256=scripted.NO_CONFIG, model_proxy=False, oracle=places)

    async def _codex_launch(self, rec: Recorder, sandbox: LocalSandbox, valid: ValidSeed
                            ) -> Launch:
        """Codex: its proxy opened, its config.toml written, the prompt on stdin."""
        settings = valid.data.settings
        network = sandbox.network
        assert network is not None

        async def record_call(at: str, data: dict[str, Any]) -> None:
            await rec.capture([{"type": "model.call", "at": at, "data": data,
                                "schema": SCHEMA_VERSION["model.call"]}])

        network.model_sink = record_call
        if not network.isolated:
            await network.open_on_host()
        text, digest = render(codex_config(model=self.options.model,
                                           base_url=self.options.model_base_url,
                                           settings=settings, grants=valid.grants,
                                           reach=network.inside_url,
                                           stdio=self.task.mcp_servers.stdio(
                                               self.options.grants)))
        config = sandbox.session_dir / "config.toml"
        config.write_text(text, encoding="utf-8")
        os.chown(config, *sandbox.agent_owner)
        argv = [sandbox.codex_argv0, "exec", "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "-C", sandbox.agent_workdir, "-"]
        env = agent_env(settings, self.task, sandbox, network.model_token)
        return Launch(argv=argv, env=env, stdin=self.task.instruction.encode(),
                       config_sha256=digest, model_proxy=True)

    async def _run_and_capture(self, rec: Recorder, sandbox: LocalSandbox, run: LocalRun,
                               settings: Settings, secrets: Sequence[str],
                               oracle: scripted.OraclePlaces | None = None) -> None:
        done_reading = anyio.Event()

        async def pump() -> None:
            async for lines in run.stdout_batches():
                at = now()
                await rec.capture([e for line in lines for e in stream_events(line, at)])
            done_reading.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run.read_stderr)
            tg.start_soon(pump)
            with anyio.move_on_after(settings.timeout_s) as limit:
                await run.process.wait()
            timed_out = limit.cancelled_caught
            if timed_out:
                await run.stop(self.options.grace_s)
            status = await run.wait()
            rec.capture_deadline = anyio.current_time() + settings.session_close_timeout_s
            with anyio.move_on_after(rec.left()):
                await done_reading.wait()
            tg.cancel_scope.cancel()
        if sandbox.network is not None:  # open calls end client_closed, before agent.exited
            with anyio.CancelScope(shield=True):
                await sandbox.network.aclose()
        rec.captured = True
        await rec.capture(await self._agent_output(rec, sandbox, run, secrets, oracle))
        if not status.spawned:  # the launch failed inside the sandbox: nothing ran (the
            # container's end, when that is why)
            why = await sandbox.container_ended(CONTAINER_END_WAIT_S)
            await rec.add("sandbox.lost", {"detail": why or status.detail})
            return
        if (why := sandbox.container_lost()) is not None:  # as Docker's container stops
            await rec.add("sandbox.lost", {"detail": why})
            return
        await rec.add("agent.exited", {"return_code": status.return_code, "timed_out": timed_out})
        report = await sandbox.confirm_cleanup(run, max(0.1, min(CLEANUP_LIMIT_S, rec.left())))
        survived = survivors_gap(report.survivors)
        lost = await sandbox.network_lost()
        await rec.append([
            *([{"type": "gap.recorded", "at": now(), "data": survived}] if survived else []),
            *([{"type": "gap.recorded", "at": now(),
                "data": {"code": "network_lost", "detail": lost}}] if lost else []),
            *({"type": "gap.recorded", "at": now(), "data": gap}
              for gap in sandbox.services_exited()),
            {"type": "cleanup.reported", "at": now(),
             "data": {"confirmed": report.confirmed, "error": report.error}}])


    async def _capture_after_stop(self, rec: Recorder, sandbox: LocalSandbox, run: LocalRun,
                                  settings: Settings, secrets: Sequence[str],
                                  oracle: scripted.OraclePlaces | None = None) -> None:
        """What a stopped run still gives: its model calls, stderr tail and native usage,
        within the capture budget; a store that is gone by then loses only these."""
        rec.captured = True
        rec.capture_deadline = anyio.current_time() + settings.session_close_timeout_s
        with anyio.move_on_after(rec.left()), contextlib.suppress(StoreUnavailable):
            if sandbox.network is not None:
                await sandbox.network.aclose()
            await rec.capture(await self._agent_output(rec, sandbox, run, secrets, oracle))

    async def _agent_output(self, rec: Recorder, sandbox: LocalSandbox, run: LocalRun,
                            secrets: Sequence[str], oracle: scripted.OraclePlaces | None
                            ) -> list[dict[str, Any]]:
        """Codex's stderr tail and native usage; for the oracle, oracle.txt's tail as
        `agent.stderr` (SPEC §15), or its shell's own stderr when oracle.txt is unreadable
        (an unsafe one is also a gap)."""
        if oracle is None:
            return self._stderr_event(run, secrets) + await self._usage_events(rec, sandbox)
        tail, cut, refused = await anyio.to_thread.run_sync(scripted.oracle_output, sandbox,
                                                             oracle)
        if refused is None:
            return self._tail_event(tail, cut, secrets)
        gaps = ([] if refused.rule == "missing" else
                [{"type": "gap.recorded", "at": now(), "data": refused.gap()}])
        return gaps + self._stderr_event(run, secrets)

    @classmethod
    def _stderr_event(cls, run: LocalRun, secrets: Sequence[str]) -> list[dict[str, Any]]:
        return cls._tail_event(*run.stderr_tail(), secrets)

    @staticmethod
    def _tail_event(tail: str, cut: bool, secrets: Sequence[str]) -> list[dict[str, Any]]:
        """`agent.stderr` of an output's end (none when it is empty)."""
        if not tail:
            return []
        redacted = redact(tail, secrets)
        truncated = cut or redacted != scrub(tail, secrets)
        return [{"type": "agent.stderr", "at": now(),
                 "data": {"tail": redacted, "truncated": truncated}}]

    async def _usage_events(self, rec: Recorder, sandbox: LocalSandbox
                            ) -> list[dict[str, Any]]:
        tree = sandbox.agent_files(sandbox.session_dir)
        with anyio.move_on_after(rec.left()) as scope:
            return await anyio.to_thread.run_sync(
                lambda: capture.usage_events(tree, at=now()), abandon_on_cancel=True)
        if scope.cancelled_caught:
            return [{"type": "gap.recorded", "at": now(), "data": {
                "code": "native_usage_unread", "detail": "the capture budget ran out"}}]
        return []
