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
from trialledger.adapters.demo.endpoint import Reply, ScriptedEndpoint
from trialledger.adapters.environment import HOST, Environment
from trialledger.adapters.runner import RunOptions, SessionResult, SessionRunner
from trialledger.adapters.task import Task
from trialledger.store import Ledger

REPO = Path(__file__).resolve().parent.parent


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
