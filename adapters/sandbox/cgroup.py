"""A cgroup of each session's own: its process limit always, its task's limits when asked
(SPEC §11 "Processes per session", §12 "Limits").

Every sandbox gets a `pids.max` of its own (the task's `pids`, else `DEFAULT_PIDS`), so one
agent's processes never limit another's: the sandbox user's `RLIMIT_NPROC` counts every
session of that uid together, and an agent that filled it made other runners' sandboxes
fail to start. Where the host delegates a writable cgroup v2 folder to the runner (named
by `TRIALLEDGER_CGROUP`; with systemd, a unit with `Delegate=yes`), the session's cgroup
is made below it; else a root runner uses the cgroup v1 hierarchies the host mounts, one
cgroup per hierarchy under a `trialledger` folder inside the runner's own cgroup (so the
sandbox stays inside whatever holds the runner). The limits are written before anything
joins; our init joins every one of them before bwrap starts; at the end whatever is left
inside is killed and the cgroups removed. The runner never moves itself: it embeds in
other services.

A Dockerfile build gets one too (`BuildCgroup`, SPEC §12 "A build is contained"):
pids, memory and — in cgroup v1 — the freezer, so that everything it started, however it
forked, detached or re-parented, is ended at once: frozen, killed, thawed (v2: cgroup.kill).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DELEGATED_ENV = "TRIALLEDGER_CGROUP"
CPU_PERIOD_US = 100_000
CONTROLLERS = {"cpus": "cpu", "memory_mb": "memory", "pids": "pids"}
DEFAULT_PIDS = 4096  # a session's processes and threads when its task names no `pids`
V1_PARENT = "trialledger"
BUILD_PREFIX = "trialledger-build-"  # a build's cgroup: BUILD_PREFIX + its id
BUILD_CONTROLLERS = ("pids", "memory", "freezer")  # a build's v1 hierarchies, all needed
BUILD_PIDS = 4096  # a build's least pids.max (a task's larger `pids` raises it)
BUILD_MEMORY_MB = 4096.0  # a build's memory when its task names no `memory_mb`

log = logging.getLogger(__name__)


class LimitsNotEnforced(Exception):
    """Why a session's limits cannot be enforced here (the message is recorded)."""


def settings(requested: Mapping[str, float]) -> dict[str, str]:
    """The cgroup v2 interface files and values that enforce `requested` (pure)."""
    files: dict[str, str] = {}
    if (cpus := requested.get("cpus")) is not None:
        files["cpu.max"] = f"{_quota(cpus)} {CPU_PERIOD_US}"
    if (memory_mb := requested.get("memory_mb")) is not None:
        files["memory.max"] = str(round(memory_mb * 1024 * 1024))
        files["memory.swap.max"] = "0"
    if (pids := requested.get("pids")) is not None:
        files["pids.max"] = str(int(pids))
    return files


def settings_v1(requested: Mapping[str, float]) -> dict[str, dict[str, str]]:
    """The cgroup v1 files, per controller, that enforce `requested`, in writing order
    (pure): the period before the quota, the memory limit before memory+swap."""
    files: dict[str, dict[str, str]] = {}
    if (cpus := requested.get("cpus")) is not None:
        files["cpu"] = {"cpu.cfs_period_us": str(CPU_PERIOD_US),
                        "cpu.cfs_quota_us": str(_quota(cpus))}
    if (memory_mb := requested.get("memory_mb")) is not None:
        limit = str(round(memory_mb * 1024 * 1024))
        files["memory"] = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
    if (pids := requested.get("pids")) is not None:
        files["pids"] = {"pids.max": str(int(pids))}
    return files


