"""The local sandbox (SPEC §11): bubblewrap when it is installed, else a process group.

Under **bwrap** the agent sees a minimal read-only root (system folders, `/etc`, the Codex
install), a private `/tmp`, fresh `/dev` and `/proc`, its own PID namespace (dies with
us), an unprivileged user where the host allows it, and the host's network (the model
endpoint and MCP servers are on loopback). Only the workdir (at the task's workdir path)
and the session folder are writable; the task's tests are mounted for the verifier only.
Workdir `/` runs on a per-session kernel overlay (lower: the copied workspace, upper: the
session's changes) made in a private mount namespace; where none can be made the run is
refused. Cleanup is structural: the run is clean once its PID namespace is gone.

Without bwrap the agent runs in its own process group, every process carrying the
`TRIALLEDGER_SUPERVISOR` marker; cleanup kills the stragglers the marker finds. That mode
does not stop the agent from writing outside its workdir (`isolation` says which ran).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from trialledger.adapters.sandbox.base import (
    SUPERVISOR_ENV,
    CleanupReport,
    ExitStatus,
    ProbeResult,
    SandboxRefused,
    VerifierRun,
)

log = logging.getLogger(__name__)
INIT = Path(__file__).with_name("init.py")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SANDBOX_UID = 1000
STDERR_KEEP = 64 * 1024
_warned_no_bwrap = False
_userns: bool | None = None


def bwrap_available() -> bool:
    """Whether bubblewrap is installed (said once when it is not)."""
    global _warned_no_bwrap
    found = shutil.which("bwrap") is not None
    if not found and not _warned_no_bwrap:
        _warned_no_bwrap = True
        log.warning("bwrap not found: falling back to process-group isolation, which does "
                    "not confine the agent's writes (install it: apt-get install bubblewrap)")
    return found


def _userns_allowed() -> bool:
    global _userns
    if _userns is None:
        done = subprocess.run(
            ["bwrap", "--unshare-user", "--uid", str(SANDBOX_UID), "--ro-bind", "/", "/",
             "true"], capture_output=True, check=False)
        _userns = done.returncode == 0
    return _userns


class LocalRun:
    """A launched agent (under bwrap or in a process group)."""

    def __init__(self, process: Process, *, status_fd: int, info_fd: int | None,
                 isolation: str, marker: str) -> None:
        self.process = process
        self._status_fd = status_fd
        self._info_fd = info_fd
        self._info: dict[str, Any] | None = None
        self.isolation = isolation
        self.marker = marker
        self._stderr: deque[bytes] = deque()
        self._stderr_size = 0
        self._stderr_cut = False

    def info(self) -> dict[str, Any]:
        """bwrap's `--info-fd` report: the sandboxed init's host pid and namespaces."""
        if self._info is None and self._info_fd is not None:
            data = b""
            while chunk := os.read(self._info_fd, 4096):
                data += chunk
                if data.rstrip().endswith(b"}"):
                    break
            self._info = json.loads(data or b"{}")
        return self._info or {}

    @property
    def init_pid(self) -> int:
        """The host pid of the init that runs the agent."""
        if self.isolation == "bwrap":
            return int(self.info().get("child-pid", self.process.pid))
        return self.process.pid

    async def stdout_batches(self) -> AsyncIterator[list[bytes]]:
        """Stdout lines, a list per read: everything already buffered comes together.

        The last line may lack its newline (a torn line) and is yielded as it is.
        """
        assert self.process.stdout is not None
        pending = b""
        async for chunk in self.process.stdout:
            *lines, pending = (pending + chunk).split(b"\n")
            if lines:
                yield lines
        if pending:
            yield [pending]

    async def read_stderr(self) -> None:
        """Keep the last 64 KiB of stderr."""
        assert self.process.stderr is not None
        async for chunk in self.process.stderr:
            self._stderr.append(chunk)
            self._stderr_size += len(chunk)
            while self._stderr_size - len(self._stderr[0]) >= STDERR_KEEP:
                self._stderr_size -= len(self._stderr.popleft())
                self._stderr_cut = True

    def stderr_tail(self) -> tuple[str, bool]:
        """The collected stderr's end and whether anything was cut."""
        return b"".join(self._stderr).decode("utf-8", errors="replace"), self._stderr_cut

    async def wait(self) -> ExitStatus:
        """Wait for the sandbox to end; the init's report gives the agent's real status."""
        await self.process.wait()
        data = b""
        os.set_blocking(self._status_fd, False)
        try:
            while chunk := os.read(self._status_fd, 4096):
                data += chunk
        except BlockingIOError:
            pass
        report = json.loads(data.splitlines()[0]) if data.strip() else {}
        if "exit" in report:
            return ExitStatus(int(report["exit"]))
        if "signal" in report:
            return ExitStatus(-int(report["signal"]), f"killed by signal {report['signal']}")
        if "spawn_error" in report:
            return ExitStatus(None, f"the agent could not be spawned: {report['spawn_error']}",
                              spawned=False)
        return ExitStatus(None, f"sandbox ended with {self.process.returncode} and no report")

    def _signal_init(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signum)

    async def stop(self, grace_s: float) -> None:
        """TERM the agent's group; after `grace_s` KILL it; then the sandbox itself."""
        if self.process.returncode is not None:
            return
        self._signal_init(signal.SIGTERM)
        with anyio.move_on_after(grace_s):
            await self.process.wait()
            return
        self._signal_init(signal.SIGUSR1)  # the init SIGKILLs the agent's group
        with anyio.move_on_after(2):
            await self.process.wait()
            return
        self.process.kill()

    async def aclose(self) -> None:
        """Release the process's pipes and transport, and the status and info pipes."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            await self.process.aclose()
        for fd in (self._status_fd, self._info_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


class LocalSandbox:
    """One session's sandbox on this machine."""

    def __init__(
        self,
        *,
        session_key: str,
        workdir: str,
        workspace: Path | None = None,
        tests: Path | None = None,
        readonly_paths: Sequence[Path] = (),
        use_bwrap: bool | None = None,
        raise_oom_score_adj: bool = False,
    ) -> None:
        self.workdir = workdir
        self.isolation = "bwrap" if (bwrap_available() if use_bwrap is None else use_bwrap) \
            else "process-group"
        self.root = Path(tempfile.mkdtemp(prefix=f"trialledger-{session_key[:8]}-"))
        self.session_dir = self.root / "home"
        self.runtime = self.root / "runtime"
        self.host_work = self.root / "work"
        self.verifier_logs = self.root / "verifier"
        for folder in (self.session_dir, self.runtime, self.host_work, self.verifier_logs):
            folder.mkdir()
        shutil.copy(INIT, self.runtime / "init.py")
        if workspace is not None and workspace.is_dir():
            shutil.copytree(workspace, self.host_work, dirs_exist_ok=True, symlinks=True)
        self.tests = tests
        self.readonly_paths = [p for p in readonly_paths if p.exists()]
        self.marker = f"{session_key}"
        self.oom_score_adj = 1000 if raise_oom_score_adj else None
        self.private_roots = (str(self.session_dir), str(self.runtime))
        self.overlay = workdir == "/"
        if self.overlay:
            self._check_overlay()

    # --- paths and commands -----------------------------------------------------------------

    @property
    def agent_workdir(self) -> str:
        """The agent's working folder as the agent sees it."""
        return self.workdir if self.isolation == "bwrap" else str(self.host_work)

    def _check_overlay(self) -> None:
        if self.isolation != "bwrap":
            raise SandboxRefused("workdir / needs a per-session overlay, which needs bwrap "
                                 "(apt-get install bubblewrap); refusing to let the agent "
                                 "write to the host's root")
        for name in ("upper", "overlay-work", "merged"):
            (self.root / name).mkdir()
        done = subprocess.run([*self._overlay_prefix(), "true"], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise SandboxRefused(
                "workdir / needs a per-session overlay, and none can be made here "
                f"(mount -t overlay in a private mount namespace failed: {done.stderr.strip()})")

    def _in_overlay(self, path: str) -> bool:
        if not self.overlay:
            return False
        name = path.lstrip("/")
        return any(os.path.lexists(layer / name)
                   for layer in (self.root / "upper", self.host_work))

    def _overlay_prefix(self) -> list[str]:
        options = (f"lowerdir={self.host_work},upperdir={self.root / 'upper'},"
                   f"workdir={self.root / 'overlay-work'}")
        script = f'mount -t overlay overlay -o {options} {self.root / "merged"} && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]

    def _bwrap(self, command: Sequence[str], *, info_fd: int, verifier: bool = False
               ) -> list[str]:
        # --as-pid-1: our init is the namespace's PID 1, so it gets the signals we forward
        # (a PID 1 without handlers ignores them) and the namespace dies when it exits.
        args = ["bwrap", "--die-with-parent", "--unshare-pid", "--as-pid-1", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--new-session"]
        if _userns_allowed():
            args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        if self.overlay:
            args += ["--bind", str(self.root / "merged"), "/"]
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                if not self._in_overlay(path):  # an earlier run left it in the upper layer
                    args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for path in self.readonly_paths:
            args += ["--ro-bind", str(path), str(path)]
        args += ["--ro-bind", str(self.runtime), str(self.runtime),
                 "--bind", str(self.session_dir), str(self.session_dir)]
        if not self.overlay:
            args += ["--bind", str(self.host_work), self.workdir]
        if verifier:
            if self.tests is not None:
                args += ["--ro-bind", str(self.tests), "/tests"]
            args += ["--bind", str(self.verifier_logs), "/logs/verifier"]
        args += ["--chdir", self.workdir, "--info-fd", str(info_fd), "--", *command]
        return (self._overlay_prefix() if self.overlay else []) + args

    def _init(self, command: Sequence[str], status_fd: int) -> list[str]:
        python = "/usr/bin/python3" if self.isolation == "bwrap" else sys.executable
        init = [python, str(self.runtime / "init.py"), "--status-fd", str(status_fd)]
        if self.oom_score_adj is not None:
            init += ["--oom-score-adj", str(self.oom_score_adj)]
        return [*init, "--", *command]

    async def _spawn(self, command: Sequence[str], *, env: Mapping[str, str],
                     verifier: bool = False, stdin: bool = False) -> LocalRun:
        status_r, status_w = os.pipe()
        info_r, info_w = os.pipe() if self.isolation == "bwrap" else (None, None)
        inner = self._init(command, status_w)
        argv = (self._bwrap(inner, info_fd=info_w or 0, verifier=verifier)
                if self.isolation == "bwrap" else inner)
        env = {**env, SUPERVISOR_ENV: self.marker}
        try:
            process = await anyio.open_process(
                argv, env=env, cwd=None if self.isolation == "bwrap" else self.host_work,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                pass_fds=tuple(fd for fd in (status_w, info_w) if fd is not None),
                start_new_session=True,
            )
        except BaseException:
            for fd in (status_r, status_w, info_r, info_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (status_w, info_w):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        return LocalRun(process, status_fd=status_r, info_fd=info_r,
                        isolation=self.isolation, marker=self.marker)

    # --- the Sandbox protocol ---------------------------------------------------------------

    async def launch(self, argv: Sequence[str], *, env: Mapping[str, str], stdin: bytes
                     ) -> LocalRun:
        """Start the agent with its prompt on stdin."""
        run = await self._spawn(argv, env=env, stdin=True)
        assert run.process.stdin is not None
        await run.process.stdin.send(stdin)
        await run.process.stdin.aclose()
        return run

    async def confirm_cleanup(self, run: LocalRun, timeout_s: float) -> CleanupReport:
        """Bounded wait until no process of the run is left (structural under bwrap)."""
        if self.isolation == "bwrap":
            namespace = run.info().get("pid-namespace")
            if namespace is None:
                return CleanupReport(False, "bwrap reported no PID namespace")
            leftover: list[int] = []
            with anyio.move_on_after(timeout_s):
                while leftover := _pids_in_namespace(int(namespace)):
                    await anyio.sleep(0.05)
            if leftover:
                return CleanupReport(False, f"{len(leftover)} processes still in the sandbox's "
                                            f"PID namespace after {timeout_s:g} s")
            return CleanupReport(True)
        return await _kill_marked(self.marker, timeout_s)

    async def probe(self, timeout_s: float, command: Sequence[str] = ("true",)) -> ProbeResult:
        """Alive when `true` runs in a fresh sandbox in the workdir within the limit."""
        code, timed_out = await self._run_bounded(list(command), timeout_s, env=_minimal_env())
        if timed_out:
            return ProbeResult(False, f"`true` did not finish within {timeout_s:g} s")
        if code != 0:
            return ProbeResult(False, f"`true` exited with {code}")
        return ProbeResult(True, "`true` ran in the workdir")

    async def verify(self, timeout_s: float) -> VerifierRun:
        """Run `bash /tests/test.sh` in the workdir (tests at /tests, logs at /logs/verifier)."""
        if self.isolation == "bwrap":
            command = ["bash", "/tests/test.sh"]
            env = {**_minimal_env(), "TRIALLEDGER_VERIFIER_DIR": "/logs/verifier"}
        else:
            tests = self.tests or Path("/nonexistent")
            command = ["bash", str(tests / "test.sh")]
            env = {**_minimal_env(), "TRIALLEDGER_VERIFIER_DIR": str(self.verifier_logs),
                   "TRIALLEDGER_TESTS_DIR": str(tests)}
        code, timed_out = await self._run_bounded(command, timeout_s, env=env, verifier=True)
        return VerifierRun(code, timed_out, self.verifier_logs)

    async def _run_bounded(self, command: list[str], timeout_s: float, *,
                           env: Mapping[str, str], verifier: bool = False
                           ) -> tuple[int | None, bool]:
        run = await self._spawn(command, env=env, verifier=verifier)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain, run.process.stdout)
                tg.start_soon(_drain, run.process.stderr)
                with anyio.move_on_after(timeout_s) as scope:
                    status = await run.wait()
                if scope.cancelled_caught:
                    await run.stop(0.5)
                    await _kill_marked(self.marker, 2)
                    tg.cancel_scope.cancel()
                    return None, True
            return status.return_code, False
        finally:
            await run.aclose()

    def discard(self) -> None:
        """Remove the session's folders."""
        shutil.rmtree(self.root, ignore_errors=True)


def _minimal_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}


async def _drain(stream: Any) -> None:
    if stream is not None:
        async for _ in stream:
            pass


def _pids_where(matches: Callable[[str], bool]) -> list[int]:
    """Host pids (other than ours) whose /proc entry `matches`; vanished ones are skipped."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if matches(entry.name):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _pids_in_namespace(namespace: int) -> list[int]:
    target = f"pid:[{namespace}]"
    return _pids_where(lambda pid: os.readlink(f"/proc/{pid}/ns/pid") == target)


def _marked_pids(marker: str) -> list[int]:
    needle = f"{SUPERVISOR_ENV}={marker}".encode()

    def carries(pid: str) -> bool:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return needle in handle.read().split(b"\0")

    return _pids_where(carries)


async def _kill_marked(marker: str, timeout_s: float) -> CleanupReport:
    """Kill every process carrying the session's marker; confirm none is left."""
    leftover = _marked_pids(marker)
    with anyio.move_on_after(timeout_s):
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for pid in leftover:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            for _ in range(20):
                leftover = _marked_pids(marker)
                if not leftover:
                    return CleanupReport(True)
                await anyio.sleep(0.05)
    leftover = _marked_pids(marker)
    if leftover:
        return CleanupReport(False, f"{len(leftover)} processes carrying the session's "
                                    f"{SUPERVISOR_ENV} marker survived {timeout_s:g} s")
    return CleanupReport(True)
