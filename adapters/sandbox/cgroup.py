"""Resource limits with cgroup v2 (SPEC §12).

Where the host delegates a writable cgroup v2 folder to the runner (named by
`TRIALLEDGER_CGROUP`; with systemd, a unit with `Delegate=yes` whose runner process lives
in a child), each session that asks for `cpus`, `memory_mb` or `pids` gets a cgroup of its
own below it: `cpu.max`, `memory.max` (and `memory.swap.max` 0, so swap does not lift the
limit) and `pids.max` are written before anything starts, every process of the sandbox
starts inside it (our init joins it before bwrap), and it is killed and removed with the
session. Elsewhere nothing is moved or created, and the session records why its limits
were not enforced. The runner never moves itself: it embeds in other services.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DELEGATED_ENV = "TRIALLEDGER_CGROUP"
CPU_PERIOD_US = 100_000
CONTROLLERS = {"cpus": "cpu", "memory_mb": "memory", "pids": "pids"}

log = logging.getLogger(__name__)


class LimitsNotEnforced(Exception):
    """Why a session's limits cannot be enforced here (the message is recorded)."""


def settings(requested: Mapping[str, float]) -> dict[str, str]:
    """The cgroup v2 interface files and values that enforce `requested` (pure)."""
    files: dict[str, str] = {}
    if (cpus := requested.get("cpus")) is not None:
        quota = max(1_000, round(cpus * CPU_PERIOD_US))  # the kernel's least quota is 1 ms
        files["cpu.max"] = f"{quota} {CPU_PERIOD_US}"
    if (memory_mb := requested.get("memory_mb")) is not None:
        files["memory.max"] = str(round(memory_mb * 1024 * 1024))
        files["memory.swap.max"] = "0"
    if (pids := requested.get("pids")) is not None:
        files["pids.max"] = str(int(pids))
    return files


def _fstype(path: Path) -> str | None:
    """The file system type of the mount that holds `path` (from /proc/self/mountinfo)."""
    best, fstype = "", None
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, fstype = point, fields[fields.index("-") + 1]
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


@dataclass(frozen=True)
class SessionCgroup:
    """One session's cgroup: every process of its sandbox runs inside."""

    path: Path

    @property
    def procs(self) -> Path:
        """The file a process writes 0 to, to join."""
        return self.path / "cgroup.procs"

    @classmethod
    def create(cls, requested: Mapping[str, float], session_key: str,
               environ: Mapping[str, str] = os.environ) -> SessionCgroup:
        """A new cgroup under the delegated one, its limits written before anyone joins."""
        parent = delegated(environ)
        _enable(parent, {CONTROLLERS[key] for key in requested if key in CONTROLLERS})
        path = parent / f"trialledger-{session_key[:16]}-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
        except OSError as error:
            raise LimitsNotEnforced(f"cannot create a session cgroup under {parent}: "
                                    f"{error.strerror}") from None
        group = cls(path)
        try:
            for name, value in settings(requested).items():
                if name == "memory.swap.max" and not (path / name).exists():
                    continue  # a kernel without swap accounting: no swap to escape through
                (path / name).write_text(value)
        except OSError as error:
            group.remove()
            raise LimitsNotEnforced(f"cannot write the limits of {path}: "
                                    f"{error.strerror}") from None
        return group

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill whatever is left inside, then remove the cgroup (once it is empty)."""
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as error:
                if error.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("the session cgroup %s is left behind: %s", self.path,
                                error.strerror)
                    return
                time.sleep(0.01)
