"""Each process of a session started on the host (SPEC §11, §15): `Spawning`, a part of
`LocalSandbox` (local.py) — a phase's process joined into the session's container
(harbor), the container itself (under runc: runclaunch.py; else bwrap), or a sandbox of
its own per phase (strict): its bwrap command line (`bwrap.py` builds it from the plan
read here), our init's arguments inside, the task's variables handed over in a file, and
the phase's network opened before its command runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio

from trialledger.adapters.codex.install import CodexInstall
from trialledger.adapters.images.environment import resolve_inside
from trialledger.adapters.sandbox.base import SUPERVISOR_ENV
from trialledger.adapters.sandbox.bwrap import INIT_INSIDE, Role, Spawn, bwrap_argv, mounts
from trialledger.adapters.sandbox.container import CopyIn
from trialledger.adapters.sandbox.hostside import env_file, host_env, program
from trialledger.adapters.sandbox.idrange import InnerUser, ensure_filter
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.runclaunch import RuncLaunch
from trialledger.adapters.sandbox.slirp import hostname_of

SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


class Spawning(RuncLaunch):
    """Each process of the session started (a part of `LocalSandbox`)."""

    # Set by LocalSandbox's construction
    codex: CodexInstall | None
    network: Network | None
    readonly_paths: list[Path]
    verifier_root: str
    _resolver: Path | None  # (a connected phase, an image) the resolver slirp4netns serves
    _verifications: int
    _tests_bound: Path | None = None  # (strict) the verifier's fresh copy of the tests

    def _own_network(self, role: Role, phase: str) -> bool:
        """Whether a phase's sandbox has a network namespace of its own: the agent's (and
        the container's) is the session's `Network`'s, where its proxies listen; another
        phase's is private unless its mode is a host task's `public` (the host's)."""
        if self.network is None:
            return False
        if role in ("agent", "container") or phase == "agent":
            return self.network.isolated
        return self.image is not None or self.phase_modes[phase] != "public"

    def _connected(self, phase: str) -> bool:
        """Whether a phase's own namespace is connected outward before its command runs
        (strict: slirp4netns, with an allowlist's rules and egress proxy): an allowlist,
        or an image's public network. (A container's network is switched by
        `_use_network` instead.)"""
        if (self.lifetime == "harbor" or self.network is None or self.isolation != "bwrap"
                or self.walled):  # (a compose `main` on `internal` networks alone: never)
            return False
        mode = self.phase_modes[phase]
        return mode == "allowlist" or (mode == "public" and self.image is not None)

    def _bwrap(self, command: Sequence[str], *, info_fd: int, role: Role, phase: str,
               verifier_logs: Path | None = None, block_fd: int | None = None,
               seccomp_fd: int | None = None) -> list[str]:
        """The spawn's whole argv: the staging prefix (root), the drop to the sandbox user,
        then bwrap (whose command line `bwrap.py` builds from what is read here)."""
        spawn = self._spawn_plan(role, phase, info_fd=info_fd, verifier_logs=verifier_logs,
                                 block_fd=block_fd)
        if self.range is not None:
            spawn = dataclasses.replace(spawn, userns_fd=self.range.userns_fd,
                                        seccomp_fd=seccomp_fd, caps=self.caps)
        staged: list[tuple[Path, Path]] = []
        placed = [dataclasses.replace(m, source=str(self._stage(Path(m.source), staged)))
                  if m.staged and m.source is not None else m for m in mounts(spawn)]
        self._clear_mount_points(placed, role)
        return [*self._prefix(staged, role), *bwrap_argv(spawn, placed, command)]

    def _spawn_plan(self, role: Role, phase: str, *, info_fd: int,
                    verifier_logs: Path | None, block_fd: int | None) -> Spawn:
        # Over an image the agent is the image's User inside (files the sandbox uid owns on
        # the host are that user's); on the host it is always the sandbox uid.
        uid, gid = ((self.image.uid, self.image.gid) if self.image is not None
                    else (self.user.uid, self.user.gid))
        pristine = self._pristine_view(role)
        root = None
        workdir_source = None if self.overlay else str(self.host_work)
        if pristine:  # the image as it was, a fresh layer above (made in _prefix), and the
            # agent's workdir as the agent left it
            assert self.image is not None and self.image.root is not None
            root = str(self.root / f"pristine-{self._verifications}-merged")
            inside = resolve_inside(self.image.root, self.workdir)
            workdir_source = str(self.root / "merged" / inside.lstrip("/"))
        elif self.overlay:
            root = str(self.root / "merged")
        system = [] if self.image is not None else [
            (path, os.readlink(path) if os.path.islink(path) else None)
            for path in SYSTEM_PATHS if os.path.islink(path) or os.path.isdir(path)]
        return Spawn(
            role=role, uid=uid, gid=gid, workdir=self.workdir, init=str(self.init),
            bwrap=program("bwrap"),
            session_dir=str(self.session_dir), root=root, system=system,
            workdir_source=workdir_source,
            codex=[(str(s), i) for s, i in self.codex.mounts()] if self.codex else [],
            readonly=[str(p) for p in self.readonly_paths],
            sees_agent_files=role == "agent" or self.verifier_root == "agent",
            tests=str(self._tests_bound) if self._tests_bound is not None else None,
            verifier_logs=str(verifier_logs) if verifier_logs is not None else None,
            isolated_network=self._own_network(role, phase),
            block_fd=block_fd, info_fd=info_fd,
            hostname=hostname_of(self.marker) if role == "container" else None,
            # slirp's resolver: an image's always; a host task's only where slirp4netns
            # connects the phase (elsewhere the host's resolver serves its network)
            resolver=(str(self._resolver) if self._resolver is not None and (
                self.image is not None or self._connected(phase)) else None))

    def _init(self, command: Sequence[str], status_fd: int, role: Role,
              user: InnerUser | None = None, *, env_fd: int, deadline: bool = True
              ) -> list[str]:
        init = INIT_INSIDE if self.isolation == "bwrap" else str(self.init)
        argv = [init, "--status-fd", str(status_fd), "--env-fd", str(env_fd)]
        if self.oom_score_adj is not None:
            argv += ["--oom-score-adj", str(self.oom_score_adj)]
        if self.switch is not None and deadline:
            argv += ["--deadline-fd", str(self.switch.read_fd),
                     "--deadline-ms", str(self.switch.remaining_ms())]
        if user is None and self.range is not None:  # our init, inner root, switches the
            user = self.range.users[role]  # command's user
        if user is not None:
            groups = ",".join(str(g) for g in user.groups) or "-"
            argv += ["--user", str(user.uid), str(user.gid), groups]
        return [*argv, "--", *command]

    async def _spawn(self, command: Sequence[str], *, env: Mapping[str, str], role: Role,
                     verifier_logs: Path | None = None, stdin: bool = False,
                     copy: CopyIn | None = None,
                     phase: str | None = None, user: InnerUser | None = None) -> LocalRun:
        """Start `command` as `role` (harbor: joined into the session's container; strict:
        in a sandbox of its own on `phase`'s network, by default the role's), as `user`
        (range mode; None: the role's)."""
        if self.lifetime == "harbor" and role != "container":
            return await self._spawn_joined(command, env=env, role=role, stdin=stdin,
                                            copy=copy, user=user)
        if role == "container" and self.on_runc:
            return await self._spawn_runc(command, env=env, verifier_logs=verifier_logs)
        bwrap = self.isolation == "bwrap"
        status_r, status_w = os.pipe()
        info_r, info_w = os.pipe() if bwrap else (None, None)
        forwarding = (bwrap and role in ("agent", "container") and self.network is not None
                      and self.network.isolated)
        phase = phase or ("verifier" if role == "verifier" else "agent")
        networked = role != "container" and (role != "probe" or phase != "agent")  # (a
        # liveness probe needs no way out)
        guarded = bwrap and networked and self._connected(phase)
        if networked and not guarded:  # the last phase's way out goes with it
            await self._disconnect()
        block_r, block_w = os.pipe() if forwarding or guarded else (None, None)
        seccomp = (os.open(ensure_filter(), os.O_RDONLY | os.O_CLOEXEC)
                   if self.range is not None else None)
        userns = self.range.userns_fd if self.range is not None else None
        env_fd = None
        try:
            # The task's variables go to our init inside the sandbox alone (hostside.py)
            env_fd = env_file({**env, SUPERVISOR_ENV: self.marker}, first=SUPERVISOR_ENV)
            inner = self._init(command, status_w, role, user, env_fd=env_fd)
            argv = (self._bwrap(inner, info_fd=info_w or 0, role=role, phase=phase,
                                verifier_logs=verifier_logs, block_fd=block_r,
                                seccomp_fd=seccomp)
                    if bwrap else [*self._prefix([]), *inner])
            quiet = subprocess.DEVNULL if role == "container" else subprocess.PIPE  # PID 1's
            # output: nobody would drain it for the whole session
            process = await anyio.open_process(
                argv, env=host_env(**{SUPERVISOR_ENV: self.marker}),
                cwd=None if bwrap else self.host_work,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=quiet, stderr=quiet,
                pass_fds=tuple(fd for fd in (status_w, info_w, block_r, seccomp, userns,
                                             env_fd,
                                             self.switch.read_fd if self.switch else None)
                               if fd is not None),
                start_new_session=True,
            )
        except BaseException:
            for fd in (status_r, info_r, block_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (status_w, info_w, block_r, seccomp, env_fd):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        run = LocalRun(process, status_fd=status_r, info_fd=info_r,
                       isolation=self.isolation, marker=self.marker)
        if block_w is not None:
            await self._open_network(run, block_w, forwarding=forwarding,
                                     guarded=phase if guarded else None)
        return run

    async def _open_network(self, run: LocalRun, block_w: int, *, forwarding: bool,
                            guarded: str | None) -> None:
        """Open the proxies inside the sandbox's network (and connect the `guarded` phase's
        own: slirp4netns, an allowlist's rules and egress proxy), then let bwrap go on."""
        assert self.network is not None
        try:
            info = await anyio.to_thread.run_sync(run.info)
            pid = info.get("child-pid")
            if not isinstance(pid, int):
                raise OSError("bwrap reported no child pid for the network namespace")
            if forwarding:
                await self.network.open_inside(pid)
            if guarded is not None:
                net = info.get("net-namespace")
                await self._guard(pid, net if isinstance(net, int) else None,
                                  allowlist=self.phase_modes[guarded] == "allowlist")
            os.write(block_w, b"x")
        except BaseException:
            await run.aclose()
            raise
        finally:
            os.close(block_w)
