"""A dead man's switch for a job trial's sandbox (docs/SPEC.md §13, "Leases that end").

The lease that lets a worker run a trial expires unless renewed; the worker stops its
sandbox when it cannot renew in time. A worker that is paused (SIGSTOP), starved or dead
cannot stop anything, so the sandbox enforces the deadline itself: every process our init
starts under a switch is SIGKILLed, with its whole group, once the deadline passes without
an extension. The worker extends it after each renewal by writing the new budget to a pipe
only our init reads (it is non-dumpable; the agent never holds the pipe).
"""

from __future__ import annotations

import contextlib
import os
import time


class DeadManSwitch:
    """The deadline a lease holder extends: `extend(seconds)` from now, read by every
    sandbox process our init starts while the switch is armed."""

    def __init__(self, seconds: float) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._until = time.monotonic() + seconds

    @property
    def read_fd(self) -> int:
        """The pipe end each spawn's init reads (passed to it, never to the command)."""
        return self._read

    def remaining_ms(self) -> int:
        """What is left of the deadline, for a spawn started now; extensions written before
        are dropped (a spawn's init reads only later ones, which count from their writing)."""
        with contextlib.suppress(BlockingIOError):
            os.set_blocking(self._read, False)
            while os.read(self._read, 4096):
                pass
        return max(0, int((self._until - time.monotonic()) * 1000))

    def extend(self, seconds: float) -> None:
        """The deadline is now `seconds` from now, for every process started under it. A
        pipe that is full (no init reading it) keeps what it holds; a new spawn reads the
        deadline from its arguments."""
        self._until = time.monotonic() + seconds
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._write, f"{int(seconds * 1000)}\n".encode())

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
