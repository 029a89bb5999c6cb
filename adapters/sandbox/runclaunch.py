"""Starting a range-mode session's container with runc (docs/SPEC.md §16; the design is
runc.py's): `RuncLaunch`, a part of `LocalSandbox` (local.py), writes the container's
`config.json` from the session's mounts, ids and limits, starts `runc run` under our init's
staging and returns once runc has named PID 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from trialledger.adapters.images.environment import copy_tree
from trialledger.adapters.places import resolve_inside
from trialledger.adapters.sandbox.base import SUPERVISOR_ENV
from trialledger.adapters.sandbox.bwrap import INIT_INSIDE, Role, Spawn, mounts
from trialledger.adapters.sandbox.cgroup import CONTROLLERS, DEFAULT_PIDS, v1_hierarchies
from trialledger.adapters.sandbox.container import ContainerPhases
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.sandbox.hostside import host_env
from trialledger.adapters.sandbox.idrange import SLOT, InnerUser
from trialledger.adapters.sandbox.layout import chown_like, chown_tree
from trialledger.adapters.sandbox.oci import (
    DOCKER_NET_SYSCTL,
    Bind,
    ContainerSpec,
    container_config,
)
from trialledger.adapters.sandbox.ociruntime import host_nofile, host_seccomp
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.runc import RuncContainer, oci_mounts, runner_fd_path
from trialledger.adapters.sandbox.running import ContainerFailed
from trialledger.adapters.sandbox.slirp import hostname_of
from trialledger.adapters.tasks.compose import Volume

RUNC_READY_S = 10.0  # how long runc may take to name the container's PID 1
MEMSW = "memory.memsw.limit_in_bytes"


def swap_accounted() -> bool:
    """Whether this kernel accounts swap in the cgroup v1 memory controller (runc writes
    memory+swap only where it does, as cgroup.py's own writes)."""
    memory = v1_hierarchies().get("memory")
    return memory is not None and (memory / MEMSW).exists()


def pid1_argv(command: Sequence[str], user: InnerUser, *, oom_score_adj: int | None,
              deadline_ms: int | None, gated: bool = False) -> list[str]:
    """The container's PID 1, our init: it holds descriptor 3 (the lifeline: runc's
    container does not die with the runner, bwrap's did), for a lease 4 (its switch,
    `deadline_ms` left) and, `gated`, the next (the gate: `command` starts once the runner
    writes to it), all handed over by `runc --preserve-fds`, then drops to `user` and runs
    `command`. Never the environment: that is config.json's alone."""
    argv = [INIT_INSIDE, "--lifeline-fd", "3"]
    if oom_score_adj is not None:
        argv += ["--oom-score-adj", str(oom_score_adj)]
    if deadline_ms is not None:
        argv += ["--deadline-fd", "4", "--deadline-ms", str(deadline_ms)]
    if gated:
        argv += ["--gate-fd", "5" if deadline_ms is not None else "4"]
    return [*argv, "--user", str(user.uid), str(user.gid),
            ",".join(str(g) for g in user.groups) or "-", "--", *command]


def container_limits(limits: Mapping[str, float]) -> dict[str, float]:
    """The session's limits a container's cgroup holds (runc writes them): the task's
    `pids`, `memory_mb` and `cpus`, and Docker's default `pids` where it sets none."""
    return {"pids": float(DEFAULT_PIDS),
            **{key: value for key, value in limits.items() if key in CONTROLLERS}}


class RuncLaunch(ContainerPhases):
    """The session's container under runc (a part of `LocalSandbox`)."""

    # Set by LocalSandbox's construction
    switch: DeadManSwitch | None  # a job trial's lease
    oom_score_adj: int | None
    limits: dict[str, float]
    runtime: str | None  # the OCI runtime (runc, crun) when the container starts on one
    _lifeline: int | None  # (runc) its write end: closed, the container's PID 1 ends it
    _gate: int | None  # (a bridged compose service) its write end: written, its command starts
    volumes: tuple[Volume, ...]  # (a compose task) what this container mounts

    if TYPE_CHECKING:  # LocalSandbox's: what a spawn of a role mounts
        def _spawn_plan(self, role: Role, phase: str, *, info_fd: int,
                        verifier_logs: Path | None, block_fd: int | None) -> Spawn: ...

    async def _spawn_runc(self, command: Sequence[str], *, env: Mapping[str, str],
                          verifier_logs: Path | None) -> LocalRun:
        """The session's container started by `runc run` from a `config.json` of ours, our
        init its PID 1 running `command` as the container's user; returned once runc has
        named PID 1 (OSError: it did not, with runc's last words)."""
        assert self.range is not None and self.image is not None and self.runtime
        runc = self._runc = RuncContainer.new(self.root, self.marker, self.runtime)
        spawn = self._spawn_plan("container", "agent", info_fd=0,
                                 verifier_logs=verifier_logs, block_fd=None)
        staged: list[tuple[Path, Path]] = []
        placed = [dataclasses.replace(m, source=str(self._stage(Path(m.source), staged)))
                  if m.staged and m.source is not None else m for m in mounts(spawn)]
        self._clear_mount_points(placed, "container")
        binds, tmpfs = oci_mounts(placed)
        binds += tuple(self._volume_binds())
        # (a bridged compose service: its command waits for its links, as Docker makes
        # them first; `ComposeParts.start_service` opens the gate)
        gated = (self.shares is not None and self.shares[0].bridged
                 and not self.shares[1].isolated)
        pid1 = pid1_argv(command, self.range.users["container"],
                         oom_score_adj=self.oom_score_adj,
                         deadline_ms=self.switch.remaining_ms() if self.switch else None,
                         gated=gated)
        # Always a network namespace of the container's own (the runner's, inside the
        # slot's user namespace; a bridged compose service's made by runc there): sysfs
        # cannot be mounted in a user namespace that does not own the network namespace, so
        # the host's is never shared under runc.
        netns = self.range.netns_fd
        limits = container_limits(self.limits)
        config = container_config(ContainerSpec(
            root=str(self.root / "merged"), args=tuple(pid1),
            env={**env, SUPERVISOR_ENV: self.marker},  # in config.json alone (0600, 0700)
            seccomp=host_seccomp(self.caps), ids=(self.range.slot.start, SLOT),
            cwd=self.workdir, caps=self.caps, no_new_privileges=self.no_new_privileges,
            hostname=hostname_of(self.marker),
            userns=runner_fd_path(self.range.userns_fd),
            netns=runner_fd_path(netns) if netns is not None else None,
            cgroups_path=runc.cgroup_name, limits=limits, binds=binds, tmpfs=tmpfs,
            task_tmpfs=self.shares[1].tmpfs if self.shares is not None else (),
            readonly_root=self.shares is not None and self.shares[1].read_only,
            nofile=host_nofile(), sysctl=DOCKER_NET_SYSCTL, swap_accounted=swap_accounted()))
        fd = os.open(runc.bundle / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                     | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="utf-8") as handle:  # (dumps: C's encoder; dump is Python's)
            handle.write(json.dumps(config))
        lifeline, self._lifeline = os.pipe()  # its write end is the runner's alone
        gate, self._gate = os.pipe() if gated else (None, None)
        passed = [lifeline, *([self.switch.read_fd] if self.switch is not None else []),
                  *([gate] if gate is not None else [])]
        try:  # (the read ends are runc's alone: ours close whatever happens)
            argv = [*self._runc_prefix(staged, passed),
                    *runc.run_argv(preserve_fds=len(passed))]
            process = await anyio.open_process(
                argv, env=host_env(**{SUPERVISOR_ENV: self.marker}), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # PID 1's output:
                # nobody would drain it for the whole session
                pass_fds=(self.range.userns_fd, *passed), start_new_session=True)
        finally:
            os.close(lifeline)
            if gate is not None:
                os.close(gate)
        status_r, status_w = os.pipe()  # PID 1 reports to nobody: its end is runc's exit
        os.close(status_w)
        run = LocalRun(process, status_fd=status_r, info_fd=None, isolation=self.runtime,
                       marker=self.marker)
        try:
            pid = None
            with anyio.move_on_after(RUNC_READY_S):
                while (pid := runc.started_pid()) is None and process.returncode is None:
                    await anyio.sleep(0.005)
            if pid is None:  # (runc may have named it, and ended with a container that
                pid = runc.started_pid()  # ended at once, between the two looks above)
            if pid is None:
                raise OSError(f"{self.runtime} could not start the container: "
                              f"{runc.log_tail() or 'it said nothing'}")
            try:
                namespace = os.stat(f"/proc/{pid}/ns/pid").st_ino
            except FileNotFoundError:  # an ENTRYPOINT that exits at once
                raise ContainerFailed("the container stopped as it started") from None
            try:
                net = (os.fstat(netns).st_ino if netns is not None
                       else os.stat(f"/proc/{pid}/ns/net").st_ino)
            except FileNotFoundError:  # (PID 1 ended since, its command done at once)
                raise ContainerFailed("the container stopped as it started") from None
            run.know({"child-pid": pid, "pid-namespace": namespace, "net-namespace": net})
            if self.network is not None and self.network.isolated:
                try:
                    await self.network.open_inside(pid)  # before any phase joins
                except FileNotFoundError:  # (PID 1 gone meanwhile: its /proc/PID/ns/net)
                    raise ContainerFailed("the container stopped as it started") from None
        except BaseException as error:
            if isinstance(error, ContainerFailed):
                await self._note_end(run)
            await run.aclose()
            await anyio.to_thread.run_sync(runc.delete)
            os.close(self._lifeline)
            self._lifeline = None
            self.open_gate(close_only=True)
            raise
        return run

    def open_gate(self, *, close_only: bool = False) -> None:
        """(a bridged compose service) Let its command start (`close_only`: never — the
        gate's end-of-file ends it unstarted)."""
        if self._gate is None:
            return
        gate, self._gate = self._gate, None
        try:
            if not close_only:
                with contextlib.suppress(OSError):  # (EPIPE: its container ended already)
                    os.write(gate, b"\n")
        finally:
            os.close(gate)

    def _volume_binds(self) -> list[Bind]:
        """(a compose task) This container's `volumes` as binds: a named volume is a folder
        of the session's, made by its first container as Docker makes one (what its image
        holds at the target copied in, owners kept, setuid bits not); a task path is copied
        into this container's folder first (the task folder is never written), owned by
        inner root."""
        assert self.range is not None and self.image is not None and self.image.root
        session: RuncLaunch = self.shares[0] if self.shares is not None else self
        slot = self.range.slot.start
        binds = []
        for index, volume in enumerate(self.volumes):
            if volume.kind == "volume":
                folder = session.root / "volumes" / volume.source
                if folder.parent != session.root / "volumes" or volume.source in (".", ".."):
                    raise OSError(f"volume {volume.source!r}: not a volume name")
                if not folder.exists():
                    folder.parent.mkdir(mode=0o755, exist_ok=True)
                    folder.mkdir(mode=0o755)
                    image_folder = self.image.root / resolve_inside(
                        self.image.root, volume.target).lstrip("/")
                    if image_folder.is_dir() and not image_folder.is_symlink():
                        copy_tree(image_folder, folder)  # Docker's copy-up
                        chown_like(image_folder, folder, slot)
                        os.chmod(folder, image_folder.lstat().st_mode & 0o7777)
                    else:
                        os.chown(folder, slot, slot)
            else:
                folder = self.root / f"bind-{index}"
                if os.path.isdir(volume.source):
                    shutil.copytree(volume.source, folder, symlinks=True)
                    chown_tree(folder, (slot, slot))
                else:
                    shutil.copyfile(volume.source, folder, follow_symlinks=False)
                    os.chown(folder, slot, slot, follow_symlinks=False)
            binds.append(Bind(str(folder), volume.target, read_only=volume.read_only))
        return binds

    def _runc_prefix(self, staged: Sequence[tuple[Path, Path]], passed: Sequence[int]
                     ) -> list[str]:
        """What runs runc: our init, in the session's cgroups, in a private mount
        namespace where the image is mounted idmapped and the overlay over it (setuid bits
        working: they are the slot's) and the staged sources bound; runc stays root (it
        drops into the slot itself); the `passed` descriptors moved to 3 and on."""
        assert self.range is not None and self.image is not None
        overlays, idmap = self._stage_mounts("container")
        assert idmap
        argv = [str(self.init), "--stage", "--fds", ",".join(str(fd) for fd in passed)]
        for procs in self._cgroup_procs:
            argv += ["--cgroup", str(procs)]
        argv += ["--mount-ns", "--exec-suid",
                 *(str(part) for one in idmap for part in ("--idmap", *one)), *overlays,
                 "--", *(str(path) for pair in staged for path in pair), "--"]
        return argv
