"""What the runner needs of a sandbox, so docker or remote sandboxes can plug in later."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trialledger.core.errors import TrialLedgerError

SUPERVISOR_ENV = "TRIALLEDGER_SUPERVISOR"


class SandboxRefused(TrialLedgerError):
    """The sandbox cannot run this session as configured (the message says why)."""


@dataclass(frozen=True)
class ExitStatus:
    """How the agent ended: its code (−N when killed by signal N; None when unknown)."""

    return_code: int | None
    detail: str = ""
    spawned: bool = True  # False: the agent never started (a lost launch)


@dataclass(frozen=True)
class CleanupReport:
    """The sandbox's word that every agent process is gone."""

    confirmed: bool
    error: str | None = None


@dataclass(frozen=True)
class ProbeResult:
    """Whether the sandbox still runs commands."""

    alive: bool
    detail: str


@dataclass(frozen=True)
class VerifierRun:
    """The verifier's exit and its output folder (`error`: why it could not run)."""

    return_code: int | None
    timed_out: bool
    logs: Path
    error: str | None = None
    stdout: str = ""  # the end of what the verifier printed (at most a few KiB each)
    stderr: str = ""


class AgentRun(Protocol):
    """A launched agent."""

    def stdout_batches(self) -> AsyncIterator[list[bytes]]:
        """Raw stdout lines, a list per read (the last one may lack its newline)."""
        ...

    async def read_stderr(self) -> None:
        """Collect stderr until it closes."""
        ...

    def stderr_tail(self) -> tuple[str, bool]:
        """The collected stderr's end and whether anything was cut."""
        ...

    async def wait(self) -> ExitStatus:
        """Wait for the agent to end."""
        ...

    async def stop(self, grace_s: float) -> None:
        """TERM the agent, then KILL it after `grace_s`."""
        ...


class Sandbox(Protocol):
    """A place to run one session's agent, probe it, and verify its work."""

    isolation: str
    session_dir: Path  # Codex's HOME / CODEX_HOME on the host
    private_roots: Sequence[str]

    async def launch(self, argv: Sequence[str], *, env: Mapping[str, str], stdin: bytes
                     ) -> AgentRun:
        """Start the agent."""
        ...

    async def confirm_cleanup(self, run: AgentRun, timeout_s: float) -> CleanupReport:
        """Wait (bounded) until every process of the run is gone."""
        ...

    async def probe(self, timeout_s: float, command: Sequence[str] | None = None
                    ) -> ProbeResult:
        """Whether a process (our init, by default) runs in a fresh sandbox in the workdir
        within the limit."""
        ...

    async def verify(self, timeout_s: float) -> VerifierRun:
        """Run the task's verifier (`tests/test.sh`) in the workdir."""
        ...

    def discard(self) -> None:
        """Remove the session's folders."""
        ...
