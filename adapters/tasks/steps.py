"""A multi-step task's `[[steps]]` and `steps/<name>/` folders, read as Harbor 0.26 reads
them (its `models/task/config.py` `StepConfig`, `models/task/paths.py`, docs/SPEC.md §17).

    steps/<name>/instruction.md   the step's prompt (required)
    steps/<name>/workdir/         uploaded into the workdir before the step; its setup.sh
                                  is then run there as the step's agent user
    steps/<name>/tests/           merged over the task's tests/ (the step's test.sh if it
                                  has one, else the task's)
    steps/<name>/solution/        the oracle's for this step, else the task's solution/

A step's `healthcheck` (a `[environment.healthcheck]` table) runs after its setup.sh, as
its agent user; its `artifacts` are collected after the task's in its session, and its
`[[steps.verifier.collect]]` hooks run after the task's (Harbor's `_collect_hooks_for`).

`min_reward` is a number (gating the `reward` key) or a table of key → threshold;
`multi_step_reward_strategy` is `mean` (the default) or `final`. Every refusal is one
line naming the step and the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialledger.adapters.places import within
from trialledger.adapters.tasks.artifacts import Artifact, parse_step_artifacts
from trialledger.adapters.tasks.collect import CollectHook, parse_collect
from trialledger.adapters.tasks.config import (
    FIELDS,
    HONOURED,
    Key,
    TaskInvalid,
    UnsupportedField,
    phase_mode,
    wrong_type,
)
from trialledger.adapters.tasks.env import ResolvedEnv
from trialledger.adapters.tasks.files import read_task_text
from trialledger.adapters.tasks.healthcheck import Healthcheck
from trialledger.adapters.tasks.verifiermode import SeparateVerifier
from trialledger.core.steps import Strategy, gate_failure

STRATEGIES: tuple[Strategy, ...] = ("mean", "final")

# Harbor's `validate_step_name`: one portable directory name.
_INVALID = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]')
_DEVICE = re.compile(r"^(CON|PRN|AUX|NUL|CONIN\$|CONOUT\$|(?:COM|LPT)[1-9¹²³])$",
                     re.IGNORECASE)

# Each key of Harbor's StepConfig and what is done with it ("*": any key of that table).
STEP_FIELDS: dict[tuple[str, ...], Key] = {
    ("name",): HONOURED,
    ("min_reward",): HONOURED,
    ("agent", "timeout_sec"): HONOURED,
    ("agent", "user"): HONOURED,  # range mode, as the task's [agent] user
    ("verifier", "timeout_sec"): HONOURED,
    ("verifier", "env"): HONOURED,
    ("verifier", "user"): HONOURED,
    ("healthcheck",): HONOURED,  # after setup.sh, before the agent
    ("artifacts",): HONOURED,  # after the task's, for the step's collection
    # over the task's phase for this step's sessions (the task's allowlist: config.py)
    ("agent", "network_mode"): HONOURED,
    ("agent", "allowed_hosts"): HONOURED,
    ("verifier", "network_mode"): HONOURED,
    ("verifier", "allowed_hosts"): HONOURED,
    # the step's separate verifier (adapters/tasks/verifiermode.py `parse`, with the step):
    # its table's keys as the task's [verifier.environment]'s
    ("verifier", "environment_mode"): HONOURED,
    **{path: rule for path, rule in FIELDS.items() if path[:2] == ("verifier", "environment")},
    ("verifier", "collect"): HONOURED,  # after the task's hooks, in the step's collection
}
STEP_TABLES = frozenset({("agent",), ("verifier",), ("verifier", "environment")})
UNKNOWN = "is not a field of Harbor 0.26's step config: ignored"


class StepInvalid(TaskInvalid):
    """A `[[steps]]` entry or a `steps/<name>/` folder that cannot be run (the message names
    the step); in a dataset such a task is skipped, not the whole job refused."""


@dataclass(frozen=True)
class Step:
    """One step of a multi-step task: what its session and its verifier need."""

    name: str
    index: int  # 1-based, in task.toml's order
    instruction: str
    folder: Path  # steps/<name>
    workdir: Path | None = None  # steps/<name>/workdir, uploaded before the step
    setup: Path | None = None  # steps/<name>/workdir/setup.sh, run before the step
    tests: tuple[Path, ...] = ()  # the tests/ folders merged in order (the task's, the step's)
    test_script: Path | None = None  # the step's tests/test.sh, else the task's
    solution: Path | None = None  # steps/<name>/solution, else the task's solution/
    min_reward: dict[str, float] | None = None  # key → threshold (a number: `reward`)
    settings: dict[str, Any] = field(default_factory=dict)  # timeout_s, verifier_timeout_s
    users: dict[str, str] = field(default_factory=dict)  # phase → its user
    network_modes: dict[str, str] = field(default_factory=dict)  # phase → its own mode
    verifier_env: dict[str, str] = field(default_factory=dict)  # [steps.verifier] env
    secrets: tuple[str, ...] = ()  # its resolved values with sensitive names
    healthcheck: Healthcheck | None = None  # run after setup.sh, before the agent
    artifacts: tuple[Artifact, ...] | None = None  # the task's then its own; None: none of its own
    collect: tuple[CollectHook, ...] = ()  # its [[steps.verifier.collect]], after the task's
    # its own container for the verifier (None: shared), as Harbor resolves a step's mode
    separate_verifier: SeparateVerifier | None = None

    def gate_failure(self, rewards: Mapping[str, float] | None) -> str | None:
        """Why this step's `min_reward` gate fails on `rewards` (core/steps.py); None: it
        holds, or the step has none."""
        return gate_failure(rewards, self.min_reward)


def reward_strategy(meta: Mapping[str, Any], where: str) -> Strategy:
    """`multi_step_reward_strategy` (`mean` when unset), or `WrongType` naming it."""
    value = meta.get("multi_step_reward_strategy", "mean")
    if value not in STRATEGIES:
        raise wrong_type(where, "multi_step_reward_strategy", value, "'mean' or 'final'")
    return "final" if value == "final" else "mean"


def load_steps(meta: Mapping[str, Any], folder: Path, *, max_bytes: int,
               read_env: Callable[[Any, str], ResolvedEnv],
               artifacts: tuple[Artifact, ...] = ()
               ) -> tuple[tuple[Step, ...], dict[str, str]]:
    """The task's steps (none when `steps` is absent or empty) and the warned step keys
    (name → why). `read_env` resolves a `[steps.verifier] env` table (`${VAR}`);
    `artifacts` are the task's, which a step's own follow."""
    where = str(folder / "task.toml")
    raw = meta.get("steps")
    if raw is None or raw == []:
        return (), {}
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        raise wrong_type(where, "steps", raw, "an array of tables ([[steps]])")
    seen: dict[str, str] = {}
    steps: list[Step] = []
    ignored: dict[str, str] = {}
    for index, entry in enumerate(raw, start=1):
        name = _name(entry, index, where)
        key = unicodedata.normalize("NFC", name).casefold()
        if key in seen:
            raise StepInvalid(f"{where}: [[steps]] {name!r}: step names must be unique "
                              f"(also in case and Unicode form): {seen[key]!r} is taken")
        seen[key] = name
        label = f"[[steps]] {name!r}"
        ignored.update(_review(entry, (), f"{where}: {label}", label))
        step = _step(entry, name, index, folder, where, max_bytes, read_env)
        if "artifacts" in entry:
            kept, warned = parse_step_artifacts(entry["artifacts"], artifacts,
                                                f"{where}: {label}")
            ignored.update({f"{label} {key}": why for key, why in warned.items()})
            step = dataclasses.replace(step, artifacts=kept)
        if "collect" in entry.get("verifier", {}):
            hooks, warned = parse_collect(entry["verifier"]["collect"], f"{where}: {label}")
            ignored.update({f"{label} {key}": why for key, why in warned.items()})
            step = dataclasses.replace(step, collect=hooks)
        steps.append(step)
    return tuple(steps), ignored


def _name(entry: Mapping[str, Any], index: int, where: str) -> str:
    """A step's `name`, checked as Harbor's `validate_step_name` checks it."""
    name = entry.get("name")
    if not isinstance(name, str):
        raise wrong_type(where, f"[[steps]] #{index} name", name,
                         "a string (the step's folder under steps/)")
    if (not name.strip() or name in {".", ".."} or name.endswith((".", " "))
            or _INVALID.search(name) or _DEVICE.fullmatch(name.partition(".")[0].rstrip(" "))
            or len(name.encode("utf-8")) > 255):
        raise StepInvalid(f"{where}: [[steps]] #{index} name = {name!r}: not a portable "
                          f"folder name (no path separators, control or reserved "
                          f"characters, device names or trailing dots and spaces)")
    return name


def _review(table: Mapping[str, Any], prefix: tuple[str, ...], where: str, label: str
            ) -> dict[str, str]:
    """A step's keys against `STEP_FIELDS`: warned ones (name → why); a refused one raises
    `UnsupportedField` naming the step and the key."""
    ignored: dict[str, str] = {}
    for key, value in table.items():
        path = (*prefix, key)
        shown = f"{label} {'.'.join(path)}"
        if path in STEP_TABLES:
            if not isinstance(value, dict):
                raise wrong_type(where, ".".join(path), value, "a table")
            ignored.update(_review(value, path, where, label))
            continue
        rule = STEP_FIELDS.get(path) or Key("warned", UNKNOWN)
        if rule.asks_nothing is not None and rule.asks_nothing(value):
            continue
        if rule.treatment == "refused":
            raise UnsupportedField(f"{where} {'.'.join(path)}: {rule.reason}")
        if rule.treatment == "warned":
            ignored[shown] = rule.reason
    return ignored


def _step(entry: Mapping[str, Any], name: str, index: int, folder: Path, where: str,
          max_bytes: int, read_env: Callable[[Any, str], ResolvedEnv]
          ) -> Step:
    """One step, its folder checked: inside the task, with its instruction.md."""
    label = f"{where}: [[steps]] {name!r}"
    home = folder / "steps" / name
    for part in ("", "/instruction.md", "/workdir", "/tests", "/solution",
                 "/workdir/setup.sh", "/tests/test.sh", "/solution/solve.sh"):
        if within(folder, f"steps/{name}{part}") is None:
            raise StepInvalid(f"{label}: steps/{name}{part} leads out of the task folder "
                              f"(a symbolic link on the way)")
    if not home.is_dir():
        raise StepInvalid(f"{label}: no folder steps/{name}/ (with its instruction.md)")
    if not (home / "instruction.md").is_file():
        raise StepInvalid(f"{label}: no steps/{name}/instruction.md (the step's prompt)")
    instruction = read_task_text(folder, f"steps/{name}/instruction.md", max_bytes)
    env = read_env(entry.get("verifier", {}).get("env", {}), f"[[steps]] {name!r} verifier.env")
    workdir = home / "workdir" if (home / "workdir").is_dir() else None
    task_tests, step_tests = folder / "tests", home / "tests"
    layers = tuple(p for p in (task_tests, step_tests) if p.is_dir())
    script = next((p / "test.sh" for p in (step_tests, task_tests)
                   if (p / "test.sh").is_file()), None)
    agent, verifier = entry.get("agent", {}), entry.get("verifier", {})
    settings = {setting: _positive(table["timeout_sec"], f"{phase}.timeout_sec", label)
                for phase, table, setting in (("agent", agent, "timeout_s"),
                                              ("verifier", verifier, "verifier_timeout_s"))
                if "timeout_sec" in table}
    return Step(
        name=name, index=index, instruction=instruction, folder=home, workdir=workdir,
        setup=(workdir / "setup.sh" if workdir is not None
               and (workdir / "setup.sh").is_file() else None),
        tests=layers, test_script=script,
        solution=home / "solution" if (home / "solution").is_dir() else None,
        min_reward=_min_reward(entry.get("min_reward"), label),
        settings=settings,
        users={phase: _user(table["user"], f"{phase}.user", label)
               for phase, table in (("agent", agent), ("verifier", verifier))
               if table.get("user") is not None},
        network_modes={phase: mode for phase, table in (("agent", agent), ("verifier", verifier))
                       if (mode := phase_mode(table, f"steps.{phase}", label)) is not None},
        verifier_env=env.values, secrets=env.secrets,
        healthcheck=(Healthcheck.parse(entry["healthcheck"], where,
                                       f"[[steps]] {name!r} healthcheck")
                     if entry.get("healthcheck") is not None else None),
    )


def _min_reward(value: Any, label: str) -> dict[str, float] | None:
    """`min_reward` as key → threshold: a number gates `reward` (Harbor's 1-D convention)."""
    if value is None:
        return None
    if _number(value):
        return {"reward": float(value)}
    if isinstance(value, dict) and value and all(
            isinstance(k, str) and _number(v) for k, v in value.items()):
        return {k: float(v) for k, v in value.items()}
    raise wrong_type(label, "min_reward", value, "a number or a table of key = number")


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _positive(value: Any, name: str, label: str) -> float:
    if not _number(value) or value <= 0:
        raise wrong_type(label, name, value, "a positive number")
    return float(value)


def _user(value: Any, name: str, label: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise wrong_type(label, name, value, "a user name, a uid, uid:gid or name:group")
    return str(value)
