"""What a session runner (adapters/session/runner.py) is given and gives back, and what the trial's
loop and a multi-step attempt ask of it — apart from the runner, which runs its sessions
through both (adapters/jobs/trial.py, adapters/session/steprun.py), so neither imports it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio

from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.session.recorder import STORE_RETRY_S, Recorder
from trialledger.adapters.tasks.steps import Step
from trialledger.adapters.tasks.task import Task
from trialledger.core import SessionView
from trialledger.core.events import SessionSeeded, StepInfo
from trialledger.core.settings import Settings
from trialledger.store.writer import Fence


@dataclass(frozen=True)
class RunOptions:
    """How to run sessions: the agent, the model endpoint, grants, settings and the runner."""

    model_base_url: str = ""  # the model endpoint and model: Codex's only (SPEC §15)
    model: str = ""
    api_key: str | None = None
    grants: Sequence[Mapping[str, Any]] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)
    codex_bin: str | None = None
    max_attempts: int = 1
    runner_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    readonly_paths: Sequence[Path] = ()  # granted read-only (never the store, task, home)
    isolation: str = "bwrap"  # or "process-group": unconfined, only when asked for
    runtime: str | None = None  # what starts a range-mode container: bwrap or runc (§16)
    sandbox_uid: int | None = None  # when root: the agent's uid (default trialledger-sandbox)
    protected_paths: Sequence[Path] = ()  # never mounted (the store's file, say)
    grace_s: float = 5.0
    probe_command: Sequence[str] | None = None  # None: our init's own probe
    store_retry_s: float = STORE_RETRY_S  # appends retry this long through a store's blink
    agent: str = "codex"  # or oracle / nop (SPEC §15): no model, no proxy, no grants
    switch: DeadManSwitch | None = None  # a job trial's lease, kept by the sandbox too
    lease_s: float | None = None  # a job trial's lease: a stopped session's close waits at
    # most a third of it for the store (then journalled; the next holder recovers it)
    task_mcp_hosts: Sequence[str] = ()  # hosts a task's MCP servers may be at though not
    # public (`--task-mcp-host`, docs/SPEC.md §15); an operator's grants are trusted anyway


@dataclass(frozen=True)
class OpenSandbox:
    """A sandbox made for sessions, its network and the proxy's token for Codex."""

    sandbox: LocalSandbox
    network: Network
    token: str

    async def close(self) -> None:
        """Its network and sandbox closed and discarded (shielded: never left behind)."""
        with anyio.CancelScope(shield=True):
            await self.network.aclose()
            await self.sandbox.close()
            await anyio.to_thread.run_sync(self.sandbox.discard)


@dataclass(frozen=True)
class SessionResult:
    """One session of a trial and how it ended."""

    session_id: str
    view: SessionView

    @property
    def attempt(self) -> int:
        """The attempt number, as the session's seed records it."""
        seed = self.view.events[0]
        assert isinstance(seed, SessionSeeded)  # a view's first event is its seed
        return seed.data.attempt

    @property
    def outcome(self) -> str:
        """retry, verify, unverified, interrupted or pending."""
        return self.view.outcome

    @property
    def close_reason(self) -> str | None:
        """Its `session.closed` reason; None while it is open."""
        return self.view.close_reason


class Sessions(Protocol):
    """What a trial's loop asks of its runner (adapters/jobs/trial.py): the task, the options,
    and one attempt — a session, or a multi-step task's step sessions."""

    @property
    def task(self) -> Task: ...

    @property
    def options(self) -> RunOptions: ...

    async def run_session(self, *, attempt: int = 1, retry_of: str | None = None,
                          trial_id: str | None = None, lease: str | None = None
                          ) -> SessionResult: ...

    async def run_steps(self, *, attempt: int = 1, retry_of: str | None = None,
                        trial_id: str | None = None, lease: str | None = None
                        ) -> list[SessionResult]: ...


class StepSessions(Protocol):
    """What a multi-step attempt asks of its runner (adapters/session/steprun.py): one sandbox for
    the attempt, the runner as a step sees it, and a session in an open sandbox."""

    task: Task
    last: SessionResult | None

    async def open_sandbox(self, key: str) -> OpenSandbox: ...

    def for_step(self, step: Step) -> StepSessions: ...

    async def session_in(self, opened: OpenSandbox, session_id: str | None = None, *,
                         attempt: int, retry_of: str | None, trial_id: str | None,
                         fence: Fence | None, step: StepInfo | None = None,
                         prepare: Callable[[Recorder, LocalSandbox, Settings],
                                           Awaitable[None]] | None = None,
                         before_close: Callable[[Recorder], Awaitable[None]] | None = None
                         ) -> SessionResult: ...
