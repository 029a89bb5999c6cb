"""Which job a `job run` command names, and where its tasks are (docs/SPEC.md §13, §19).

Two forms are read: ours, `job run NAME TASK_OR_DATASET...`, and Harbor's, `job run -p
DATASET [--job-name NAME]`. A first word that is a task or dataset folder is a path, never
a name. A job run without a name is named after its (first) dataset folder plus 8 hex
digits of the hash of its configuration — what decides whether a re-run resumes — so the
same command names the same job again.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trialledger.adapters.tasks.config import is_task_folder
from trialledger.core.errors import TrialLedgerError


class JobFormRefused(TrialLedgerError):
    """A `job run` whose name or tasks are missing, or given twice with different values."""


@dataclass(frozen=True)
class JobForm:
    """A `job run`'s name (None: to be derived, `derived_name`) and task or dataset paths."""

    name: str | None
    paths: list[Path]


def holds_tasks(path: Path) -> bool:
    """Whether `path` is a task folder or a dataset folder (a subfolder is a task)."""
    if is_task_folder(path):
        return True
    try:
        return path.is_dir() and any(is_task_folder(p) for p in path.iterdir())
    except OSError:
        return False


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def job_form(words: Sequence[str], *, path: str | None = None, job_name: str | None = None
             ) -> JobForm:
    """The job `words` (the positional arguments), `-p` (`path`) and `--job-name` name.
    Refused (`JobFormRefused`): no task or dataset at all, a name given both ways with two
    values, or positional tasks beside a different `-p`."""
    rest = list(words)
    name = None
    if rest and not holds_tasks(Path(rest[0])) and (path is not None or len(rest) > 1
                                                     or job_name is None):
        name = rest.pop(0)
    if name is not None and job_name is not None and name != job_name:
        raise JobFormRefused(f"the job is named twice: {name} and --job-name {job_name} "
                             f"(give one)")
    paths = [Path(word) for word in rest]
    if path is not None:
        if any(not _same(p, Path(path)) for p in paths):
            raise JobFormRefused(f"the tasks are given twice: {' '.join(rest)} and -p {path} "
                                 f"(give one)")
        paths = [Path(path)]
    if not paths:
        said = f"{name} is no task or dataset folder; " if name is not None and \
            job_name is None and path is None else ""
        raise JobFormRefused(f"{said}job run needs TASK_OR_DATASET... or -p DATASET")
    return JobForm(name if name is not None else job_name, paths)


def derived_name(paths: Sequence[Path], config: Mapping[str, Any]) -> str:
    """A nameless job's name: the first dataset folder's name, `-`, and the first 8 hex
    digits of the sha256 of its configuration (`job_config`, canonical JSON)."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"))
                            .encode()).hexdigest()
    return f"{paths[0].resolve().name}-{digest[:8]}"


def resume_command(argv: Sequence[str], name: str) -> str:
    """The command that resumes a job given without a name: the same one, naming it."""
    return shlex.join(["trialledger", *argv, "--job-name", name])


__all__ = ["JobForm", "JobFormRefused", "derived_name", "holds_tasks", "job_form",
           "resume_command"]
