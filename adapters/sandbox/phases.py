"""The probe and the verifier (SPEC §11, §15): `PhaseRuns`, a part of `LocalSandbox`
(local.py) — the liveness probe, the verifier run as Harbor runs it (in the session's
container under harbor: container.py; else in a sandbox of its own once every agent
process is gone, over a fresh copy of the task's tests), each bounded by its timeout.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from trialledger.adapters.sandbox.base import ProbeResult, VerifierRun
from trialledger.adapters.sandbox.bwrap import (
    INIT_INSIDE,
    TESTS_INSIDE,
    VERIFIER_LOGS_INSIDE,
    VERIFIER_STDOUT,
    Role,
)
from trialledger.adapters.sandbox.container import CopyIn
from trialledger.adapters.sandbox.folders import remove_tree
from trialledger.adapters.sandbox.layout import chown_tree, clear_planted
from trialledger.adapters.sandbox.procscan import kill_marked
from trialledger.adapters.sandbox.spawning import Spawning


class PhaseRuns(Spawning):
    """The probe and the verifier (a part of `LocalSandbox`)."""

    if TYPE_CHECKING:  # LocalSandbox's: whether every process of the agent's run is gone
        async def _agent_gone(self) -> bool: ...

    async def probe(self, timeout_s: float, command: Sequence[str] | None = None
                    ) -> ProbeResult:
        """Alive when a process runs in a fresh sandbox in the workdir within the limit: by
        default our own init (`--probe`), so no program of the environment is needed."""
        if command is None:
            command = [INIT_INSIDE if self.isolation == "bwrap" else str(self.init), "--probe"]
            name = "the init probe"
        else:
            name = f"`{' '.join(command)}`"
        code, timed_out = await self._run_bounded(list(command), timeout_s,
                                                  env=self.base_env(), role="probe")
        if timed_out:
            return ProbeResult(False, f"{name} did not finish within {timeout_s:g} s")
        if code != 0:
            return ProbeResult(False, f"{name} exited with {code}")
        return ProbeResult(True, f"{name} ran in the workdir")

    def base_env(self) -> dict[str, str]:
        """The probe's and verifier's environment: PATH (the image's, over an image), LANG
        and LC_ALL."""
        env = _minimal_env()
        if self.image is not None:
            env["PATH"] = self.image.path
        return env

    async def verify(self, timeout_s: float, env: Mapping[str, str] | None = None
                     ) -> VerifierRun:
        """Run the tests as Harbor does, once every agent process is gone: a fresh,
        writable copy of the task's `tests/` at `/tests`, an empty `/logs/verifier`, and
        `/tests/test.sh` executed in the workdir (its shebang honoured; without one the
        shell runs it: bash where there is one, else sh) with `env` over the base
        environment, its stdout and stderr together into `/logs/verifier/test-stdout.txt`."""
        self._verifications += 1
        if self.lifetime == "harbor":
            return await self._verify_in_container(timeout_s, env)
        logs = self.root / f"verifier-{self._verifications}"
        logs.mkdir(mode=0o700)
        if self.runs_as.switches:
            os.chown(logs, *self.owner("verifier"))
        if not await self._agent_gone():
            return VerifierRun(None, False, logs, "agent processes outlived the run")
        run_it = f'exec "$0" > "$1/{VERIFIER_STDOUT}" 2>&1'
        if self.isolation == "bwrap":
            self._tests_bound = self._fresh_tests()
            shell = "bash" if self.image is None or self.image.has("bash") else "sh"
            command = [shell, "-c", run_it, f"{TESTS_INSIDE}/test.sh", VERIFIER_LOGS_INSIDE]
            env = {**self.base_env(), **(env or {}),
                   "TRIALLEDGER_VERIFIER_DIR": VERIFIER_LOGS_INSIDE}
        else:
            tests = self._unconfined_tests()
            command = ["bash", "-c", run_it, str(tests / "test.sh"), str(logs)]
            env = {**_minimal_env(), **(env or {}), "TRIALLEDGER_VERIFIER_DIR": str(logs),
                   "TRIALLEDGER_TESTS_DIR": str(tests)}
        code, timed_out = await self._run_bounded(command, timeout_s, env=env, role="verifier",
                                                  verifier_logs=logs)
        return VerifierRun(code, timed_out, logs)

    def _copy_tests(self, target: Path) -> None:
        """The task's tests copied to `target` (links as links), the sandbox user's, with
        `test.sh` executable (Harbor's `chmod +x`)."""
        assert self.tests is not None
        shutil.copytree(self.tests, target, symlinks=True, dirs_exist_ok=True)
        script = target / "test.sh"
        if script.is_file() and not script.is_symlink():
            script.chmod(script.stat().st_mode | 0o111)
        if self.runs_as.switches:
            chown_tree(target, self._root_owner if self.range is not None else self.agent_owner)

    def _fresh_tests(self) -> Path | None:
        """The verifier's `/tests`: over an overlay that is its root, a real folder of its
        layer (so a verifier may move it, as in a container), whatever the agent left
        there removed first and the image's own `/tests` merged in below; else a fresh
        copy the sandbox binds (returned)."""
        if self.tests is None:
            return None
        if self.overlay and not self._pristine_view("verifier"):
            clear_planted(self.root / "upper", TESTS_INSIDE, whole=True)
            layer = self.root / "upper" / TESTS_INSIDE.lstrip("/")
            if os.path.lexists(layer):
                remove_tree(layer)
            self._copy_tests(layer)
            return None
        copy = self.root / f"tests-{self._verifications}"
        self._copy_tests(copy)
        return copy

    def _unconfined_tests(self) -> Path:
        """The tests as a process-group verifier reads them: a copy of its own, made after
        the agent is gone (it runs as the sandbox user)."""
        if self.tests is None:
            return Path("/nonexistent")
        copy = self.root / f"tests-{self._verifications}"
        self._copy_tests(copy)
        return copy

    async def _run_bounded(self, command: list[str], timeout_s: float, *,
                           env: Mapping[str, str], role: Role,
                           verifier_logs: Path | None = None,
                           copy: CopyIn | None = None
                           ) -> tuple[int | None, bool]:
        run = await self._spawn(command, env=env, role=role, verifier_logs=verifier_logs,
                                copy=copy)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain, run.process.stdout)
                tg.start_soon(_drain, run.process.stderr)
                with anyio.move_on_after(timeout_s) as scope:
                    status = await run.wait()
                if scope.cancelled_caught:
                    await run.stop(0.5)
                    if run.isolation != "joined":  # a joined run's group dies with it
                        await kill_marked(self.marker, 2)
                    tg.cancel_scope.cancel()
                    return None, True
            return status.return_code, False
        finally:
            await run.aclose()


def _minimal_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}


async def _drain(stream: Any) -> None:
    if stream is not None:
        async for _ in stream:
            pass
