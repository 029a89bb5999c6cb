"""The sandbox's reports to the runner (exit, cleanup, probe, verifier) and its refusal.

`LocalSandbox` is the one sandbox. The runner uses more of it than a small protocol
would say (its agent-file reader, network, image, user and paths besides launch, cleanup,
probe and verify), so no protocol pretends otherwise: a second sandbox would take its
interface from what `runner.py` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    """The sandbox's word that every agent process is gone (under harbor: its own process
    group; `survivors` names what it detached that still runs)."""

    confirmed: bool
    error: str | None = None
    survivors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeResult:
    """Whether the sandbox still runs commands."""

    alive: bool
    detail: str


@dataclass(frozen=True)
class CommandRun:
    """A command's end in the sandbox: its exit code (None: it timed out), the end of its
    output (stdout and stderr as they came) and how many earlier bytes were not kept."""

    code: int | None
    output: bytes
    left_out: int = 0


@dataclass(frozen=True)
class VerifierRun:
    """The verifier's exit and its output folder (`error`: why it could not run)."""

    return_code: int | None
    timed_out: bool
    logs: Path
    error: str | None = None
    stdout: str = ""  # the end of what the verifier printed (at most a few KiB each)
    stderr: str = ""