def _quota(cpus: float) -> int:
    return max(1_000, round(cpus * CPU_PERIOD_US))  # the kernel's least quota is 1 ms


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """(root inside its file system, mount point, file system type, super options) of
    every mount of this process."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            after = fields[fields.index("-") + 1:]
            found.append((_unescape(fields[3]), _unescape(fields[4]), after[0],
                          after[2].split(",") if len(after) > 2 else []))
    return found


def _fstype(path: Path) -> str | None:
    """The file system type of the mount that holds `path`."""
    best, fstype = "", None
    for _, point, kind, _ in _mounts():
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, kind
    return fstype


def delegated(environ: Mapping[str, str] = os.environ) -> Path:
    """The cgroup v2 folder delegated to the runner, or `LimitsNotEnforced` saying why
    there is none."""
    named = environ.get(DELEGATED_ENV)
    if not named:
        raise LimitsNotEnforced(f"no cgroup v2 folder is delegated to the runner "
                                f"({DELEGATED_ENV} is unset)")
    folder = Path(os.path.realpath(named))
    if _fstype(folder) != "cgroup2" or not (folder / "cgroup.subtree_control").is_file():
        raise LimitsNotEnforced(f"{DELEGATED_ENV}={named} is not a cgroup v2 folder")
    if not os.access(folder, os.W_OK):
        raise LimitsNotEnforced(f"the cgroup {folder} is not writable by the runner")
    return folder


def v1_hierarchies(controllers: Collection[str] = tuple(CONTROLLERS.values())
                   ) -> dict[str, Path]:
    """Controller → the runner's own cgroup folder in each mounted cgroup v1 hierarchy
    that has one of `controllers` (empty when not root: those cgroups are root's)."""
    if os.geteuid() != 0:
        return {}
    own: dict[str, str] = {}
    with open("/proc/self/cgroup", encoding="utf-8") as lines:
        for line in lines:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                own[name] = path
    found: dict[str, Path] = {}
    for root, point, kind, options in _mounts():
        for controller in set(controllers) & set(options):
            mine = own.get(controller)
            if kind != "cgroup" or mine is None or controller in found:
                continue
            if mine == root or mine.startswith(root.rstrip("/") + "/"):
                found[controller] = Path(point) / mine[len(root):].lstrip("/")
    return {name: folder for name, folder in found.items() if os.access(folder, os.W_OK)}


def _enable(parent: Path, controllers: set[str]) -> None:
    """Make `controllers` available to `parent`'s children (a delegated cgroup with no
    processes of its own may enable them; otherwise they must be on already)."""
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    missing = controllers - enabled
    if not missing:
        return
    available = set((parent / "cgroup.controllers").read_text().split())
    if missing - available:
        raise LimitsNotEnforced(f"the cgroup {parent} has no "
                                f"{', '.join(sorted(missing - available))} controller")
    try:
        (parent / "cgroup.subtree_control").write_text(
            " ".join(f"+{name}" for name in sorted(missing)))
    except OSError as error:
        raise LimitsNotEnforced(f"cannot enable {', '.join(sorted(missing))} for the "
                                f"children of {parent}: {error.strerror}") from None


def _make(folder: Path, files: Mapping[str, str]) -> None:
    """A new cgroup at `folder` with `files` written (a file the kernel lacks, such as
    swap accounting, is skipped: there is nothing to escape through)."""
    try:
        folder.mkdir()
    except OSError as error:
        raise LimitsNotEnforced(f"cannot create a session cgroup at {folder}: "
                                f"{error.strerror}") from None
    try:
        for name, value in files.items():
            if name in ("memory.swap.max", "memory.memsw.limit_in_bytes") \
                    and not (folder / name).exists():
                continue
            (folder / name).write_text(value)
    except OSError as error:
        _remove(folder, 0)
        raise LimitsNotEnforced(f"cannot write the limits of {folder}: "
                                f"{error.strerror}") from None


@dataclass(frozen=True)
class SessionCgroup:
    """One session's cgroups (one folder per hierarchy): every process of its sandbox runs
    inside all of them. `held` names the limits they enforce (keys of `CONTROLLERS`)."""

    paths: tuple[Path, ...]
    held: frozenset[str]

    @property
    def procs(self) -> tuple[Path, ...]:
        """The files a process writes 0 to, to join."""
        return tuple(path / "cgroup.procs" for path in self.paths)

    @classmethod
    def create(cls, requested: Mapping[str, float], session_key: str,
               environ: Mapping[str, str] = os.environ) -> SessionCgroup:
        """A new cgroup under the delegated cgroup v2 folder, its limits written before
        anyone joins."""
        parent = delegated(environ)
        _enable(parent, {CONTROLLERS[key] for key in requested if key in CONTROLLERS})
        path = parent / _name(session_key)
        _make(path, settings(requested))
        return cls((path,), frozenset(requested) & set(CONTROLLERS))

    @classmethod
    def create_v1(cls, requested: Mapping[str, float], session_key: str,
                  hierarchies: Mapping[str, Path]) -> SessionCgroup:
        """New cgroups in the v1 `hierarchies` (controller → the runner's own folder) for
        the `requested` limits they can hold (each under a `trialledger` folder)."""
        made: list[Path] = []
        name = _name(session_key)
        try:
            for controller, files in settings_v1(requested).items():
                if controller not in hierarchies:
                    continue
                parent = hierarchies[controller] / V1_PARENT
                with contextlib.suppress(FileExistsError):
                    parent.mkdir()
                _make(parent / name, files)
                made.append(parent / name)
        except LimitsNotEnforced:
            for path in made:
                _remove(path, 0)
            raise
        held = {key for key, controller in CONTROLLERS.items()
                if key in requested and controller in hierarchies}
        return cls(tuple(made), frozenset(held))

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill whatever is left inside, then remove the cgroups (once they are empty)."""
        for path in self.paths:
            _remove(path, timeout_s)


def hold(requested: Mapping[str, float], session_key: str,
         environ: Mapping[str, str] = os.environ) -> tuple[SessionCgroup | None, str | None]:
    """The session's cgroups for `requested` plus a process limit (the task's `pids`,
    else `DEFAULT_PIDS`): the delegated cgroup v2 folder's when there is one with every
    controller, else (root) the cgroup v1 hierarchies'. Also why a limit asked for, or the
    session's own process limit, is not enforced (None: everything holds)."""
    wanted = {"pids": float(DEFAULT_PIDS),
              **{k: v for k, v in requested.items() if k in CONTROLLERS}}
    try:
        return SessionCgroup.create(wanted, session_key, environ), None
    except LimitsNotEnforced as why:
        reason = str(why)
    hierarchies = v1_hierarchies()
    cgroup = None
    if any(CONTROLLERS[key] in hierarchies for key in wanted):
        try:
            cgroup = SessionCgroup.create_v1(wanted, session_key, hierarchies)
        except LimitsNotEnforced as why:
            reason = f"{reason}; {why}"
    missing = sorted(set(wanted) - (cgroup.held if cgroup is not None else set()))
    if not missing:
        return cgroup, None
    if missing == ["pids"] and "pids" not in requested:
        return cgroup, (f"no pids controller for the session ({reason}): the sandbox "
                        f"user's process limit is shared by this runner's sessions")
    if os.geteuid() == 0:
        reason = f"{reason}; no cgroup v1 hierarchy holds {', '.join(missing)}"
    return cgroup, reason


