"""A session's container under `verifier_isolation = harbor` (docs/SPEC.md §15, "Container
lifetime"): one sandbox from the first phase to the verifier, as Harbor's container is.

Our init is its PID 1 for the whole session, running the image's `ENTRYPOINT` (with `sh -c
"sleep infinity"`), else idling itself. Each phase's process — the agent, the probe, the
verifier, the copy of the tests — joins it as `docker exec` joins a container (`init
--join`): the session's cgroups, then the container's namespaces, then what the
container's own processes hold (the phase's user, Docker's capabilities for inner root
only, no new privileges, the seccomp filter). When a phase's process ends its process
group is killed; what it detached (a daemon) keeps running into the next phase.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.procscan import pids_in_namespace

# The capability numbers of linux/capability.h for the names range mode grants.
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4,
               "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
               "CAP_NET_BIND_SERVICE": 10, "CAP_NET_RAW": 13, "CAP_SYS_CHROOT": 18,
               "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31}
IDLE = "--idle"  # our init's argument to sleep forever: PID 1's command without ENTRYPOINT
NAMES_SHOWN = 10  # survivors named in `agent_processes_survived`
NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")  # init --join-fds's order
READY_S = 10.0  # how long PID 1 may take to start its command


def caps_mask(names: Sequence[str]) -> str:
    """`init --caps`'s hex mask of capability `names`."""
    mask = 0
    for name in names:
        mask |= 1 << CAP_NUMBERS[name]
    return f"{mask:x}"


def entry_command(entrypoint: Sequence[str], init_inside: str) -> list[str]:
    """PID 1's command, as Harbor's compose service runs the image: its ENTRYPOINT with
    `sh -c "sleep infinity"`; without one our own init idles (no program of the image
    needed)."""
    if entrypoint:
        return [*entrypoint, "sh", "-c", "sleep infinity"]
    return [init_inside, IDLE]


class ContainerFailed(OSError):
    """The container did not start, or stopped."""


@dataclass
class Container:
    """The running container: bwrap (`run`), its PID 1's PID namespace, and descriptors of
    PID 1's namespaces (held, so a phase always joins this container, never whatever
    process later gets its pid)."""

    run: LocalRun
    namespace: int
    fds: tuple[int, ...]
    baseline: set[int] = field(default_factory=set)  # its processes before the agent

    @classmethod
    async def attach(cls, run: LocalRun, pid: int, namespace: int) -> Container:
        """Once PID 1 runs its command (so bwrap has finished making the root: the join
        lands in the container, never in the half-made namespace), hold its namespaces."""
        pidfd = os.pidfd_open(pid)
        try:
            with anyio.move_on_after(READY_S):
                while len(pids_in_namespace(namespace)) < 2:
                    if _ended(pidfd):
                        break
                    await anyio.sleep(0.005)
            if _ended(pidfd) or len(pids_in_namespace(namespace)) < 2:
                raise ContainerFailed("the container's init did not start its command")
            fds: list[int] = []
            try:
                for kind in NAMESPACES:
                    fds.append(os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
                if _ended(pidfd):  # the pid may be another process's by now
                    raise ContainerFailed("the container stopped as it started")
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        finally:
            os.close(pidfd)
        return cls(run, namespace, tuple(fds))

    def join_arg(self) -> str:
        """`init --join-fds`'s argument."""
        return ",".join(str(fd) for fd in self.fds)

    def lost(self) -> str | None:
        """Why the container is gone, when it is (its PID 1's command ended, or bwrap)."""
        if self.run.process.returncode is None:
            return None
        tail, _ = self.run.stderr_tail()
        last = tail.strip().splitlines()[-1][:300] if tail.strip() else ""
        return ("the container stopped: its main process ended"
                + (f" ({last})" if last else ""))

    def mark_agent_start(self) -> None:
        """Remember the processes running before the agent (PID 1, the ENTRYPOINT's)."""
        self.baseline = set(pids_in_namespace(self.namespace))

    def survivors(self) -> list[str]:
        """The names of processes started since `mark_agent_start` and still running:
        what the agent detached (hostile names: bounded, printable)."""
        names = []
        for pid in sorted(set(pids_in_namespace(self.namespace)) - self.baseline):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/comm", "rb") as handle:
                    raw = handle.read(64)
                names.append("".join(c if c.isprintable() else "?" for c in
                                     raw.decode("utf-8", "replace").strip())[:16] or "?")
        return names

    async def stop(self) -> None:
        """End it: every process in it goes with its PID 1."""
        with anyio.CancelScope(shield=True):
            await self.run.stop(0.5)
            await self.run.aclose()
        self.release()

    def release(self) -> None:
        """Close the namespace descriptors."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = ()


def survivors_gap(names: Sequence[str]) -> dict[str, str] | None:
    """`agent_processes_survived` (SPEC §15) for these survivors, if any."""
    if not names:
        return None
    shown = ", ".join(names[:NAMES_SHOWN]) + (", …" if len(names) > NAMES_SHOWN else "")
    return {"code": "agent_processes_survived",
            "detail": f"{len(names)} processes the agent started still run into the "
                      f"verifier: {shown}"}


def _ended(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd polls readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])
