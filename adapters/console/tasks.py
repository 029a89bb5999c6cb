"""What `run` and `job run` say about the tasks they were given (docs/SPEC.md §15): the
dataset tasks skipped as unsupported, and the task fields this runner does not honour.
Warnings go to stderr, never stdout, so `--json` stays JSON."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from trialledger.adapters.console.plain import printable


def warn_fields(tasks: Sequence[Any], skipped: Mapping[str, str] | None = None, *,
                in_range: bool = False) -> None:
    """docs/SPEC.md §15 on stderr (never stdout): each dataset task skipped as unsupported,
    then one line per distinct field not honoured, with how many tasks have it (phase
    users are honoured only for image and rootfs tasks in range mode)."""

    for name, why in (skipped or {}).items():
        print(f"trialledger: warning: skipped task {printable(name)}: {printable(why)}",
              file=sys.stderr)
    counts: dict[tuple[str, str], int] = {}
    for task in tasks:
        for field, reason in task.unhonoured(in_range).items():
            counts[field, reason] = counts.get((field, reason), 0) + 1
    for (field, reason), n in sorted(counts.items()):
        print(f"trialledger: warning: {printable(field)} {printable(reason)} "
              f"({n} task{'s' * (n != 1)})", file=sys.stderr)
