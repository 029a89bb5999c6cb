"""Reading a JSONL log a user hands us (`import`, `replay --log`) as untrusted input: a
FIFO or a device is refused without blocking, the file is capped, invalid UTF-8 is named
by its line, and nothing is stored unless every line parses (SPEC §10 "bad input")."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trialledger.core import BadEvent, TrialLedgerError
from trialledger.core.parsing import parse_jsonl

LOG_LIMIT = 1024 * 2**20  # bytes of one log


class LogUnreadable(TrialLedgerError):
    """A log path that is not a readable regular file within the size cap."""


def _lines(handle: Any) -> Iterator[str]:
    for number, raw in enumerate(handle, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadEvent(f"not UTF-8 (byte {error.start + 1})", line=number) from None


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Every (line number, object) of a JSONL file; `LogUnreadable` or `BadEvent` else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        raise LogUnreadable(f"cannot read {path}: {error.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LogUnreadable(f"{path} is not a regular file")
        if info.st_size > LOG_LIMIT:
            raise LogUnreadable(f"{path} is {info.st_size} bytes, over the "
                                f"{LOG_LIMIT // 2**20} MiB cap for one session's log")
        os.set_blocking(fd, True)
        events = list(parse_jsonl(_lines(handle)))
    if not events:
        raise LogUnreadable(f"{path} is empty: a log holds at least its session.seeded")
    return events
