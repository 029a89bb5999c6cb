"""The host's /proc, scanned for a sandbox's processes: those in its PID namespace, or
(process-group isolation) those carrying its session's marker; and killing the latter.
Every entry read here may belong to the agent: vanished or unreadable ones are skipped."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

import anyio

from trialledger.adapters.sandbox.base import SUPERVISOR_ENV, CleanupReport


def pids_where(matches: Callable[[str], bool]) -> list[int]:
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


def pids_in_namespace(namespace: int) -> list[int]:
    target = f"pid:[{namespace}]"
    return pids_where(lambda pid: os.readlink(f"/proc/{pid}/ns/pid") == target)


def marked_pids(marker: str) -> list[int]:
    needle = f"{SUPERVISOR_ENV}={marker}".encode()

    def carries(pid: str) -> bool:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return needle in handle.read(1 << 20).split(b"\0")

    return pids_where(carries)


async def kill_marked(marker: str, timeout_s: float) -> CleanupReport:
    """Kill every process carrying the session's marker; confirm none is left."""
    leftover = marked_pids(marker)
    with anyio.move_on_after(timeout_s):
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for pid in leftover:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            for _ in range(20):
                leftover = marked_pids(marker)
                if not leftover:
                    return CleanupReport(True)
                await anyio.sleep(0.05)
    leftover = marked_pids(marker)
    if leftover:
        return CleanupReport(False, f"{len(leftover)} processes carrying the session's "
                                    f"{SUPERVISOR_ENV} marker survived {timeout_s:g} s")
    return CleanupReport(True)
