"""A session's container under `verifier_isolation = harbor` (docs/SPEC.md §15, "Container
lifetime"): one sandbox from the first phase to the verifier, as Harbor's container is.

Our init is its PID 1 for the whole session, running the image's `ENTRYPOINT` (with `sh -c
"sleep infinity"`), else idling itself. Each phase's process — the agent, the probe, the
verifier, the copy of the tests — joins it as `docker exec` joins a container (`init
--join`): the session's cgroups, then the container's namespaces, then what the
container's own processes hold: the phase's user, Docker's capabilities for inner root
only, and the container's seccomp filter — under bwrap our list of Docker's refusals with
no new privileges; under runc (runc.py) Docker's whole profile (`ocifilter.py`) with new
privileges allowed, as in Docker. When a phase's process ends its process group is
killed; what it detached (a daemon) keeps running into the next phase.

`ContainerPhases`, a part of `LocalSandbox` (local.py), starts it in the session's layer
(Docker's injected files, `/logs`), joins each phase's process into it, runs the verifier
and the healthcheck there and copies files in; the running container is `Container`'s
(running.py), its network phase by phase `ContainerNetwork`'s (containernet.py).

Just over 500 lines: each phase's way into the container (join, copy, clear, check) reads
beside the others, as they share its user, namespace and seccomp rules.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import anyio

from trialledger.adapters.places import resolve_inside
from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.base import (
    SUPERVISOR_ENV,
    CommandRun,
    SandboxRefused,
    VerifierRun,
)
from trialledger.adapters.sandbox.bwrap import (
    INIT_INSIDE,
    TESTS_INSIDE,
    VERIFIER_LOGS_INSIDE,
    VERIFIER_STDOUT,
    Role,
)
from trialledger.adapters.sandbox.composed import ComposeParts
from trialledger.adapters.sandbox.containernet import ContainerNetwork
from trialledger.adapters.sandbox.egress import (
    EgressProxy,
)
from trialledger.adapters.sandbox.folders import remove_tree
from trialledger.adapters.sandbox.hostside import env_file, host_env
from trialledger.adapters.sandbox.idrange import InnerUser, ensure_filter, resolve_user
from trialledger.adapters.sandbox.layout import SessionLayout, chown_tree
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.sandbox.ocifilter import docker_filter
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.runc import RuncContainer
from trialledger.adapters.sandbox.running import Container, ContainerFailed
from trialledger.adapters.sandbox.sessionids import SessionIds
from trialledger.adapters.sandbox.slirp import Slirp, injected_files
from trialledger.adapters.tasks.compose import Condition

# The capability numbers of linux/capability.h for the names range mode grants.
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4,
               "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
               "CAP_NET_BIND_SERVICE": 10, "CAP_NET_RAW": 13, "CAP_SYS_CHROOT": 18,
               "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31}
IDLE = "--idle"  # our init's argument to sleep forever: PID 1's command without ENTRYPOINT
NETWORK_PHASES = ("healthcheck", "agent", "verifier")  # each with its network mode (§15)
NAMES_SHOWN = 10  # survivors named in `agent_processes_survived`
SERVICE_END_S = 2.0  # how long a completed service's runc is waited for, for its code
CHECK_TAIL = 4096  # bytes of a healthcheck try's output kept
REMOVE_BATCH = 1000  # names per `rm` run (well inside ARG_MAX)
REMOVE_ROUNDS = 1000  # batches at most (a million names)


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


class CopyIn(NamedTuple):
    """What inner root does in the container instead of running a command: init
    `--copy-in` (a fresh `inside`), `--merge-in` (into the folder `inside`), or `--clear`
    (the folder `inside` emptied; no source)."""

    source: int  # a descriptor of the staged folder or file, opened on the host (-1: none)
    inside: str
    uid: int
    gid: int
    mode: Literal["copy", "merge", "clear"] = "copy"

    def argv(self) -> list[str]:
        if self.mode == "clear":
            return ["--clear", self.inside]
        return [f"--{self.mode}-in", str(self.source), self.inside, str(self.uid),
                str(self.gid)]


class ContainerPhases(SessionIds, SessionLayout, ContainerNetwork, ComposeParts):
    """The session's phases in its container (a part of `LocalSandbox`): the container
    started on first use in the session's layer, each phase's process joined into it, the
    verifier and the healthcheck run there, its network and egress proxy opened."""

    # Set by LocalSandbox's construction
    container: Container | None  # the session's one sandbox, once started
    network: Network | None
    allowed_hosts: AllowList | None
    caps: tuple[str, ...]  # what inner root holds in range mode
    egress: EgressProxy | None
    egress_sink: Callable[[str], Awaitable[None]] | None  # where a refused connection goes
    slirp: Slirp | None  # the container's outward connection (a public network)
    phase_modes: dict[str, str]  # NETWORK_PHASES → the phase's network mode
    _net_namespace: int | None  # the container's network namespace's inode (bwrap's)
    lifetime: str  # verifier_isolation: harbor (this container) or strict
    task_env: dict[str, str]  # [environment] env, for the container's PID 1
    marker: str
    tests: Path | None
    incoming: list[tuple[Path, str]]  # staged copies placed before the verifier (bring_in)
    no_new_privileges: bool  # (runc) a task's `[metadata.trialledger]` asks for it
    _runc: RuncContainer | None  # the container's runc, when it runs under runc
    compose_needs: dict[str, Condition]  # (a compose task) what main's depends_on waits for

    if TYPE_CHECKING:  # LocalSandbox's: spawning, and the verifier's parts
        def base_env(self) -> dict[str, str]: ...

        def _init(self, command: Sequence[str], status_fd: int, role: Role,
                  user: InnerUser | None = None, *, env_fd: int, deadline: bool = True
                  ) -> list[str]: ...

        async def _spawn(self, command: Sequence[str], *, env: Mapping[str, str], role: Role,
                         verifier_logs: Path | None = None, stdin: bool = False,
                         copy: CopyIn | None = None,
                         phase: str | None = None, user: InnerUser | None = None
                         ) -> LocalRun: ...

        async def _run_bounded(self, command: list[str], timeout_s: float, *,
                               env: Mapping[str, str], role: Role,
                               verifier_logs: Path | None = None,
                               copy: CopyIn | None = None
                               ) -> tuple[int | None, bool]: ...

        async def _agent_gone(self) -> bool: ...

        def _copy_tests(self, target: Path) -> None: ...

        @property
        def on_runc(self) -> bool: ...

    def _container_env(self) -> dict[str, str]:
        """PID 1's environment, as Harbor's compose service gets it: the image's `Env` and
        `HOME`, then `[environment] env`."""
        assert self.image is not None
        return {**self.base_env(), **self.image.phase_env(), **self.task_env}

    async def _ensure_container(self) -> Container:
        """The session's container, started on first use (OSError: it could not be, or
        it has stopped)."""
        if self.container is not None:
            if (why := self.container.lost()) is not None:
                if self.shares is not None:  # (a compose service that completed after
                    # its start: said as of one that ended as it started, once runc says)
                    with anyio.move_on_after(SERVICE_END_S):
                        await self.container.run.process.wait()
                    if (code := self.container.run.process.returncode) is not None:
                        raise OSError(f"its container exited with {code}")
                raise OSError(why)
            return self.container
        if self.ended_code is not None:  # (a compose service that completed: never again)
            raise OSError(f"its container exited with {self.ended_code}")
        if self.services is not None:  # (what the session's container depends on, first)
            await self.services.start(self.compose_needs)
        logs = self.root / "verifier-logs"
        logs.mkdir(mode=0o700, exist_ok=True)  # (a start that failed may have made it)
        if self.runs_as.switches:
            os.chown(logs, *self.owner("verifier"))
        assert self.image is not None  # harbor runs image and rootfs sessions only
        self._prepare_layer(resolver=self._resolves)
        command = (self.shares[1].argv(self.image.entrypoint, self.image.cmd)
                   if self.shares is not None
                   else entry_command(self.image.entrypoint, INIT_INSIDE))
        run = await self._spawn(command, env=self._container_env(),
                                role="container", verifier_logs=logs)
        info = await anyio.to_thread.run_sync(run.info)
        pid, namespace = info.get("child-pid"), info.get("pid-namespace")
        try:
            if not isinstance(pid, int) or not isinstance(namespace, int):
                raise OSError("bwrap reported no container")
            self.container = await Container.attach(run, pid, namespace)
            net = info.get("net-namespace")
            self._net_namespace = net if isinstance(net, int) else None
        except BaseException as error:
            if self.slirp is not None:
                await self.slirp.stop()
                self.slirp = None
            if self.container is not None:
                self.container.release()
                self.container = None
            if isinstance(error, ContainerFailed):
                await self._note_end(run)
            await run.aclose()
            raise
        return self.container

    def _prepare_layer(self, *, resolver: bool) -> None:
        """The container's start in the session's layer (before anything mounts it):
        `/logs/agent` and `/logs/artifacts` the agent's to write (`/logs/verifier` is
        bound in), and Docker's injected files."""
        assert self.image is not None and self.image.root is not None
        if resolve_inside(self.image.root, "/logs") == "/logs":
            logs = self.root / "upper" / "logs"
            for folder in (logs, logs / "agent", logs / "artifacts"):
                folder.mkdir(mode=0o755, exist_ok=True)
                if self.runs_as.switches:
                    os.chown(folder, *(self._root_owner if folder == logs
                                       else self.agent_owner))
        self._inject_docker_files(resolver=resolver)

    def _inject_docker_files(self, *, resolver: bool) -> None:
        """`/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` as Docker writes them over
        an image, into the session's layer, owned by inner root and writable by it, as
        Docker's are."""
        assert self.image is not None and self.image.root is not None
        if resolve_inside(self.image.root, "/etc") != "/etc":
            return  # an image whose /etc is a link: left as it is
        etc = self.root / "upper" / "etc"
        etc.mkdir(mode=0o755, exist_ok=True)
        owner = self._root_owner if self.runs_as.switches else None
        if owner is not None:
            os.chown(etc, *owner)
        for path, content in injected_files(self.marker, resolver=resolver,
                                            neighbours=self._neighbours).items():
            target = self.root / "upper" / path.lstrip("/")
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, content)
                if owner is not None:
                    os.fchown(fd, *owner)
            finally:
                os.close(fd)

    def container_lost(self) -> str | None:
        """Why the session's container is gone (harbor), else None."""
        return self.container.lost() if self.container is not None else None

    async def container_ended(self, wait_s: float) -> str | None:
        """Why the session's container is gone, waiting up to `wait_s` for it to end: a
        phase that could not join it may have met it dying (a fork in a PID namespace
        whose PID 1 is gone fails before the runner sees PID 1 end). None under strict,
        or while it runs."""
        if self.container is None:
            return None
        with anyio.move_on_after(wait_s):
            await self.container.run.process.wait()
        return self.container.lost()

    def _inner_user(self, role: Role) -> InnerUser:
        """Who a joined process runs as: the role's user (range mode), else the one id."""
        if self.range is not None:
            return self.range.users[role]
        assert self.image is not None
        return InnerUser(self.image.uid, self.image.gid, ())

    async def _spawn_joined(self, command: Sequence[str], *, env: Mapping[str, str],
                            role: Role, stdin: bool = False,
                            copy: CopyIn | None = None,
                            user: InnerUser | None = None) -> LocalRun:
        """A phase's process in the container (`init --join`), as `user` (None: the role's);
        with `copy` (source fd, destination, uid, gid) inner root copies a folder in
        instead."""
        container = await self._ensure_container()
        if role in ("agent", "verifier"):
            await self._use_network(role)
        status_r, status_w = os.pipe()
        # Under runc, Docker's profile, as the container's PID 1 has it; else (bwrap) our
        # list of Docker's refusals, as bwrap's PID 1 has it.
        program = docker_filter(self.caps) if self.on_runc else ensure_filter()
        seccomp = (os.open(program, os.O_RDONLY | os.O_CLOEXEC)
                   if self.range is not None else None)
        argv = [str(self.init), "--join-fds", container.join_arg()]
        for procs in self._cgroup_procs:
            argv += ["--cgroup", str(procs)]
        if self.range is not None:
            argv += ["--caps", caps_mask(self.caps), "--seccomp-fd", str(seccomp)]
        if self.on_runc and not self.no_new_privileges:  # as the container's PID 1 (runc.py)
            argv.append("--new-privs")
        elif self._nproc:
            argv += ["--nproc", str(self._nproc)]
        argv += ["--chdir", self.workdir]
        user = user or self._inner_user(role)
        if copy is not None:
            argv += copy.argv()
            user = InnerUser(0, 0, ()) if self.range is not None else user
        env_fd = None
        try:
            env_fd = env_file({**env, SUPERVISOR_ENV: self.marker},  # for our init, in there
                              first=SUPERVISOR_ENV)
            # The lease's switch is the container's PID 1's alone: when it fires, the
            # container ends and every process joined into it with it (two readers would
            # split the extensions between them).
            argv += self._init(command, status_w, role, user, env_fd=env_fd,
                               deadline=False)[1:]
            process = await anyio.open_process(
                argv, env=host_env(**{SUPERVISOR_ENV: self.marker}),
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                pass_fds=tuple(fd for fd in (status_w, seccomp, env_fd,
                                             copy.source if copy else None, *container.fds)
                               if fd is not None and fd >= 0),
                start_new_session=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            for fd in (status_w, seccomp, env_fd):
                if fd is not None:
                    os.close(fd)
        return LocalRun(process, status_fd=status_r, info_fd=None, isolation="joined",
                        marker=self.marker)

    async def close(self) -> None:
        """Stop the session's container (harbor): every process in it ends."""
        await self._disconnect()
        if self.container is not None:
            await self.container.stop()
        if self._runc is not None:  # a runc killed at the end leaves its container
            await anyio.to_thread.run_sync(self._runc.delete)
        if self.services is not None:
            await self.services.close()

    async def run_check(self, command: Sequence[str], timeout_s: float, *,
                        env: Mapping[str, str]) -> tuple[int | None, str]:
        """A command as the image's user in the session's sandbox (the healthcheck): its
        exit code (None: it timed out) and the end of its output (at most `CHECK_TAIL`
        bytes, stdout and stderr as they came)."""
        ran = await self.run_command(command, timeout_s, env=env)
        return ran.code, ran.output.decode("utf-8", errors="replace")

    async def run_command(self, command: Sequence[str], timeout_s: float, *,
                          env: Mapping[str, str], user: str | None = None,
                          keep: int = CHECK_TAIL) -> CommandRun:
        """A command in the session's sandbox on `[environment]`'s network (a healthcheck,
        a collect hook), as `user` (range mode: resolved in the image as Docker does, an
        unknown one `OSError`; elsewhere the image's user), under `timeout_s`: its exit and
        the last `keep` bytes of its output, never more held."""
        if self.lifetime == "harbor":  # a healthcheck or hook takes [environment]'s network
            await self._ensure_container()
            await self._use_network("healthcheck")
        run = await self._spawn(list(command), env=env, role="probe", phase="healthcheck",
                                user=self._user_named(user))
        tail = bytearray()
        seen = 0
        read = [anyio.Event(), anyio.Event()]

        async def take(stream: Any, done: anyio.Event) -> None:
            nonlocal seen
            try:
                if stream is not None:
                    async for chunk in stream:
                        seen += len(chunk)
                        tail.extend(chunk)
                        del tail[:-keep]
            finally:
                done.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(take, run.process.stdout, read[0])
                tg.start_soon(take, run.process.stderr, read[1])
                with anyio.move_on_after(timeout_s) as scope:
                    status = await run.wait()
                if scope.cancelled_caught:
                    await run.stop(0.5)
                with anyio.move_on_after(0.2):  # a daemon it left may hold the pipes
                    for done in read:
                        await done.wait()
                tg.cancel_scope.cancel()
            code = None if scope.cancelled_caught else status.return_code
            return CommandRun(code, bytes(tail), seen - len(tail))
        finally:
            await run.aclose()

    def _user_named(self, spec: str | None) -> InnerUser | None:
        """A command's user `spec` inside (range mode; None: the role's user)."""
        if spec is None or self.range is None:
            return None
        assert self.image is not None and self.image.root is not None
        try:
            return resolve_user(self.image.root, spec, (self.image.uid, self.image.gid))
        except SandboxRefused as error:
            raise OSError(str(error)) from None

    async def _verify_in_container(self, timeout_s: float, env: Mapping[str, str] | None
                                   ) -> VerifierRun:
        """The verifier as a process of the session's container (harbor): `/logs/verifier`
        emptied (a folder of ours bound in), a fresh `/tests` copied in by inner root and
        owned by the verifier's user, then `test.sh` as in `verify`."""
        logs = self.root / "verifier-logs"
        if not await self._agent_gone():
            return VerifierRun(None, False, logs, "agent processes outlived the run")
        try:
            await self._ensure_container()
        except OSError as error:
            return VerifierRun(None, False, logs, str(error))
        # What the agent (or a daemon of its) left there, any number of entries: removed in
        # batches (in-process while small, else by `rm`), never a process per entry.
        # Never listed whole (an agent's million names would be held in memory): a batch
        # at a time, for at most REMOVE_ROUNDS batches (a daemon still writing past that
        # leaves its files to the verifier, as it would under Harbor).
        for _ in range(REMOVE_ROUNDS):
            with os.scandir(logs) as entries:
                batch = [entry.name for entry in itertools.islice(entries, REMOVE_BATCH)]
            if not batch:
                break
            remove_tree(*(logs / name for name in batch))
        base = {**self.base_env(), **(env or {}), "TRIALLEDGER_VERIFIER_DIR": VERIFIER_LOGS_INSIDE}
        root = InnerUser(0, 0, ()) if self.range is not None else None
        for staged, inside in self.incoming:  # a separate verifier's artifacts, first
            if not await self._copy_in(staged, inside, min(timeout_s, 60.0), base, user=root):
                return VerifierRun(None, False, logs, f"the artifact {inside} could not be "
                                                      f"copied into the container")
        if self.tests is not None:
            stage = self.root / f"tests-{self._verifications}"
            self._copy_tests(stage)
            if not await self._copy_in(stage, TESTS_INSIDE, min(timeout_s, 60.0), base):
                return VerifierRun(None, False, logs, "the tests could not be copied into "
                                                      "the container")
        assert self.image is not None
        shell = "bash" if self.image.has("bash") else "sh"
        run_it = f'exec "$0" > "$1/{VERIFIER_STDOUT}" 2>&1'
        command = [shell, "-c", run_it, f"{TESTS_INSIDE}/test.sh", VERIFIER_LOGS_INSIDE]
        code, timed_out = await self._run_bounded(command, timeout_s, env=base, role="verifier")
        return VerifierRun(code, timed_out, logs)

    async def _copy_in(self, stage: Path, inside: str, timeout_s: float,
                       env: Mapping[str, str], *, user: InnerUser | None = None,
                       merge: bool = False, role: Role = "verifier") -> bool:
        """A staged folder or file of ours copied by inner root to `inside`, owned by
        `user` (None: the verifier's) — init --copy-in: its parents made, what was there
        moved aside; `merge`: --merge-in, into the folder there — False when it could not
        be."""
        owner = user or self._inner_user("verifier")
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        source = os.open(stage, flags | (os.O_DIRECTORY if stage.is_dir() else 0))
        try:
            code, _ = await self._run_bounded([], timeout_s, env=env, role=role,
                                              copy=CopyIn(source, inside, owner.uid,
                                                          owner.gid,
                                                          "merge" if merge else "copy"))
        finally:
            os.close(source)
        return code == 0

    async def copy_into(self, host: Path, inside: str, *, user: InnerUser | None,
                        merge: bool) -> None:
        """(A multi-step task's next step) the folder `host` copied into the session's
        running container by inner root, as `docker cp` does: merged into the folder
        `inside` (`merge`), else replacing it; owned by `user` (None: root in range mode,
        the one id elsewhere). Never through a link the agent left there: init opens each
        folder without following links. OSError: it could not be."""
        await self._ensure_container()
        staged = self.root / f"copy-in-{os.urandom(6).hex()}"
        shutil.copytree(host, staged, symlinks=True)
        try:
            if self.runs_as.switches:  # inner root reads the staged copy
                chown_tree(staged, self._root_owner)
            root = InnerUser(0, 0, ()) if self.range is not None else self._inner_user("agent")
            if not await self._copy_in(staged, inside, 60.0, self.base_env(),
                                       user=user or root, merge=merge, role="probe"):
                raise OSError(f"{inside} could not be copied into the container")
        finally:
            remove_tree(staged)

    async def clear_inside(self, inside: str) -> None:
        """(Between the steps of a multi-step task, as Harbor's `empty_dirs`) the folder
        `inside` of the running container emptied by its root, no link followed. OSError:
        it could not be."""
        await self._ensure_container()
        code, _ = await self._run_bounded([], 60.0, env=self.base_env(), role="probe",
                                          copy=CopyIn(-1, inside, 0, 0, "clear"))
        if code != 0:
            raise OSError(f"{inside} could not be emptied in the container")

    def bring_in(self, host: Path, inside: str, modes: Mapping[str, int]) -> None:
        """Stage a copy of `host` (a kept file or folder; links stay links) to be placed at
        `inside` before the verifier runs, owned by root (as `docker cp` places it), each
        path `modes` names (relative to `host`; "" is `host`) with that mode: a separate
        verifier's artifacts (docs/SPEC.md §17). The copy is inner root's, so that it can
        read it."""
        staged = self.root / f"incoming-{len(self.incoming)}"
        if host.is_dir() and not host.is_symlink():
            shutil.copytree(host, staged, symlinks=True)
        else:
            shutil.copy2(host, staged, follow_symlinks=False)
        for path, mode in modes.items():
            if not (placed := staged / path if path else staged).is_symlink():
                os.chmod(placed, mode)  # (never through a link: a kept copy holds none)
        if self.runs_as.switches:
            chown_tree(staged, self._root_owner)
        self.incoming.append((staged, inside))


def survivors_gap(names: Sequence[str]) -> dict[str, str] | None:
    """`agent_processes_survived` (SPEC §15) for these survivors, if any."""
    if not names:
        return None
    shown = ", ".join(names[:NAMES_SHOWN]) + (", …" if len(names) > NAMES_SHOWN else "")
    return {"code": "agent_processes_survived",
            "detail": f"{len(names)} processes the agent started still run into the "
                      f"verifier: {shown}"}


