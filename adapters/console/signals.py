"""How a command stops on a signal (docs/SPEC.md §10, §13): SIGINT, SIGTERM and SIGHUP
(docker, systemd, Kubernetes, Slurm) cancel the work the same way, its sessions closed
`cancelled`, and the command exits 128+N. A job's first signal stops new claims and gives
running trials a grace period; a second one cancels them at once. A terminal that goes
away (adapters/console/terminal.py) is a hang-up: SIGHUP's grace, then exit 129."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from trialledger.adapters.console import terminal

T = TypeVar("T")


class Interrupted(Exception):
    """A run stopped by SIGINT, SIGTERM or SIGHUP (its sessions closed `cancelled`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def until_signalled(work: Callable[[], Awaitable[T]], *,
                          stop: Callable[[], None] | None = None, grace_s: float = 0.0) -> T:
    """Run `work`; SIGINT, SIGTERM and SIGHUP (docker, systemd, Kubernetes, Slurm) all
    cancel it the same way — its cleanup runs, the agent is stopped, the session closed
    `cancelled`, its folder removed — and then raise `Interrupted`. With `stop`, the
    first signal calls it and cancels only after `grace_s` (a second one at once). A
    terminal that goes away (`terminal`: a write to stdout or stderr failed) is a SIGHUP,
    and a hang-up counts once, however often it is told (the kernel, the shell, a write)."""
    done: list[T] = []
    caught: list[int] = []
    failed: list[Exception] = []  # raised after the group, so it is never an ExceptionGroup
    loop = asyncio.get_running_loop()
    async with anyio.create_task_group() as tg:

        def take(signum: int, *, from_write: bool = False) -> None:
            if (from_write and caught) or (signum == signal.SIGHUP and signum in caught):
                return  # the same hang-up again, or a write failing during a stop begun
            caught.append(signum)
            if stop is None or len(caught) > 1:
                tg.cancel_scope.cancel()
                return
            stop()
            tg.start_soon(cancel_after_grace)

        async def watch() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM,
                                            signal.SIGHUP) as signals:
                async for signum in signals:
                    take(signum)

        async def watch_terminal() -> None:
            gone = anyio.Event()

            def told() -> None:  # from the thread whose write failed
                with contextlib.suppress(RuntimeError):  # the loop ended: nothing to stop
                    loop.call_soon_threadsafe(gone.set)

            with terminal.until_lost(told):
                await gone.wait()
            take(signal.SIGHUP, from_write=True)

        async def cancel_after_grace() -> None:
            await anyio.sleep(grace_s)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(watch_terminal)
        try:
            done.append(await work())
        except Exception as error:
            failed.append(error)
        tg.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if caught or not done:
        raise Interrupted(caught[0] if caught else signal.SIGINT)
    return done[0]


def stopper(holder: list[Any], grace_s: float) -> Callable[[], None]:
    """A job's first signal: the runner in `holder` (if any yet) claims no new trials, and
    stderr says how long the running ones get."""
    def stop() -> None:
        if holder:
            holder[0].stop_claiming()
        print(f"trialledger: stopping: no new trials; running ones get {grace_s:g} s "
              f"(a second signal cancels them now)", file=sys.stderr)
    return stop
