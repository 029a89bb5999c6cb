"""The oracle and nop agents (docs/SPEC.md §15), Harbor's `-a oracle` and `-a nop`.

`oracle` runs the task's own `solution/solve.sh` in the sandbox instead of Codex: no
model, no proxy, no grants. The solution is copied to `/solution` over an image (its
session layer) and to `<session folder>/solution` for a host task, whose sandbox has no
`/solution` of its own; it runs as Harbor's does (`agents/oracle.py`, `utils/scripts.py`):
made executable, then `bash -c '(/solution/solve.sh) > /logs/agent/oracle.txt 2>&1'` (`sh`
over an image without bash), so a shebang is honoured and a script without one runs under
bash. Its output goes to `/logs/agent/oracle.txt` over an image, `<session
folder>/oracle.txt` for a host task, and is kept, scrubbed, as `agent/oracle.txt` in the
session's artifact folder. `nop` runs nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trialledger.adapters.sandbox.agentfiles import UnsafeAgentFile
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.session.capture import MAX_KEPT_BYTES, keep_text
from trialledger.adapters.tasks.steps import Step
from trialledger.adapters.tasks.task import Task, TaskInvalid
from trialledger.core.errors import TrialLedgerError

AGENTS = ("codex", "oracle", "nop")
SCRIPTED = frozenset({"oracle", "nop"})  # as core.policy.SCRIPTED_AGENTS: decided by R0
VERSION = "1.0.0"  # Harbor's OracleAgent.version() and NopAgent.version()
ORACLE_LOG = "oracle.txt"
KEPT_LOG = f"agent/{ORACLE_LOG}"  # where it is kept, in the session's artifact folder
TAIL_BYTES = 64 * 1024  # as much of oracle.txt as of Codex's stderr (redact cuts further)
NO_CONFIG = hashlib.sha256(b"").hexdigest()  # `agent.launched.config_sha256`: no config.toml


class NoSolution(TaskInvalid):
    """A task the oracle cannot run: it has no `solution/solve.sh`."""


class UnknownAgent(TrialLedgerError):
    """An agent other than codex, oracle or nop."""


def solve_script(task: Task, step: Step | None = None) -> Path:
    """The task's `solution/solve.sh` (`NoSolution` when it has none); of a multi-step task,
    `step`'s: its own `steps/<name>/solution/`, else the task's (docs/SPEC.md §17) — and
    with no `step` named, every step is checked."""
    if step is None and task.steps:
        scripts = [solve_script(task, each) for each in task.steps]
        return scripts[0]
    folder = step.solution if step is not None and step.solution is not None \
        else task.folder / "solution"
    script = folder / "solve.sh"
    if not script.is_file():
        which = f"step {step.name!r}: " if step is not None else ""
        shown = script.relative_to(task.folder)
        raise NoSolution(f"{task.folder}: {which}no {shown}, which the oracle agent runs")
    return script


@dataclass(frozen=True)
class OraclePlaces:
    """Where the oracle's files are, on the host and as the sandbox sees them."""

    solution: Path  # the copy of `solution/` (host)
    solution_inside: str
    log_tree: Path  # a folder the harness made, from which `log` is read safely (host)
    log: str  # oracle.txt, relative to `log_tree`
    log_inside: str


def oracle_places(sandbox: LocalSandbox) -> OraclePlaces:
    """Over an image, `/solution` and `/logs/agent/oracle.txt` in the session's layer (as in
    Harbor's container); for a host task, both in the session folder."""
    if sandbox.image is not None:  # always under bwrap, over the session's overlay
        layer = sandbox.root / "upper"
        return OraclePlaces(layer / "solution", "/solution", layer,
                            f"logs/agent/{ORACLE_LOG}", f"/logs/agent/{ORACLE_LOG}")
    home = sandbox.session_dir
    return OraclePlaces(home / "solution", str(home / "solution"), home, ORACLE_LOG,
                        str(home / ORACLE_LOG))


