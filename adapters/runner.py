"""The session runner: drives the real Codex CLI in the local sandbox and records it live.

Order (SPEC §1): seed (skipped grants as gaps) → config.toml → launch → stdout events as
they arrive → stderr tail (redacted) → rollout usage → `agent.exited` →
`cleanup.reported` (the machine decides) → the probe when `failed-live` → the archive →
the verifier when `graded` → `session.closed`. Capture (stderr, rollout, archive) runs in
the budget `session_close_timeout_s` from the agent's end; the archive last, under its own
timeout ending 1 s before the budget. Cancelling at any point keeps what was appended and
closes the session with reason `cancelled`. A `lost` session is retried as a new session.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from trialledger.adapters.codex.config import API_KEY_ENV, codex_config, render
from trialledger.adapters.codex.rollout import rollout_files, usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.adapters.sandbox.base import VerifierRun
from trialledger.adapters.sandbox.local import LocalRun, LocalSandbox
from trialledger.adapters.task import Task
from trialledger.core import SessionView, redact, scrub, validate_seed
from trialledger.core.seed import ValidSeed
from trialledger.core.settings import Settings
from trialledger.store import Ledger, StoredEvent
from trialledger.store.writer import now

DEFAULT_ARCHIVE_COMMAND = ("cp", "-R", "--")
PROBE_LIMIT_S = 10.0
CLEANUP_LIMIT_S = 10.0


class CodexNotFound(Exception):
    """No Codex CLI to run (the message says how to install it)."""


def find_codex(explicit: str | None = None) -> str:
    """`--codex-bin`, else `TRIALLEDGER_CODEX_BIN`, else `codex` on PATH."""
    candidate = explicit or os.environ.get("TRIALLEDGER_CODEX_BIN") or shutil.which("codex")
    if not candidate or not os.access(candidate, os.X_OK):
        raise CodexNotFound(
            "no Codex CLI found: pass --codex-bin, set TRIALLEDGER_CODEX_BIN, or put codex on "
            "PATH (npm install @openai/codex@0.171.0)")
    return os.path.abspath(candidate)


def codex_version(codex: str) -> str:
    """The version `codex --version` prints (`codex-cli 0.171.0` → `0.171.0`)."""
    try:
        done = subprocess.run([codex, "--version"], capture_output=True, text=True,
                              check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    words = done.stdout.split()
    return words[-1] if done.returncode == 0 and words else "unknown"


def install_paths(codex: str) -> list[Path]:
    """What the sandbox must mount read-only for Codex to run: its install tree."""
    real = Path(os.path.realpath(codex))
    for parent in real.parents:
        if parent.name == "node_modules":
            return [parent]
    return [real.parent]


@dataclass(frozen=True)
class RunOptions:
    """How to run sessions: the model endpoint, grants, settings and the runner."""

    model_base_url: str
    model: str
    api_key: str | None = None
    grants: Sequence[Mapping[str, Any]] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)
    codex_bin: str | None = None
    max_attempts: int = 1
    runner_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    readonly_paths: Sequence[Path] = ()
    use_bwrap: bool | None = None
    grace_s: float = 5.0
    archive_command: Sequence[str] = DEFAULT_ARCHIVE_COMMAND
    probe_command: Sequence[str] = ("true",)


@dataclass(frozen=True)
class SessionResult:
    """One session of a trial and how it ended."""

    session_id: str
    view: SessionView

    @property
    def attempt(self) -> int:
        """The attempt number, as the session's seed records it."""
        return int(self.view.events[0].data.attempt)  # type: ignore[union-attr]

    @property
    def outcome(self) -> str:
        """retry, verify, unverified, interrupted or pending."""
        return self.view.outcome


