"""The live display of a job at work (docs/SPEC.md §13): `job run` and `worker` on a
terminal show its trials by state, its retries by cause, the time elapsed and an ETA,
refreshed from the store once a second. Elsewhere (a pipe, `--json`) nothing is drawn."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from trialledger.adapters.console.render import out
from trialledger.adapters.images.environment import BuildWait
from trialledger.core import TrialLedgerError

if TYPE_CHECKING:
    from trialledger.store import Ledger

T = TypeVar("T")


def progress_text(counts: Mapping[str, Any]) -> str:
    """The live display's line: a job's trials by state, and its retries by cause."""
    retries = ", ".join(f"{cause} ×{n}" for cause, n in counts["retries"].items()) or "none"
    failed = counts.get("environment_failed", 0)
    return (f"queued {counts['queued']} · running {counts['running']} · done "
            f"{counts['done']}{f' · environment failed {failed}' if failed else ''} · "
            f"retries: {retries}")


def waits_text(waits: Mapping[str, BuildWait]) -> str:
    """The live display's line of tasks waiting on a build, by task name: `building NAME
    (step n/m)` (its own build, at the step podman printed last), `waiting for build of
    NAME` (another build of its image holds that image's lock)."""
    said = []
    for task, wait in sorted(waits.items()):
        if wait.state == "waiting":
            said.append(f"waiting for build of {task}")
        elif wait.step is None:
            said.append(f"building {task}")
        else:
            said.append(f"building {task} (step {wait.step[0]}/{wait.step[1]})")
    return " · ".join(said)


async def with_live(ledger: Ledger, job: str, wanted: bool,
                    work: Callable[[], Awaitable[T]],
                    waits: Mapping[str, BuildWait] | None = None) -> T:
    """`work`, under a live rich display of the job's progress when stdout is a terminal
    (queued / running / done, retries by cause, elapsed, ETA), refreshed from the store;
    below it, while any task's environment waits on a build, what each waits for
    (`waits`: the runner's own, changed in place as builds go, read at each refresh)."""
    if not (wanted and out.is_terminal):
        return await work()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from trialledger.store.jobs import Jobs

    jobs = Jobs(ledger)
    done: list[T] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=out) as bar:
        shown = bar.add_task(f"job {job}", total=None)
        building = bar.add_task("", total=None, visible=False)

        async def refresh() -> None:
            with contextlib.suppress(TrialLedgerError):  # a blink: the next refresh
                counts = await jobs.progress(job)
                total = sum(counts[k] for k in ("queued", "running", "done",
                                                "environment_failed"))
                said = progress_text(counts) if total else f"job {job}: preparing its tasks"
                bar.update(shown, description=said, total=total or None,
                           completed=counts["done"] + counts["environment_failed"])
            waiting = waits_text(dict(waits)) if waits is not None else ""
            bar.update(building, description=waiting, visible=bool(waiting))

        async def poll() -> None:
            while True:
                await refresh()
                await anyio.sleep(1.0)

        failed: list[Exception] = []  # raised after the group: never an ExceptionGroup
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            try:
                done.append(await work())
            except Exception as error:
                failed.append(error)
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        await refresh()  # the final state
    return done[0]