async def place_solution(task: Task, sandbox: LocalSandbox, step: Step | None = None
                         ) -> OraclePlaces:
    """Copy `solution/` (`step`'s, of a multi-step task) into the sandbox, its `solve.sh`
    executable (Harbor's `chmod +x`), owned by the sandbox user, with an empty folder for
    `oracle.txt`; an earlier step's copy is replaced. Into a container already running (a
    later step's) it is copied by its root, as Harbor's `upload_dir` (`docker cp`) does —
    never written beneath a mounted overlay."""
    script = solve_script(task, step)
    places = oracle_places(sandbox)
    if sandbox.container is not None:
        staged = sandbox.root / "solution-staged"
        _copy_solution(script.parent, staged)
        try:
            await sandbox.copy_into(staged, places.solution_inside, user=None, merge=False)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        return places
    _copy_solution(script.parent, places.solution)
    logs = (places.log_tree / places.log).parent
    logs.mkdir(parents=True, exist_ok=True)
    sandbox.give(places.solution)
    for folder in [logs, *logs.parents]:
        if folder == places.log_tree:
            break
        sandbox.give(folder)
    return places


def _copy_solution(source: Path, target: Path) -> None:
    """`source` copied to `target` (what was there replaced), its `solve.sh` executable."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, symlinks=True)
    solve = target / "solve.sh"
    solve.chmod(stat.S_IMODE(solve.stat().st_mode) | 0o111)


def oracle_argv(places: OraclePlaces, sandbox: LocalSandbox) -> list[str]:
    """`solve.sh` run as Harbor runs it, its stdout and stderr together into oracle.txt."""
    shell = "bash" if sandbox.image is None or sandbox.image.has("bash") else "sh"
    return [shell, "-c", '("$0") > "$1" 2>&1', f"{places.solution_inside}/solve.sh",
            places.log_inside]


def oracle_env(task: Task, sandbox: LocalSandbox) -> dict[str, str]:
    """The image's `Env` < `[environment] env` < `DEBIAN_FRONTEND=noninteractive` <
    `[solution] env` (Harbor's oracle); HOME the image's, else the session folder (as
    Codex's), unless a table sets it."""
    env = sandbox.base_env()
    env["HOME"] = str(sandbox.session_dir)
    if (image := sandbox.image) is not None:
        env.update(image.phase_env())
    return {**env, **sandbox.task_env, "DEBIAN_FRONTEND": "noninteractive",
            **task.solution_env}


def oracle_output(sandbox: LocalSandbox, places: OraclePlaces
                  ) -> tuple[str, bool, UnsafeAgentFile | None]:
    """oracle.txt's last `TAIL_BYTES` (read as a file the agent controls), whether more was
    cut, and why it could not be read (None: it was)."""
    tree = sandbox.agent_files(places.log_tree)
    try:
        raw = tree.tail(places.log, TAIL_BYTES + 1)
    except UnsafeAgentFile as error:
        return "", False, error
    return raw[-TAIL_BYTES:].decode("utf-8", errors="replace"), len(raw) > TAIL_BYTES, None


def keep_oracle_log(sandbox: LocalSandbox, places: OraclePlaces, folder: Path,
                    secrets: Sequence[str]) -> dict[str, Any] | None:
    """oracle.txt (read as a file the agent controls, at most its last 16 MiB), scrubbed,
    as `agent/oracle.txt` in the session's artifact folder `folder`, where Harbor's trial
    folder has it, empty too; its `files` entry (None: there was none to read, or it was
    unsafe — `agent.stderr`'s read already said so)."""
    tree = sandbox.agent_files(places.log_tree)
    try:
        raw = tree.tail(places.log, MAX_KEPT_BYTES + 1)
        whole = tree.lstat(places.log) if len(raw) > MAX_KEPT_BYTES else None
    except UnsafeAgentFile:
        return None
    kept = raw[-MAX_KEPT_BYTES:]
    size = max(len(raw), whole.st_size if whole is not None else 0)
    return keep_text(folder, KEPT_LOG, kept, size - len(kept), secrets, empty=True)