class _Recorder:
    """Appends one session's events in order, tracking its head and last decision."""

    def __init__(self, ledger: Ledger, session_id: str, head: int) -> None:
        self.ledger, self.session_id, self.head = ledger, session_id, head
        self.action: str | None = None
        self.closed = False

    async def append(self, events: Sequence[Mapping[str, Any]]) -> list[StoredEvent]:
        if not events:
            return []
        stored = await self.ledger.append(self.session_id, events, expected_seq=self.head)
        self.head = stored[-1].event.seq or self.head
        for item in stored:
            if item.event.type == "outcome.decided":
                self.action = item.event.data.action  # type: ignore[union-attr]
            elif item.event.type == "session.closed":
                self.closed = True
        return stored

    async def add(self, kind: str, data: Mapping[str, Any]) -> list[StoredEvent]:
        return await self.append([{"type": kind, "at": now(), "data": dict(data)}])


def agent_env(settings: Settings, task: Task, sandbox: LocalSandbox, api_key: str | None
              ) -> dict[str, str]:
    """SPEC §5: the allowlist (or the sandbox's base environment), then the harness's own."""
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
    env["HOME"] = str(sandbox.session_dir)
    if settings.inherit_sandbox_environment:
        env.update(task.env)  # the variables the task declares; never the harness's own
    env["CODEX_HOME"] = str(sandbox.session_dir)
    env[API_KEY_ENV] = api_key or "unused"
    return env


