"""Files of a task folder the loader reads whole (docs/tasks.md "Sizes"): `task.toml`,
`instruction.md` and `environment/docker-compose.yaml`, each capped by the run's or job's
`task_file_max_bytes` (docs/SPEC.md §5).

A file is opened without following a link in its last component, its size taken from
that open file (`fstat`), and at most one byte past the cap read, so a file of any size,
or one that grows while read, never makes the runner hold more than the cap.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trialledger.adapters.places import OPEN_UNTRUSTED, read_at_most, within
from trialledger.adapters.tasks.config import TaskInvalid
from trialledger.core.errors import SeedRejected
from trialledger.core.settings import TASK_FILE_MAX_BYTES, Settings

SETTING = "task_file_max_bytes"


class TaskFileTooLarge(TaskInvalid):
    """A task file over `task_file_max_bytes` (the message names it and the cap); in a
    dataset such a task is skipped with this reason."""


def file_limit(overrides: Mapping[str, Any]) -> int:
    """The run's or job's `task_file_max_bytes` (its default when unset), checked as the
    seed checks it (`SeedRejected` naming the setting)."""
    value = overrides.get(SETTING, TASK_FILE_MAX_BYTES)
    try:
        return Settings.model_validate({SETTING: value}).task_file_max_bytes
    except ValidationError as error:
        why = error.errors()[0]["msg"]
        raise SeedRejected(f"setting {SETTING} = {value!r}: {why}") from None


def _too_large(shown: Path, size: int, limit: int) -> TaskFileTooLarge:
    return TaskFileTooLarge(f"{shown}: {size} bytes, over the {limit}-byte cap on a task "
                            f"file (setting {SETTING})")


def _open(folder: Path, relative: str) -> tuple[int, Path]:
    """`folder/relative` opened (its links inside the folder resolved, as the layout
    allows), a regular file, and how it is named in messages."""
    shown = folder / relative
    real = within(folder, relative)
    if real is None:
        raise TaskInvalid(f"{folder}: {relative} must be a path inside the task folder")
    try:
        fd = os.open(real, OPEN_UNTRUSTED)
    except OSError as error:
        raise TaskInvalid(f"{shown}: cannot be read ({os.strerror(error.errno or 0)})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise TaskInvalid(f"{shown}: not a regular file")
    return fd, shown


def read_task_file(folder: Path, relative: str, limit: int) -> bytes:
    """A task file's bytes, or `TaskFileTooLarge` when it holds more than `limit`."""
    fd, shown = _open(folder, relative)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise _too_large(shown, size, limit)
        data = read_at_most(fd, limit)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew after fstat
        raise _too_large(shown, len(data), limit)
    return data


def read_task_text(folder: Path, relative: str, limit: int) -> str:
    """A task file as UTF-8 text (`TaskInvalid` when it is not)."""
    try:
        return read_task_file(folder, relative, limit).decode("utf-8")
    except UnicodeDecodeError as error:
        raise TaskInvalid(f"{folder / relative}: not UTF-8 text (byte {error.start})") from None
