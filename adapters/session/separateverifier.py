"""The separate verifier's phase (docs/SPEC.md §17 "Separate verifier"), as Harbor 0.26's
`trial/single_step.py` and `trial/trial.py` (`_run_separate_verifier`) run it; what it
runs in is adapters/tasks/verifiermode.py's.

Once the task's artifacts are kept (adapters/tasks/artifacts.py), the agent's container is
stopped and its sandbox discarded: every process in it ends, its layer goes, its slot is
freed — except after a step of a multi-step task other than the last, whose container the
next step goes on in (Harbor stops the agent's environment on the last step only). Then a
fresh container of the verifier's image starts in a new slot (a sandbox of its own,
`verifier_isolation = harbor`), the declared artifacts are copied in from their kept
copies at their source paths (`/logs/artifacts` too: Harbor's convention entry), and
`test.sh` (a step's: its tests merged over the task's) runs there as a shared verifier's
does (the runner's `_verify`): its files kept as §15 keeps them. Nothing else of the
agent's container is there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from trialledger.adapters.images.environment import Environment
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.tasks.artifacts import FOLDER, Artifact

if TYPE_CHECKING:
    from trialledger.adapters.tasks.task import Task
    from trialledger.adapters.tasks.verifiermode import SeparateVerifier


async def stop_agent(sandbox: LocalSandbox) -> None:
    """The agent's container stopped and its sandbox discarded before the verifier's
    starts, as Harbor stops the agent's environment first (shielded: never left half)."""
    with anyio.CancelScope(shield=True):
        await sandbox.close()
        await anyio.to_thread.run_sync(sandbox.discard)


@contextlib.contextmanager
def tests_kept_apart(sandbox: LocalSandbox) -> Iterator[Path | None]:
    """The agent's sandbox's tests (a step's, staged in its folder) where the agent's
    sandbox going away leaves them: staged inside its folder, they are copied out for the
    block (a private temporary folder, removed after); elsewhere (the task's), as they
    are."""
    tests = sandbox.tests
    if tests is None or not tests.is_relative_to(sandbox.root):
        yield tests
        return
    apart = Path(tempfile.mkdtemp(prefix="trialledger-step-tests-"))
    try:
        shutil.copytree(tests, apart / "tests", symlinks=True)
        yield apart / "tests"
    finally:
        shutil.rmtree(apart, ignore_errors=True)


def verifier_sandbox(task: Task, environment: Environment, *, runtime: str | None,
                     switch: DeadManSwitch | None, sandbox_uid: int | None = None,
                     tests: Path | None = None) -> LocalSandbox:
    """The verifier's own container (not started yet): its image, workdir, `env`, limits
    and network as verifiermode resolved them, `[verifier] user`, `tests` (a step's merged
    tests; default the task's) unless its image holds them, the task's workspace over the
    task's own image."""
    separate = task.separate_verifier
    if separate is None or environment.root is None:
        raise SandboxRefused(f"{task.name}: no separate verifier's image was prepared "
                             f"(verifiermode.prepare_task prepares it)")
    modes = {"healthcheck": separate.network_mode, "agent": separate.network_mode,
             "verifier": separate.phase_mode}
    return LocalSandbox(
        session_key=str(uuid.uuid4()),  # a container of its own: its own hostname
        workdir=separate.workdir or environment.workdir,
        workspace=task.workspace if separate.source is None else None,
        tests=None if separate.bundled else tests or task.tests,
        protected_paths=[task.folder],
        runtime=runtime,
        no_new_privileges=task.no_new_privileges,
        sandbox_uid=sandbox_uid,
        network=Network(None, isolated=True, outward=separate.phase_mode == "public"),
        environment=environment,
        limits=separate.limits,
        users=_users(task, separate),
        switch=switch,
        lifetime="harbor",
        task_env=separate.env,
        allowed_hosts=task.allowed_hosts if separate.phase_mode == "allowlist" else None,
        network_modes=modes,
        compose=separate.compose)


def _users(task: Task, separate: SeparateVerifier) -> dict[str, str]:
    """The verifier's user: `[verifier] user`, else its compose file's `main`'s (as Harbor's
    exec without a user runs as the container's), else its image's."""
    if "verifier" in task.users:
        return {"verifier": task.users["verifier"]}
    main = separate.compose.main if separate.compose is not None else None
    return {"verifier": main.user} if main is not None and main.user is not None else {}


def bring_artifacts(verifier: LocalSandbox, entries: Sequence[Artifact], kept: Path,
                    modes: Mapping[str, int]) -> None:
    """Each declared artifact kept in `kept` (the session's artifact folder) staged to be
    copied into the verifier's container at its source path, as Harbor's `upload_artifacts`
    re-materialises them ("no translation"); one that was not kept is left out. Owned by
    root, each file with the bits `modes` recorded in the agent's sandbox as Harbor's copy
    leaves them (`harbor_mode`), each folder 0755 — as `docker cp` leaves a folder it copies
    the contents of a fresh folder into — and a file's folder 0777 (init's copy-in: Harbor's
    `chmod 777` of it before the file's copy)."""
    for entry in entries:
        if not entry.kept:
            continue  # the whole of `/`: never placed over the verifier's root
        host = kept / FOLDER / entry.kept
        if host.is_symlink() or not (host.is_file() or host.is_dir()):
            continue
        placed = {"": harbor_mode(modes.get(str(host.relative_to(kept))))}
        if host.is_dir():  # (our own copy: no links in it)
            placed[""] = 0o755  # (Harbor's `chmod 777` of it is undone by its `docker cp`)
            for folder, names, files in os.walk(host):
                below = Path(folder).relative_to(host)
                placed.update({str(below / name): 0o755 for name in names})
                placed.update({str(below / name): harbor_mode(modes.get(str(
                    (Path(folder) / name).relative_to(kept)))) for name in files})
        verifier.bring_in(host, "/" + "/".join(p for p in entry.source.split("/")
                                                if p not in ("", ".", "..")), placed)


def harbor_mode(bits: int | None) -> int:
    """A file's mode once Harbor has copied it into a separate verifier: its tar `data`
    filter over the bits it had in the agent's sandbox — no setuid, setgid or sticky bit,
    no write for group or others, no execute unless the owner's, read and write for the
    owner always (0644 when the bits are not known)."""
    if bits is None:
        return 0o644
    mode = bits & 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600
