"""A launched sandbox process: its stdout as bounded lines, its stderr's tail, the init's
status report, and stopping it. Everything read here comes from the agent's side."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import Process

from trialledger.adapters.sandbox.base import ExitStatus

STDERR_KEEP = 64 * 1024
LINE_LIMIT = 1024 * 1024  # a Codex stdout line over this is cut (SPEC §11)
REPORT_LIMIT = 4096


@dataclass(frozen=True)
class CutLine:
    """The first `LINE_LIMIT` bytes of a longer stdout line, and its full length."""

    head: bytes
    size: int


class LineSplitter:
    """Splits a byte stream into lines, linear in its size (a line is joined once), never
    holding more than `limit` bytes of one line: past that it becomes a `CutLine`."""

    def __init__(self, limit: int = LINE_LIMIT) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self._held = 0
        self._head = b""
        self._cut: int | None = None  # the full size of a line being cut

    def feed(self, chunk: bytes) -> list[bytes | CutLine]:
        """The lines `chunk` completes."""
        *complete, rest = chunk.split(b"\n")
        out = []
        for piece in complete:
            self._add(piece)
            out.append(self._take())
        self._add(rest)
        return out

    def end(self) -> list[bytes | CutLine]:
        """The torn last line, if the stream ended without a newline."""
        return [self._take()] if self._held or self._cut is not None else []

    def _add(self, piece: bytes) -> None:
        if self._cut is not None:
            self._cut += len(piece)
        elif self._held + len(piece) > self.limit:
            self._head = b"".join(self._parts) + piece[:self.limit - self._held]
            self._cut = self._held + len(piece)
            self._parts.clear()
        else:
            self._parts.append(piece)
            self._held += len(piece)

    def _take(self) -> bytes | CutLine:
        line = (CutLine(self._head, self._cut) if self._cut is not None
                else b"".join(self._parts))
        self._parts.clear()
        self._held, self._head, self._cut = 0, b"", None
        return line


class LocalRun:
    """A launched agent (under bwrap, joined into a session's container, or in a process
    group), or a session's container itself (under bwrap or runc)."""

    def __init__(self, process: Process, *, status_fd: int, info_fd: int | None,
                 isolation: str, marker: str) -> None:
        self.process = process
        self._status_fd: int | None = status_fd  # None once closed: a descriptor is
        self._info_fd = info_fd  # closed once (closed twice, it may be another thread's)
        self._info: dict[str, Any] | None = None
        self.isolation = isolation
        self.marker = marker
        self._stderr: deque[bytes] = deque()
        self._stderr_size = 0
        self._stderr_cut = False
        self._stderr_closed = anyio.Event()
        self.group_gone: bool | None = None  # a joined run's report: its group is gone

    def info(self) -> dict[str, Any]:
        """bwrap's `--info-fd` report: the sandboxed init's host pid and namespaces."""
        if self._info is None and self._info_fd is not None:
            data = b""
            while len(data) < REPORT_LIMIT and (chunk := os.read(self._info_fd, 4096)):
                data += chunk
                if data.rstrip().endswith(b"}"):
                    break
            try:
                parsed = json.loads(data or b"{}")
            except ValueError:
                parsed = {}
            self._info = parsed if isinstance(parsed, dict) else {}
        return self._info or {}

    def know(self, info: dict[str, Any]) -> None:
        """What a runtime without bwrap's `--info-fd` (runc, crun) found out: the same keys."""
        self._info = dict(info)

    @property
    def init_pid(self) -> int:
        """The host pid of the init that runs the agent."""
        if self.isolation in ("bwrap", "runc", "crun"):
            pid = self.info().get("child-pid")
            return pid if isinstance(pid, int) else self.process.pid
        return self.process.pid

    async def stdout_batches(self) -> AsyncIterator[list[bytes | CutLine]]:
        """Stdout lines, a list per read; a line over 1 MiB comes as a `CutLine`.

        The last line may lack its newline (a torn line) and is yielded as it is.
        """
        assert self.process.stdout is not None
        splitter = LineSplitter()
        async for chunk in self.process.stdout:
            if lines := splitter.feed(chunk):
                yield lines
        if lines := splitter.end():
            yield lines

    async def read_stderr(self) -> None:
        """Keep the last 64 KiB of stderr."""
        assert self.process.stderr is not None
        async for chunk in self.process.stderr:
            self._stderr.append(chunk)
            self._stderr_size += len(chunk)
            while self._stderr_size - len(self._stderr[0]) >= STDERR_KEEP:
                self._stderr_size -= len(self._stderr.popleft())
                self._stderr_cut = True
        self._stderr_closed.set()

    def stderr_tail(self) -> tuple[str, bool]:
        """The collected stderr's end and whether anything was cut."""
        return b"".join(self._stderr).decode("utf-8", errors="replace"), self._stderr_cut

    async def wait(self) -> ExitStatus:
        """Wait for the sandbox to end; the init's report gives the agent's real status."""
        await self.process.wait()
        data = b""
        if (fd := self._status_fd) is not None:
            os.set_blocking(fd, False)
            with contextlib.suppress(BlockingIOError):
                while len(data) < REPORT_LIMIT and (chunk := os.read(fd, 4096)):
                    data += chunk
        status = _status_of(data, self.process.returncode)
        self.group_gone = _group_gone(data)
        if (status.return_code is None and status.spawned and self.isolation == "bwrap"
                and "child-pid" not in self.info()):
            # bwrap itself failed before the sandbox existed: nothing of the agent ran
            with anyio.move_on_after(1):  # its reason is on stderr, still being read
                await self._stderr_closed.wait()
            tail, _ = self.stderr_tail()
            reason = tail.strip().splitlines()[-1][:300] if tail.strip() else "no reason given"
            return ExitStatus(None, f"bwrap could not create the sandbox: {reason}",
                              spawned=False)
        return status

    def _signal_init(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
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
        closing, self._status_fd, self._info_fd = (self._status_fd, self._info_fd), None, None
        for fd in closing:
            if fd is not None:
                os.close(fd)


def _group_gone(data: bytes) -> bool | None:
    """A joined run's report of its process group (`"group_gone"`), if any."""
    with contextlib.suppress(ValueError, UnicodeDecodeError, IndexError):
        report = json.loads(data.splitlines()[0])
        if isinstance(report, dict) and isinstance(report.get("group_gone"), bool):
            return bool(report["group_gone"])
    return None


def _status_of(data: bytes, returncode: int | None) -> ExitStatus:
    """The init's first report line → the agent's status (a bad report is no report)."""
    try:
        report = json.loads(data.splitlines()[0]) if data.strip() else {}
    except (ValueError, UnicodeDecodeError):
        report = {}
    if not isinstance(report, dict):
        report = {}
    for key in ("exit", "signal"):
        value = report.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 256:
            return (ExitStatus(value) if key == "exit"
                    else ExitStatus(-value, f"killed by signal {value}"))
    if isinstance(report.get("spawn_error"), str):
        return ExitStatus(None, f"the agent could not be spawned: {report['spawn_error'][:500]}",
                          spawned=False)
    return ExitStatus(None, f"sandbox ended with {returncode} and no report")
