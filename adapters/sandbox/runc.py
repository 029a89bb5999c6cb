"""A range-mode session's container on an OCI runtime, runc (docs/SPEC.md §16).

The OCI runtime `setup` found able (runc, else crun; `--runtime` names one) starts the
container of an image or rootfs session (`verifier_isolation = harbor`) with `runc run`
(crun takes the same command line), where bwrap started it before (`--runtime bwrap`
still does); everything else of the session (its slot, cgroup, layer, phases) is as under
bwrap. How it is put together (written and tested for runc: crun cannot start a
container on these machines):
- **Root.** runc itself is started by our init (`init --stage --mount-ns --exec-suid
  --idmap ...`): in a private mount namespace of its own the image's cache entry is
  mounted idmapped onto the slot and the session's overlay over it, both without `nosuid`
  (a setuid file is setuid to the slot's ids only), and the sources the slot may not read
  (Codex, granted paths) are bound read-only onto staging points. runc inherits that
  namespace, so `root.path` is the merged overlay and the binds come from the staging
  points, as bwrap's did. runc runs in the foreground (its exit is the container's end);
  `--pid-file` names PID 1.
- **Namespaces.** The session's user namespace and the network namespace the runner made
  inside it (`init --userns ID --net`, its loopback up) are joined by path
  (`/proc/<runner>/fd/N`); pid, mount, ipc and uts are new. The maps are written equal
  (runc 1.1 wants them).
- **Process.** PID 1 is our init as inner root, switching the ENTRYPOINT's process to its
  user; Docker's capabilities, Docker's seccomp profile (`oci.docker_seccomp`), no
  `no_new_privs`; its environment only in `config.json` (0600, in a 0700 bundle). Two
  pipes reach it (`--preserve-fds`): a lifeline only the runner writes to (descriptor 3;
  at its end-of-file PID 1 ends the container: runc's container does not die with its
  runner as bwrap's `--die-with-parent` sandbox did) and a job's lease (4). A crashed
  runner's containers are deleted by the sweep of its session folders (`delete_left`).
- **cgroups.** runc runs in the session's cgroups (our init joins them first) and puts the
  container in a child of its own there (a relative `cgroupsPath`): the session's limits
  hold it, and `runc delete` removes the child.
- **Phases.** Each phase's process still joins with `init --join-fds` (status report,
  process-group kill, deadline as before), without `no_new_privs` (`--new-privs`), with
  Docker's profile compiled to BPF by `ocifilter.py` from the same conversion PID 1's
  `config.json` holds (runc's own compilation differs in one way: runc makes a syscall
  newer than its libseccomp knows fail with ENOSYS, ours with the default EPERM).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.sandbox.bwrap import Mount
from trialledger.adapters.sandbox.hostside import find, host_env, program
from trialledger.adapters.sandbox.oci import Bind

RUNTIMES = ("runc", "crun", "bwrap")  # what starts a range-mode session's container
OCI = ("runc", "crun")  # of those, the OCI runtimes (`ociruntime.RUNTIMES`)
STATE = "runc-state"  # runc's `--root`, in the session folder
STATES = {"runc": STATE, "crun": "crun-state"}
DELETE_S = 10.0
LOG_TAIL = 300


class RuntimeUnknown(ValueError):
    """A `--runtime` that is not one of `RUNTIMES`."""


def check_runtime(runtime: str) -> str:
    """`runtime` when it is one range mode can use (RuntimeUnknown: it is not)."""
    if runtime not in RUNTIMES:
        raise RuntimeUnknown(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    return runtime


def default_runtime() -> str | None:
    """What starts a range-mode container when no `--runtime` is given: the OCI runtime
    `setup` found able to start one here (None: none can; range mode is unavailable)."""
    from trialledger.adapters.sandbox.ociruntime import chosen_runtime

    return chosen_runtime()[0]


def range_unavailable() -> str:
    """Why no OCI runtime can start a container here, as `setup` found."""
    from trialledger.adapters.sandbox.ociruntime import chosen_runtime

    return chosen_runtime()[1] or "no OCI runtime was found able"


def oci_mounts(placed: Sequence[Mount]) -> tuple[tuple[Bind, ...], tuple[str, ...]]:
    """A container's bwrap mounts as OCI binds and tmpfs mount points, in order; `/proc`,
    `/dev` and `/proc/sys` are left to Docker's own mounts (read-only `/proc/sys` is one of
    its `readonlyPaths`)."""
    binds: list[Bind] = []
    tmpfs: list[str] = []
    for mount in placed:
        if mount.kind in ("--ro-bind", "--bind") and mount.source is not None:
            if mount.target == "/proc/sys":
                continue
            binds.append(Bind(mount.source, mount.target, read_only=mount.kind == "--ro-bind"))
        elif mount.kind == "--tmpfs":
            tmpfs.append(mount.target)
        elif mount.kind not in ("--proc", "--dev"):
            raise ValueError(f"no OCI mount for bwrap's {mount.kind} at {mount.target}")
    return tuple(binds), tuple(tmpfs)


@dataclass(frozen=True)
class RuncContainer:
    """One container's OCI runtime (runc, crun): its binary, state folder, name, bundle
    and log."""

    binary: str
    state: Path
    name: str
    bundle: Path

    @classmethod
    def new(cls, session_root: Path, marker: str, runtime: str = "runc") -> RuncContainer:
        """A container of `runtime` named after the session, its state and bundle in the
        session folder (0700: the config holds the environment)."""
        name = re.sub(r"[^\w.+-]", "_", f"trialledger-{marker[:24]}-{secrets.token_hex(4)}")
        bundle = session_root / f"bundle-{name}"
        bundle.mkdir(mode=0o700)
        return cls(program(runtime), session_root / STATES[runtime], name, bundle)

    @property
    def pid_file(self) -> Path:
        return self.bundle / "pid"

    @property
    def log(self) -> Path:
        return self.bundle / "runc.log"

    @property
    def cgroup_name(self) -> str:
        """The container's cgroup, relative: a child of runc's own (the session's)."""
        return self.name

    def run_argv(self, *, preserve_fds: int) -> list[str]:
        """`runc run` in the foreground, PID 1's pid written to `pid_file`."""
        return [self.binary, "--root", str(self.state), "--log", str(self.log),
                "--log-format", "text", "run", "--bundle", str(self.bundle),
                "--pid-file", str(self.pid_file),
                *(["--preserve-fds", str(preserve_fds)] if preserve_fds else []), self.name]

    def started_pid(self) -> int | None:
        """PID 1's host pid once runc has written it."""
        try:
            text = self.pid_file.read_text(encoding="ascii").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def log_tail(self) -> str:
        """runc's last words (its log's last line), for an error."""
        try:
            with self.log.open("rb") as handle:
                handle.seek(max(0, self.log.stat().st_size - 4096))
                lines = handle.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][-LOG_TAIL:] if lines else ""

    def delete(self) -> None:
        """Kill whatever is left of the container and remove it (state, cgroups); safe
        to repeat."""
        if not (self.state / self.name).exists():
            return
        subprocess.run([self.binary, "--root", str(self.state), "delete", "--force",
                        self.name], stdin=subprocess.DEVNULL, capture_output=True,
                       env=host_env(), timeout=DELETE_S, check=False)


def runner_fd_path(fd: int) -> str:
    """A namespace the runner holds open, as a path runc can join."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def delete_left(session_root: Path) -> None:
    """Delete the containers a crashed runner left in its session folder (its PID 1 ended
    with the runner; the runtime's state and cgroups remain until this)."""
    for runtime, folder in STATES.items():
        state = session_root / folder
        if not state.is_dir() or (binary := find(runtime)) is None:
            continue
        for entry in state.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                subprocess.run([binary, "--root", str(state), "delete", "--force",
                                entry.name], stdin=subprocess.DEVNULL, capture_output=True,
                               env=host_env(), timeout=DELETE_S, check=False)
