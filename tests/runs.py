"""Helpers for tests that run the real Codex CLI: task folders, wrappers and one-call runs."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.install import install_paths
from trialledger.adapters.demo import samples
from trialledger.adapters.demo.endpoint import Reply, ScriptedEndpoint, shell
from trialledger.adapters.images.environment import HOST, Environment
from trialledger.adapters.session.runner import RunOptions, SessionResult, SessionRunner
from trialledger.adapters.tasks.task import Task
from trialledger.store import Ledger

REPO = Path(__file__).resolve().parent.parent


def read_shell(cmd: str) -> Reply:
    """An `exec_command` call whose output the test reads: Codex waits up to 30 s for the
    command to end (its own default, 10 s, is outlasted by a container's first call on a
    loaded machine, and the call then returns nothing)."""
    return shell(cmd, yield_ms=30_000)


def codex_path() -> str:
    """The pinned Codex CLI: TRIALLEDGER_CODEX_BIN, else the repo's `.codex-cli` install."""
    found = os.environ.get("TRIALLEDGER_CODEX_BIN") or str(
        REPO / ".codex-cli" / "node_modules" / ".bin" / "codex")
    if not os.access(found, os.X_OK):
        raise RuntimeError(f"no Codex CLI at {found}: npm install --prefix .codex-cli "
                           "@openai/codex@0.171.0 (bash .ci/run does)")
    return found


def in_process(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`trialledger ARGV` run in this process (no interpreter start-up, no re-import):
    its exit code and what it printed, shaped like a finished subprocess."""
    from trialledger.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or Path.cwd()), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stopped:  # argparse's refusals and --help
            code = stopped.code if isinstance(stopped.code, int) else 0 if stopped.code is None \
                else 2
    return subprocess.CompletedProcess(["trialledger", *argv], code, out.getvalue(),
                                       err.getvalue())


def on_a_terminal(argv: Sequence[str], *, columns: int, deadline_s: float = 120) -> str:
    """What the command `argv` shows on a pseudo-terminal `columns` wide, read until it
    closes (within `deadline_s`), once the command has exited 0."""
    import pty
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=follower,
                            env={**os.environ, "TERM": "xterm", "COLUMNS": str(columns)})
    os.close(follower)
    shown = b""
    deadline = time.monotonic() + deadline_s
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command is over
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
    text = shown.decode(errors="replace")
    assert proc.wait(timeout=30) == 0, text[-2000:]
    return text


def make_task(folder: Path, *, instruction: str = "say hi", test_sh: str | None = None,
              toml: str | None = None, workspace: dict[str, str] | None = None,
              exit_code_reward: bool = True, solve_sh: str | None = None) -> Task:
    """Write a task folder (instruction.md, task.toml, workspace/, tests/test.sh, and
    `solve_sh` as solution/solve.sh, the oracle's) and load it; its verifier's exit code is
    its reward unless `exit_code_reward` is False."""
    if solve_sh is not None:
        samples.executable(folder / "solution" / "solve.sh", solve_sh)
    return samples.write_task(folder, instruction=instruction, test_sh=test_sh, toml=toml,
                              workspace=workspace, exit_code_reward=exit_code_reward)


def killer(folder: Path, trigger: str) -> Path:
    """A `--codex-bin` wrapper that SIGKILLs the pinned Codex once stdout shows `trigger`."""
    return samples.killer(folder, codex_path(), trigger)


@dataclass
class Ran:
    """A finished run: its session and what the endpoint saw."""

    result: SessionResult
    endpoint: ScriptedEndpoint

    @property
    def view(self) -> Any:
        return self.result.view


def _options(endpoint: ScriptedEndpoint, settings: dict[str, Any] | None,
             codex_bin: str | None, extra_paths: Sequence[Path], **options: Any) -> RunOptions:
    return RunOptions(
        model_base_url=endpoint.url, model="test-model", codex_bin=codex_bin or codex_path(),
        overrides=settings or {},
        # a wrapper script runs the npm codex, so it needs the install tree granted too
        readonly_paths=[*extra_paths, *(install_paths(codex_path()) if codex_bin else [])],
        **options)


async def run_task(db: str, task: Task, script: Sequence[Reply], *,
                   settings: dict[str, Any] | None = None, codex_bin: str | None = None,
                   extra_paths: Sequence[Path] = (), environment: Environment = HOST,
                   **options: Any) -> Ran:
    """Run one session of a task (in its prepared environment) against a scripted endpoint."""
    with ScriptedEndpoint(list(script)) as endpoint:
        async with await Ledger.open(db) as ledger:
            opts = _options(endpoint, settings, codex_bin, extra_paths, **options)
            runner = SessionRunner(ledger, task, opts, environment)
            return Ran(await runner.run_session(), endpoint)


async def run_trial(db: str, task: Task, script: Sequence[Reply], *,
                    settings: dict[str, Any] | None = None, **options: Any
                    ) -> list[SessionResult]:
    """Run a task as a trial (lost sessions retried) against a scripted endpoint."""
    with ScriptedEndpoint(list(script)) as endpoint:
        async with await Ledger.open(db) as ledger:
            opts = _options(endpoint, settings, None, (), **options)
            return await SessionRunner(ledger, task, opts).run_trial()
