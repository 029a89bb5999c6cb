"""A task's healthcheck (docs/SPEC.md §15), as Harbor 0.25 runs it
(`environments/base.py` `run_healthcheck`, Docker's HEALTHCHECK semantics): the command is
tried until it exits 0; during the start period failures do not count (the next try
comes after `start_interval_sec`), after it `retries` consecutive failures fail the
check (tries `interval_sec` apart). Each try is bounded by `timeout_sec`.

A compose service's healthcheck is Docker's daemon's (moby `daemon/health.go`): its first
try comes one interval after the start too (`start_interval` within a start period), where
Harbor tries the task's at once."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from trialledger.adapters.tasks.config import TaskInvalid

TAIL = 500  # characters of the last try's output in the failure's detail


class HealthcheckInvalid(TaskInvalid):
    """A task's `[environment.healthcheck]` table is not one Harbor would load."""


@dataclass(frozen=True)
class Healthcheck:
    """`[environment.healthcheck]`, with Harbor's defaults."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3

    @classmethod
    def parse(cls, table: Any, where: str, named: str = "[environment.healthcheck]"
              ) -> Healthcheck:
        """The table as Harbor's `HealthcheckConfig` reads it (a clear error otherwise);
        `named`: the table as the error names it (a step's: `[[steps]] 'x' healthcheck`)."""
        if not isinstance(table, Mapping):
            raise HealthcheckInvalid(f"{where}: {named} must be a table")
        unknown = sorted(set(table) - set(cls.__dataclass_fields__))
        if unknown:
            raise HealthcheckInvalid(f"{where}: {named} {unknown[0]}: not a "
                                     f"healthcheck field")
        command = table.get("command")
        if not isinstance(command, str) or not command.strip():
            raise HealthcheckInvalid(f"{where}: {named} command: a shell "
                                     f"command is needed")
        values: dict[str, Any] = {"command": command}
        for name in ("interval_sec", "timeout_sec", "start_period_sec", "start_interval_sec"):
            if name in table:
                value = table[name]
                if (isinstance(value, bool) or not isinstance(value, (int, float))
                        or not math.isfinite(value) or value < 0):
                    raise HealthcheckInvalid(f"{where}: {named} {name} = "
                                             f"{value!r}: a number of seconds is needed")
                values[name] = float(value)
        if "retries" in table:
            retries = table["retries"]
            if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
                raise HealthcheckInvalid(f"{where}: {named} retries = "
                                         f"{retries!r}: a whole number from 1 is needed")
            values["retries"] = retries
        return cls(**values)


# One try: (exit code, None when it timed out; the end of its output).
Try = Callable[[float], Awaitable[tuple[int | None, str]]]


async def run_healthcheck(check: Healthcheck, attempt: Try, *,
                          first_after_interval: bool = False) -> str | None:
    """None once a try passes; else why the check failed (`sandbox.lost`'s detail). With
    `first_after_interval` (Docker's daemon), the first try waits an interval too."""
    start_period_end = anyio.current_time() + check.start_period_sec
    failures = 0
    if first_after_interval:
        await anyio.sleep(check.start_interval_sec if check.start_period_sec > 0
                          else check.interval_sec)
    while True:
        in_start_period = anyio.current_time() < start_period_end
        code, output = await attempt(check.timeout_sec)
        if code == 0:
            return None
        if in_start_period:
            await anyio.sleep(check.start_interval_sec)
            continue
        failures += 1
        if failures >= check.retries:
            result = "timed out" if code is None else f"exited {code}"
            tail = output.strip()[-TAIL:]
            return (f"healthcheck failed after {check.retries} retries: {check.command}: "
                    f"the last try {result}" + (f": {tail}" if tail else ""))
        await anyio.sleep(check.interval_sec)