def _name(owner: str) -> str:
    """A session's cgroup name: its session folder's name, then 8 hex digits (so a sweep
    finds whether its runner still holds the folder: adapters/sandbox/leftovers.py)."""
    return f"{owner}-{uuid.uuid4().hex[:8]}"


def remove_cgroup(path: Path, timeout_s: float = 2.0) -> int:
    """Kill what is left in the cgroup `path` and remove it; 1 when it is gone, else 0."""
    _remove(path, timeout_s)
    return 0 if path.exists() else 1


def _remove(path: Path, timeout_s: float) -> None:
    """Kill every process in the cgroup `path` (cgroup.kill in v2; each listed process in
    v1), then remove it once it is empty."""
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("the cgroup %s is left behind: %s", path, error.strerror)
                return
            time.sleep(0.01)


@dataclass(frozen=True)
class BuildCgroup:
    """One build's cgroup (a folder per v1 hierarchy of `BUILD_CONTROLLERS`, else one in
    the delegated v2 folder). Its first process joins before it execs anything, so all
    the build starts stays inside and `end` kills it whole."""

    paths: tuple[Path, ...]
    freezer: Path | None  # the v1 freezer folder; None: cgroup v2, ended by cgroup.kill

    @property
    def name(self) -> str:
        """The cgroup's own name, unique to the build."""
        return self.paths[0].name

    @classmethod
    def create(cls, build_id: str, *, pids: int, memory_mb: float,
               environ: Mapping[str, str] = os.environ) -> BuildCgroup:
        """A new cgroup for the build `build_id`, its limits written (LimitsNotEnforced:
        none can be made here, saying why)."""
        requested = {"pids": float(pids), "memory_mb": memory_mb}
        name = f"{BUILD_PREFIX}{build_id}"
        try:
            parent = delegated(environ)
            _enable(parent, {"pids", "memory"})
            _make(parent / name, settings(requested))
            return cls((parent / name,), None)
        except LimitsNotEnforced as why:
            reason = str(why)
        hierarchies = v1_hierarchies(BUILD_CONTROLLERS)
        if missing := [c for c in BUILD_CONTROLLERS if c not in hierarchies]:
            raise LimitsNotEnforced(f"{reason}; and no cgroup v1 hierarchy of a root runner "
                                    f"holds {', '.join(missing)}")
        files = {**settings_v1(requested), "freezer": {}}
        made: list[Path] = []
        try:
            for controller in BUILD_CONTROLLERS:
                parent = hierarchies[controller] / V1_PARENT
                with contextlib.suppress(FileExistsError):
                    parent.mkdir()
                _make(parent / name, files[controller])
                made.append(parent / name)
        except LimitsNotEnforced:
            for path in made:
                _remove(path, 0)
            raise
        return cls(tuple(made), made[-1])

    @classmethod
    def existing(cls, paths: Sequence[Path]) -> BuildCgroup:
        """A build cgroup made earlier (its folders in each hierarchy), to be ended."""
        freezer = next((p for p in paths if (p / "freezer.state").exists()), None)
        return cls(tuple(paths), freezer)

    def join(self, pid: int) -> None:
        """Move `pid` (a process that has started nothing yet) into the cgroup."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(pid))

    def members(self) -> set[int]:
        """The processes inside now."""
        found: set[int] = set()
        for path in self.paths:
            with contextlib.suppress(OSError):
                found.update(int(pid) for pid in (path / "cgroup.procs").read_text().split())
        return found

    def kill(self, timeout_s: float = 10.0) -> bool:
        """Kill everything inside at once and wait (up to `timeout_s`) until nothing is
        left; whether it emptied. v1: frozen first, so nothing forks or exits while each
        one is sent SIGKILL, then thawed so they die; v2: cgroup.kill."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.freezer is None:
                with contextlib.suppress(OSError):
                    (self.paths[0] / "cgroup.kill").write_text("1")
            else:
                _freeze(self.freezer, "FROZEN", deadline)
                for pid in self.members():  # frozen: no pid of these is reused meanwhile
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                _freeze(self.freezer, "THAWED", deadline)
            settle = min(deadline, time.monotonic() + 1.0)
            while self.members() and time.monotonic() < settle:
                time.sleep(0.01)
            if not self.members():
                return True
            if time.monotonic() >= deadline:
                return False

    def end(self, timeout_s: float = 10.0) -> None:
        """Kill everything inside, then remove the cgroup (left, with a warning, when it
        does not empty within `timeout_s`)."""
        if not self.kill(timeout_s):
            log.warning("the build cgroup %s still holds %s", self.name,
                        sorted(self.members()))
        for path in self.paths:
            _remove(path, 0)


def _freeze(freezer: Path, state: str, deadline: float) -> None:
    """Write `state` to a v1 freezer and wait (until `deadline`) until it holds."""
    with contextlib.suppress(OSError):
        (freezer / "freezer.state").write_text(state)
        while (freezer / "freezer.state").read_text().strip() != state \
                and time.monotonic() < deadline:
            time.sleep(0.005)


def runner_parents() -> Iterator[Path]:
    """Where this runner's sessions and builds make their cgroups: the delegated v2
    folder, and a `trialledger` folder in each v1 hierarchy the runner is in."""
    with contextlib.suppress(LimitsNotEnforced):
        yield delegated()
    for hierarchy in v1_hierarchies(("pids", "memory", "cpu", "freezer")).values():
        yield hierarchy / V1_PARENT


def build_cgroups() -> list[BuildCgroup]:
    """Every build cgroup here, one per build (its folders in each hierarchy)."""
    found: dict[str, list[Path]] = {}
    for parent in runner_parents():
        with contextlib.suppress(OSError):
            for child in parent.iterdir():
                if child.name.startswith(BUILD_PREFIX) and child.is_dir():
                    found.setdefault(child.name, []).append(child)
    return [BuildCgroup.existing(paths) for paths in found.values()]
