"""A task folder in a Harbor-like layout (SPEC §10 `trialledger run`).

    instruction.md   the prompt
    task.toml        optional: [agent] timeout_sec, [verifier] timeout_sec,
                     [environment] workdir, env (variables the task declares) and
                     allow_internet (false: only the model endpoint and MCP grants)
    workspace/       optional: copied into a fresh workdir
    tests/test.sh    the verifier
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialledger.core.errors import TrialLedgerError


class TaskInvalid(TrialLedgerError):
    """A task folder that cannot be run (the message says what is missing)."""


@dataclass(frozen=True)
class Task:
    """What `trialledger run` needs to know about a task."""

    name: str
    folder: Path
    instruction: str
    workspace: Path | None
    tests: Path | None
    settings: dict[str, Any] = field(default_factory=dict)  # from task.toml
    env: dict[str, str] = field(default_factory=dict)
    allow_internet: bool = True  # false: only the model endpoint and MCP grants

    @classmethod
    def load(cls, folder: Path) -> Task:
        """Read a task folder."""
        folder = folder.resolve()
        if not folder.is_dir():
            raise TaskInvalid(f"{folder}: no such task folder")
        instruction = folder / "instruction.md"
        if not instruction.is_file():
            raise TaskInvalid(f"{folder}: no instruction.md (the prompt)")
        meta: dict[str, Any] = {}
        if (folder / "task.toml").is_file():
            try:
                meta = tomllib.loads((folder / "task.toml").read_text(encoding="utf-8"))
            except tomllib.TOMLDecodeError as error:
                raise TaskInvalid(f"{folder / 'task.toml'}: {error}") from None
        settings: dict[str, Any] = {}
        if "timeout_sec" in meta.get("agent", {}):
            settings["timeout_s"] = float(meta["agent"]["timeout_sec"])
        if "timeout_sec" in meta.get("verifier", {}):
            settings["verifier_timeout_s"] = float(meta["verifier"]["timeout_sec"])
        environment = meta.get("environment", {})
        if "workdir" in environment:
            settings["workdir"] = str(environment["workdir"])
        tests = folder / "tests"
        return cls(
            name=str(meta.get("task", {}).get("name", folder.name)),
            folder=folder,
            instruction=instruction.read_text(encoding="utf-8"),
            workspace=folder / "workspace" if (folder / "workspace").is_dir() else None,
            tests=tests if (tests / "test.sh").is_file() else None,
            settings=settings,
            env={str(k): str(v) for k, v in environment.get("env", {}).items()},
            allow_internet=_flag(environment, "allow_internet", folder),
        )


def _flag(table: dict[str, Any], key: str, folder: Path) -> bool:
    value = table.get(key, True)
    if not isinstance(value, bool):
        raise TaskInvalid(f"{folder / 'task.toml'}: [environment] {key} must be true or false")
    return value