class SessionRunner:
    """Runs one session of a task from seed to close."""

    def __init__(self, ledger: Ledger, task: Task, options: RunOptions) -> None:
        self.ledger, self.task, self.options = ledger, task, options
        self.codex = find_codex(options.codex_bin)

    def _seed(self, attempt: int, retry_of: str | None, sandbox: LocalSandbox) -> ValidSeed:
        seed = {
            "trial_id": f"{self.task.name}:{self._trial_key}",
            "attempt": attempt,
            "retry_of": retry_of,
            "runner_id": self.options.runner_id,
            "task": self.task.name,
            "instruction": self.task.instruction,
            "agent": {"name": "codex", "version": codex_version(self.codex)},
            "model": self.options.model,
            "settings": {**self.task.settings, **self.options.overrides},
            "grants": list(self.options.grants),
        }
        return validate_seed(seed, private_roots=sandbox.private_roots,
                             resolve=os.path.realpath, api_key=self.options.api_key)

    _trial_key = ""

    async def run_trial(self) -> list[SessionResult]:
        """Run the task, retrying `lost` sessions as new attempts up to `max_attempts`."""
        self._trial_key = uuid.uuid4().hex[:12]
        results: list[SessionResult] = []
        retry_of = None
        for attempt in range(1, max(1, self.options.max_attempts) + 1):
            result = await self.run_session(attempt=attempt, retry_of=retry_of)
            results.append(result)
            if result.outcome != "retry":
                break
            retry_of = result.session_id
        return results

    async def run_session(self, *, attempt: int = 1, retry_of: str | None = None
                          ) -> SessionResult:
        """One session: seed, run, capture, decide, probe, archive, verify, close."""
        if not self._trial_key:
            self._trial_key = uuid.uuid4().hex[:12]
        session_id = str(uuid.uuid4())
        settings_raw = {**self.task.settings, **self.options.overrides}
        sandbox = LocalSandbox(
            session_key=session_id,
            workdir=str(settings_raw.get("workdir", "/app")),
            workspace=self.task.workspace,
            tests=self.task.tests,
            readonly_paths=[*install_paths(self.codex), *self.options.readonly_paths],
            use_bwrap=self.options.use_bwrap,
            raise_oom_score_adj=bool(settings_raw.get("raise_oom_score_adj", False)),
        )
        try:
            valid = self._seed(attempt, retry_of, sandbox)
            seeded = await self.ledger.start(valid, session_id=session_id)
            recorder = _Recorder(self.ledger, session_id, seeded.head_seq)
            try:
                await self._drive(recorder, sandbox, valid, seeded.secrets)
            finally:
                if not recorder.closed:
                    with anyio.CancelScope(shield=True):
                        await recorder.add("session.closed", {"reason": "cancelled"})
            return SessionResult(session_id, await self.ledger.view(session_id))
        finally:
            sandbox.discard()

    async def _drive(self, rec: _Recorder, sandbox: LocalSandbox, valid: ValidSeed,
                     secrets: Sequence[str]) -> None:
        settings = valid.data.settings
        text, digest = render(codex_config(model=self.options.model,
                                           base_url=self.options.model_base_url,
                                           settings=settings, grants=valid.grants))
        (sandbox.session_dir / "config.toml").write_text(text, encoding="utf-8")
        argv = [self.codex, "exec", "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "-C", sandbox.agent_workdir, "-"]
        env = agent_env(settings, self.task, sandbox, self.options.api_key)
        try:
            run = await sandbox.launch(argv, env=env, stdin=self.task.instruction.encode())
        except OSError as error:
            await rec.add("sandbox.lost", {"detail": f"the agent could not be spawned: {error}"})
            await rec.add("session.closed", {"reason": "normal"})
            return
        try:
            await rec.add("agent.launched", {
                "argv": argv, "workdir": settings.workdir, "env_keys": sorted(env),
                "config_sha256": digest, "oom_score_adj": sandbox.oom_score_adj,
                "isolation": sandbox.isolation, "runner_id": self.options.runner_id,
            })
            await self._run_and_capture(rec, sandbox, run, settings, secrets)
        finally:
            with anyio.CancelScope(shield=True):
                await run.stop(0.5)
                await run.aclose()
        if rec.action == "probe":
            await self._probe(rec, sandbox, settings)
        await self._archive(rec, sandbox, settings)
        if rec.action == "verify":
            await self._verify(rec, sandbox, settings)
        await rec.add("session.closed", {"reason": "normal"})

    async def _run_and_capture(self, rec: _Recorder, sandbox: LocalSandbox, run: LocalRun,
                               settings: Settings, secrets: Sequence[str]) -> None:
        done_reading = anyio.Event()

        async def pump() -> None:
            async for lines in run.stdout_batches():
                events = [e for line in lines
                          for e in parse_stream_line(line.decode("utf-8", errors="replace"))
                          .events(now())]
                await rec.append(events)
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
            self._capture_deadline = anyio.current_time() + settings.session_close_timeout_s
            with anyio.move_on_after(self._left()):
                await done_reading.wait()
            tg.cancel_scope.cancel()
        await rec.append(self._stderr_event(run, secrets) + await self._usage_events(sandbox))
        if not status.spawned:  # the launch failed inside the sandbox: nothing ran
            await rec.add("sandbox.lost", {"detail": status.detail})
            return
        await rec.add("agent.exited", {"return_code": status.return_code, "timed_out": timed_out})
        report = await sandbox.confirm_cleanup(run, max(0.1, min(CLEANUP_LIMIT_S, self._left())))
        await rec.add("cleanup.reported", {"confirmed": report.confirmed, "error": report.error})

    _capture_deadline = math.inf

    def _left(self) -> float:
        return max(0.0, self._capture_deadline - anyio.current_time())

    @staticmethod
    def _stderr_event(run: LocalRun, secrets: Sequence[str]) -> list[dict[str, Any]]:
        tail, cut = run.stderr_tail()
        if not tail:
            return []
        redacted = redact(tail, secrets)
        truncated = cut or redacted != scrub(tail, secrets)
        return [{"type": "agent.stderr", "at": now(),
                 "data": {"tail": redacted, "truncated": truncated}}]

    async def _usage_events(self, sandbox: LocalSandbox) -> list[dict[str, Any]]:
        def read() -> list[dict[str, Any]]:
            events: list[dict[str, Any]] = []
            for path in rollout_files(sandbox.session_dir):
                if path.suffix == ".jsonl":
                    with path.open(encoding="utf-8", errors="replace") as lines:  # streamed
                        events += usage_events(lines, at=now())
            return events

        with anyio.move_on_after(self._left()) as scope:
            return await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        if scope.cancelled_caught:
            return [{"type": "gap.recorded", "at": now(), "data": {
                "code": "native_usage_unread", "detail": "the capture budget ran out"}}]
        return []

    async def _probe(self, rec: _Recorder, sandbox: LocalSandbox, settings: Settings) -> None:
        result = await sandbox.probe(max(0.1, min(PROBE_LIMIT_S, self._left())),
                                     command=self.options.probe_command)
        await rec.add("sandbox.probed", {"alive": result.alive, "detail": result.detail})

    async def _archive(self, rec: _Recorder, sandbox: LocalSandbox, settings: Settings) -> None:
        if settings.sandbox_logs_dir is None:
            return
        sources = rollout_files(sandbox.session_dir)
        if not sources:
            await rec.add("archive.skipped", {"reason": "no_source", "detail": None})
            return
        limit = self._left() - 1.0
        if limit <= 0:
            await rec.add("archive.skipped", {"reason": "no_time", "detail": None})
            return
        target = Path(settings.sandbox_logs_dir) / rec.session_id
        target.mkdir(parents=True, exist_ok=True)
        command = [*self.options.archive_command, *map(str, sources), str(target)]
        try:
            code, timed_out = await _run_command(command, limit)
        except OSError as error:
            await rec.add("archive.skipped", {"reason": "error", "detail": str(error)})
            return
        if timed_out:
            await rec.add("archive.skipped",
                          {"reason": "timeout", "detail": f"copy ran past {limit:.1f} s"})
        elif code != 0:
            await rec.add("archive.skipped", {"reason": "error", "detail": f"copy exited {code}"})
        else:
            size = sum(p.stat().st_size for p in sources)
            await rec.add("archive.copied", {"files": len(sources), "bytes": size})

    async def _verify(self, rec: _Recorder, sandbox: LocalSandbox, settings: Settings) -> None:
        if sandbox.tests is None:
            await rec.add("verification.failed",
                          {"reason": "error", "detail": "the task has no tests/test.sh"})
            return
        run = await sandbox.verify(settings.verifier_timeout_s)
        kind, data = reward_of(run)
        await rec.add(kind, data)


def reward_of(run: VerifierRun) -> tuple[str, dict[str, Any]]:
    """`reward.json` ({name: number}) or `reward.txt` (one number), else the exit code."""
    if run.timed_out:
        return "verification.failed", {"reason": "timeout", "detail": "the verifier timed out"}
    as_json, as_text = run.logs / "reward.json", run.logs / "reward.txt"
    try:
        if as_json.is_file():
            rewards = json.loads(as_json.read_text(encoding="utf-8"))
            if not (isinstance(rewards, dict) and rewards and all(
                    isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                    for v in rewards.values())):
                raise ValueError("reward.json must be an object of finite numbers")
            return "verification.recorded", {"rewards": rewards, "detail": "reward.json"}
        if as_text.is_file():
            value = float(as_text.read_text(encoding="utf-8").strip())
            if not math.isfinite(value):
                raise ValueError("reward.txt is not a finite number")
            return "verification.recorded", {"rewards": {"reward": value}, "detail": "reward.txt"}
    except (ValueError, OSError) as error:
        return "verification.failed", {"reason": "bad_reward", "detail": str(error)}
    if run.return_code is None:
        return "verification.failed", {"reason": "no_reward",
                                       "detail": "the verifier ended without an exit code"}
    reward = 1.0 if run.return_code == 0 else 0.0
    return "verification.recorded", {"rewards": {"reward": reward},
                                     "detail": f"exit code {run.return_code}"}


async def _run_command(command: Sequence[str], limit: float) -> tuple[int | None, bool]:
    process = await anyio.open_process(command, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with anyio.move_on_after(limit):
        return await process.wait(), False
    process.kill()
    with anyio.CancelScope(shield=True):
        await process.wait()
    return None, True
