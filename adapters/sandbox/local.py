"""The local sandbox (SPEC §11): bubblewrap, or a process group only when asked for.

Under **bwrap** the agent runs as the unprivileged sandbox user (never mapped to host
root; `identity.py`), with every capability dropped, no nested user namespaces and a
read-only `/proc/sys`. It sees a minimal read-only root (the system folders and `/etc`),
our static init and the Codex binary at private paths under `/run/trialledger`, a
private `/tmp`, fresh `/dev` and `/proc`, its own PID, IPC and UTS namespaces, and the
host's network. Only the workdir and the session folder are writable; the task's tests
are mounted for the verifier only. Workdir `/` runs on a per-session kernel overlay
(lower: the copied workspace, upper: the session's changes). Before every launch the
mount points are cleared of anything the agent planted in its writable layer, so bwrap
never creates a mount point through the agent's symbolic link and the system symlinks
always come from the host. Cleanup is structural: the run is over when its PID namespace
is gone.

bwrap's ability to sandbox is checked before every session, exactly as the session will
run (as the sandbox user, in its cgroups), and a failure is checked once more: a bwrap that
cannot sandbox refuses the session, never falls back. Only when the operator asks for
`isolation="process-group"` does the agent run in its own process group instead — still
as the sandbox user, never as root — every process carrying the `TRIALLEDGER_SUPERVISOR`
marker; cleanup kills the stragglers the marker finds. That mode does not stop the agent
from writing outside its workdir, and every session records it (`isolation`).

This module builds the sandbox, its bwrap command line and its spawns, and serves the
Sandbox protocol. The session folder's layout — its overlays, mount points and, when the
runner is root, the staged binds of mount sources the sandbox user cannot read — is
`layout.py`'s; the phases of the session's container (`verifier_isolation = harbor`) are
`container.py`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from trialledger.adapters.codex.install import CodexInstall
from trialledger.adapters.compose import Compose, Service
from trialledger.adapters.environment import HOST, Environment, resolve_inside
from trialledger.adapters.imagestore import ViewHold, hold_view
from trialledger.adapters.sandbox import runc as runtimes
from trialledger.adapters.sandbox.agentfiles import AgentTree
from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.base import (
    SUPERVISOR_ENV,
    CleanupReport,
    ProbeResult,
    SandboxRefused,
    VerifierRun,
)
from trialledger.adapters.sandbox.bwrap import (
    INIT_INSIDE,
    TESTS_INSIDE,
    VERIFIER_LOGS_INSIDE,
    VERIFIER_STDOUT,
    Role,
    Spawn,
    bwrap_argv,
    mounts,
)
from trialledger.adapters.sandbox.cgroup import CONTROLLERS, SessionCgroup, hold
from trialledger.adapters.sandbox.container import (
    NETWORK_PHASES,
    Container,
    CopyIn,
)
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.sandbox.egress import EgressProxy, egress_problem
from trialledger.adapters.sandbox.folders import (
    forget_session_folder,
    make_session_folder,
    remove_lock_last,
    remove_tree,
)
from trialledger.adapters.sandbox.hostside import env_file, has_program, host_env, program
from trialledger.adapters.sandbox.identity import (
    PROCESS_LIMIT,
    SandboxUser,
    ensure_init,
    sandbox_user,
)
from trialledger.adapters.sandbox.idrange import (
    DOCKER_CAPS,
    InnerUser,
    RangeIds,
    Slot,
    UsernsMaker,
    ensure_filter,
    reserved_range,
    resolve_user,
)
from trialledger.adapters.sandbox.layout import check_granted_paths, chown_tree, clear_planted
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.procscan import kill_marked, pids_in_namespace
from trialledger.adapters.sandbox.runc import RuncContainer
from trialledger.adapters.sandbox.runclaunch import RuncLaunch
from trialledger.adapters.sandbox.services import Services
from trialledger.adapters.sandbox.slirp import RESOLVER, Slirp, hostname_of, slirp_problem

log = logging.getLogger(__name__)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# A recorded session folder without its lock this old is no session being made right now
# (its lock follows its creation within microseconds): a removal or a creation cut short.
ISOLATIONS = ("bwrap", "process-group")
LIFETIMES = ("harbor", "strict")  # verifier_isolation (docs/SPEC.md §15)
RECHECK_AFTER_S = 0.2
HOST_RESOLVER = "/etc/resolv.conf"


def bwrap_problem(user: SandboxUser, cgroups: Sequence[Path] = (),
                  nproc: int = PROCESS_LIMIT, userns_fd: int | None = None) -> str | None:
    """Why bwrap cannot sandbox here as `user` (None: it can): a missing bwrap, no user
    namespaces, or a seccomp/AppArmor policy that forbids them. Run as a session runs (the
    drop to `user` under `nproc`, joined to `cgroups`, in range mode joining the session's
    user namespace `userns_fd`) and, when it fails, once more: a transient failure
    (another session's processes filling a shared limit, say) is never taken for the
    machine's, and nothing is cached."""
    if not has_program("bwrap"):
        return "bwrap is not installed (apt-get install bubblewrap)"
    users = (["--userns", str(userns_fd)] if userns_fd is not None
             else ["--unshare-user", "--disable-userns"])
    command = [*user.staged(ensure_init(), cgroups=cgroups, nproc=nproc), program("bwrap"),
               *users, "--cap-drop", "ALL", "--unshare-pid",
               "--as-pid-1", "--ro-bind", "/", "/", "true"]
    for attempt in range(2):
        if attempt:
            time.sleep(RECHECK_AFTER_S)
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              env=host_env(),
                              pass_fds=() if userns_fd is None else (userns_fd,))
        if done.returncode == 0:
            return None
    return f"bwrap cannot create its namespaces here: {done.stderr.strip()[-200:]}"


class LocalSandbox(RuncLaunch):
    """One session's sandbox on this machine: its construction, the bwrap command line,
    spawning and the Sandbox protocol; its session folder's layout is `SessionLayout`'s
    (layout.py), its container's phases (harbor) `ContainerPhases`' (container.py), its
    container under runc `RuncLaunch`'s (runclaunch.py), its part in a compose environment
    `ComposeParts`' (composed.py; the services themselves: services.py)."""

    def __init__(
        self,
        *,
        session_key: str,
        workdir: str,
        workspace: Path | None = None,
        tests: Path | None = None,
        codex: CodexInstall | None = None,
        readonly_paths: Sequence[Path] = (),
        protected_paths: Sequence[Path] = (),
        isolation: str = "bwrap",
        raise_oom_score_adj: bool = False,
        verifier_root: str = "agent",
        sandbox_uid: int | None = None,
        network: Network | None = None,
        environment: Environment = HOST,
        limits: Mapping[str, float] | None = None,
        users: Mapping[str, str] | None = None,
        switch: DeadManSwitch | None = None,
        lifetime: str = "strict",
        task_env: Mapping[str, str] | None = None,
        allowed_hosts: AllowList | None = None,
        network_modes: Mapping[str, str] | None = None,
        runtime: str | None = None,
        no_new_privileges: bool = False,
        compose: Compose | None = None,
        shares: tuple[LocalSandbox, Service] | None = None,
    ) -> None:
        self.workdir = workdir
        self.environment = environment
        self.image = environment if environment.root is not None else None
        if isolation not in ISOLATIONS:
            raise SandboxRefused(f"isolation {isolation!r}: expected bwrap or process-group")
        self.isolation = isolation
        # What starts a range-mode container (harbor): the OCI runtime `setup` found able
        # unless one is named (None: none can); strict sessions, single-id mode and host
        # tasks always run under bwrap (docs/SPEC.md §16).
        try:
            self.runtime = (runtimes.check_runtime(runtime) if runtime
                            else runtimes.default_runtime())
        except runtimes.RuntimeUnknown as error:
            raise SandboxRefused(str(error)) from None
        self.no_new_privileges = no_new_privileges  # [metadata.trialledger] (runc only)
        self._runc: RuncContainer | None = None
        self._lifeline: int | None = None  # (runc) closed: the container's PID 1 ends it
        self.user = sandbox_user(sandbox_uid)  # never host root, in either isolation
        self.overlay = workdir == "/" or self.image is not None
        self.network = network
        if verifier_root == "pristine" and workdir == "/":
            raise SandboxRefused("verifier_root = pristine needs a workdir other than /")
        self.verifier_root = verifier_root
        if lifetime not in LIFETIMES:
            raise SandboxRefused(f"verifier_isolation {lifetime!r}: expected harbor or strict")
        if lifetime == "harbor" and self.image is None:
            raise SandboxRefused("verifier_isolation = harbor needs an image or rootfs "
                                 "environment: a host task's phases run strict")
        if lifetime == "harbor" and verifier_root == "pristine":
            raise SandboxRefused("verifier_root = pristine cannot be used under "
                                 "verifier_isolation = harbor: one sandbox serves every phase")
        # Each phase's network mode (healthcheck, agent, verifier; docs/SPEC.md §15): a
        # container switches between them; a sandbox per phase (strict) is made on its own.
        outward = "public" if network is not None and network.outward else "no-network"
        self.phase_modes = {phase: (network_modes or {}).get(phase, outward)
                            for phase in NETWORK_PHASES}
        if isolation == "process-group":
            self._refuse_unconfined(environment, network)
        if (self.image is not None and isolation == "bwrap"
                and "public" in self.phase_modes.values()
                and (problem := slirp_problem()) is not None):
            raise SandboxRefused(f"a public network for an image's container needs "
                                 f"slirp4netns: {problem}")
        if allowed_hosts is not None and (
                problem := egress_problem() or slirp_problem()) is not None:
            raise SandboxRefused(f"network_mode = 'allowlist' cannot be set up here: "
                                 f"{problem}")
        self.allowed_hosts = allowed_hosts
        # Docker's capabilities, less NET_RAW under an allowlist (a packet socket would
        # pass beside its rules)
        self.caps = tuple(cap for cap in DOCKER_CAPS
                          if not (allowed_hosts is not None and cap == "CAP_NET_RAW"))
        self.egress: EgressProxy | None = None
        # Where the egress proxy reports a refused connection (the runner's gap)
        self.egress_sink: Callable[[str], Awaitable[None]] | None = None
        self.lifetime = lifetime
        self.container: Container | None = None  # harbor: the session's one sandbox
        self.slirp: Slirp | None = None  # its outward connection (a public network)
        self._net_namespace: int | None = None  # its network namespace (once it runs)
        self._resolver: Path | None = None
        # [environment] env, for the container's PID 1, over compose's `main` environment
        self.task_env = {**(compose.main.env if compose is not None else {}),
                         **(task_env or {})}
        self.init = ensure_init()
        self.codex = codex
        self.tests = tests
        self.incoming: list[tuple[Path, str]] = []  # placed before the verifier (harbor)
        self.readonly_paths = check_granted_paths(readonly_paths,
                                                  [*protected_paths, *([tests] if tests else [])])
        self.marker = session_key
        self.oom_score_adj = 1000 if raise_oom_score_adj else None
        # Recorded, then made, then locked — before anything (config.toml's grant tokens)
        # is written in it. The lock is held while the session lives: a folder whose lock is
        # free was left by a crash.
        self.root, self._lock = make_session_folder(session_key)
        self._view: ViewHold | None = None  # (range mode) its image's view, held
        self._verifications = 0
        self.limits = dict(limits or {})
        self.cgroup: SessionCgroup | None = None
        self.limits_reason: str | None = None
        self.range: RangeIds | None = None
        self.users = dict(users or {})  # phase → its `user` (range mode honours them)
        self.switch = switch  # a job trial's lease: every process killed once it lapses
        # (a compose service's sandbox) the session's it shares a slot, user and network
        # namespaces and cgroups with, and the service it runs (adapters/sandbox/services.py)
        self.shares = shares
        self.services: Services | None = None  # (a compose task) the other services
        self.compose_needs = dict(compose.main.depends_on) if compose is not None else {}
        # (a compose task) every phase public: each service in a network namespace of its
        # own on the session's bridge (bridge.py); else all in the session's one
        self.bridged = (compose is not None and set(self.phase_modes.values()) == {"public"}
                        and allowed_hosts is None)
        self.bridge_fd: int | None = None  # (bridged) the bridge's network namespace
        # (a compose task) the volumes this container mounts: main's, or its service's
        self.volumes = (shares[1].volumes if shares is not None
                        else compose.main.volumes if compose is not None else ())
        making = None  # (range mode) the session's user namespace, begun first
        try:
            if self.image is not None:  # read through its view while the session lives
                self._view = hold_view(self.image)
            if shares is not None:
                self.range, self.cgroup = self._shared_range(*shares), shares[0].cgroup
            else:
                if self.image is not None and self.image.plain:
                    making = self._begin_range()
                self.cgroup, self.limits_reason = hold(self.limits, self.root.name)
            if making is not None:
                self.range, making = self._take_range(making), None
            if compose is not None and compose.others:
                self.services = self._compose_services(compose)
            if self.on_runc and not has_program(self.runtime or ""):
                raise SandboxRefused(f"--runtime {self.runtime}: {self.runtime} is not "
                                     f"installed (apt-get install {self.runtime})")
            if isolation == "bwrap" and not self.on_runc and (problem := bwrap_problem(
                    self.runs_as, self._cgroup_procs, self._nproc,
                    self.range.userns_fd if self.range else None)) is not None:
                raise SandboxRefused(f"{problem} (refusing to run the agent unconfined; "
                                     f"--isolation process-group runs it without a sandbox)")
            self._lay_out(workspace)
            if any(self._connected(phase) for phase in NETWORK_PHASES) and (
                    self.image is not None or (  # (over the host's, a link
                    os.path.isfile(HOST_RESOLVER) and not os.path.islink(HOST_RESOLVER))):
                # would be followed inside, to nowhere)
                self._resolver = self.root / "resolv.conf"
                self._resolver.write_text(f"nameserver {RESOLVER}\n", encoding="ascii")
        except BaseException:
            if making is not None:
                making.abandon()
                making.slot.release()
            self.discard()
            raise
        if isolation == "process-group":
            log.warning("session %s runs in a process group as uid %d, not in a sandbox "
                        "(isolation: process-group)", session_key, self.user.uid)

    def _refuse_unconfined(self, environment: Environment, network: Network | None) -> None:
        """What a process group cannot do safely: an image, workdir /, a private network
        (for any phase)."""
        if self.image is not None:
            raise SandboxRefused(f"the task's {environment.kind} environment needs bwrap; "
                                 f"--isolation process-group cannot run it")
        if self.overlay:
            raise SandboxRefused("workdir / needs a per-session overlay, which needs bwrap; "
                                 "refusing to let the agent write to the host's root")
        if network is not None and network.isolated:
            raise SandboxRefused("allow_internet = false needs a private network namespace, "
                                 "which needs bwrap; --isolation process-group cannot run it")
        if network is not None and (modes := sorted(
                {mode for mode in self.phase_modes.values() if mode != "public"})):
            raise SandboxRefused(f"network_mode = {modes[0]!r} needs a private network "
                                 f"namespace, which needs bwrap; --isolation process-group "
                                 f"cannot run it")

    # --- each phase's network (strict: a sandbox per phase) ---------------------------------

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
        if self.lifetime == "harbor" or self.network is None or self.isolation != "bwrap":
            return False
        mode = self.phase_modes[phase]
        return mode == "allowlist" or (mode == "public" and self.image is not None)

    def _begin_range(self) -> UsernsMaker:
        """A slot of the sandbox user's range, and the making of the session's user
        namespace over it begun (a plain cache entry is only ever mounted this way)."""
        ids = reserved_range()
        if os.geteuid() != 0 or ids is None:
            raise SandboxRefused("this image's cache entry keeps its own ownership (range "
                                 "mode), which needs a root runner after `trialledger setup`")
        if self.runtime is None:
            raise SandboxRefused(f"this image's cache entry keeps its own ownership (range "
                                 f"mode), which needs a runtime that can start a container "
                                 f"here: {runtimes.range_unavailable()}")
        slot = Slot.acquire(ids)
        try:
            return UsernsMaker(self.init, slot, net=self._wants_runc)
        except BaseException:
            slot.release()
            raise

    def _take_range(self, making: UsernsMaker) -> RangeIds:
        """The session's range ids once its cgroup is held: each role's user read from the
        image, the user namespace finished."""
        assert self.image is not None and self.image.root is not None
        if self.cgroup is None or "pids" not in self.cgroup.held:
            raise SandboxRefused(f"range mode needs a pids cgroup of the session's own "
                                 f"({self.limits_reason})")
        ensure_filter()
        image_user = (self.image.uid, self.image.gid)
        specs = {role: self.users.get(role) if role in ("agent", "verifier") else None
                 for role in ("agent", "probe", "verifier", "container")}
        resolved = {spec: resolve_user(self.image.root, spec, image_user)  # each read once
                    for spec in set(specs.values())}
        users = {role: resolved[spec] for role, spec in specs.items()}
        userns = making.finish()
        return RangeIds(making.slot, userns, users, making.net_fd)

    def _compose_services(self, compose: Compose) -> Services:
        """The other services of a compose task, each made (when it starts) as a sandbox
        sharing this one's (services.py)."""
        if self.range is None or not self.on_runc or self.lifetime != "harbor":
            raise SandboxRefused("a compose environment needs range mode on an OCI runtime "
                                 "(runc) and verifier_isolation = harbor")
        images = dict(self.environment.services)
        missing = [s.name for s in compose.others if s.name not in images]
        if missing:
            raise SandboxRefused(f"compose service {missing[0]}: no image was prepared for it "
                                 f"(verifiermode.prepare_task prepares it)")

        def make(service: Service) -> LocalSandbox:
            image = images[service.name]
            return LocalSandbox(
                session_key=str(uuid.uuid4()), workdir=service.working_dir or image.workdir,
                environment=image, runtime=self.runtime, lifetime="harbor",
                no_new_privileges=self.no_new_privileges, sandbox_uid=self.user.uid,
                task_env=service.env, switch=self.switch, shares=(self, service),
                network_modes=self.phase_modes)
        return Services([s for s in compose.services if s.name != "main"], make)

    @property
    def _wants_runc(self) -> bool:
        """Whether the session's container is to start under an OCI runtime (runc, crun),
        if range mode holds."""
        return (self.runtime in runtimes.OCI and self.lifetime == "harbor"
                and self.isolation == "bwrap")

    @property
    def on_runc(self) -> bool:
        """Whether the session's container starts under an OCI runtime (range mode,
        harbor)."""
        return self._wants_runc and self.range is not None

    @property
    def launched_isolation(self) -> str:
        """`agent.launched.isolation`: what confines the agent (runc, crun, bwrap,
        process-group)."""
        return self.runtime if self.on_runc and self.runtime else self.isolation

    @property
    def runs_as(self) -> SandboxUser:
        """Who bwrap runs as on the host: the sandbox user, or (range) the slot's first id."""
        return self.range.runs_as if self.range is not None else self.user

    def owner(self, role: Role = "agent") -> tuple[int, int]:
        """The host ids of a role's files: the sandbox user's, or (range) the role's user's
        in the slot."""
        if self.range is not None:
            inner = self.range.users[role]
            return self.range.slot.host(inner.uid), self.range.slot.host(inner.gid)
        return self.user.uid, self.user.gid

    @property
    def agent_owner(self) -> tuple[int, int]:
        """The host ids of the agent's files."""
        return self.owner("agent")

    def give(self, top: Path) -> None:
        """Hand a tree the runner made for the agent to its user (links not followed)."""
        if self.runs_as.switches:
            chown_tree(top, self.agent_owner)

    @property
    def _root_owner(self) -> tuple[int, int]:
        """The host ids of what inner root owns: the sandbox user's, or the slot's first."""
        return (self.runs_as.uid, self.runs_as.gid)

    def identity_record(self) -> dict[str, str]:
        """`agent.launched.identity` (schema 3): the id mode and the inner uid:gid every
        phase runs as: range mode (the image's user in the session's own 65,536 ids), else
        one inner id (the image's user, else the sandbox uid) mapped onto the sandbox uid,
        without capabilities."""
        if self.range is not None:
            agent = self.range.users["agent"]
            return {"mode": "range", "user": f"{agent.uid}:{agent.gid}"}
        uid, gid = ((self.image.uid, self.image.gid) if self.image is not None
                    else (self.user.uid, self.user.gid))
        return {"mode": "single", "user": f"{uid}:{gid}"}

    @property
    def _cgroup_procs(self) -> tuple[Path, ...]:
        return self.cgroup.procs if self.cgroup is not None else ()

    @property
    def _nproc(self) -> int:
        """The sandbox user's process rlimit for this session: none (0) when a pids cgroup
        of the session's own holds its processes, else the shared `PROCESS_LIMIT`."""
        return 0 if self.cgroup is not None and "pids" in self.cgroup.held else PROCESS_LIMIT

    def limits_record(self) -> dict[str, Any] | None:
        """`agent.launched.limits`: what the task asked for, and whether it holds (also
        when nothing was asked for but the session has no process limit of its own)."""
        if not self.limits and self.limits_reason is None:
            return None
        return {"requested": {key: self.limits.get(key) for key in CONTROLLERS},
                "enforced": self.limits_reason is None, "reason": self.limits_reason}

    # --- paths ------------------------------------------------------------------------------

    @property
    def agent_workdir(self) -> str:
        """The agent's working folder as the agent sees it."""
        return self.workdir if self.isolation == "bwrap" else str(self.host_work)

    @property
    def codex_argv0(self) -> str:
        """How the agent's command names Codex (inside the sandbox, or on the host)."""
        assert self.codex is not None
        return self.codex.inside if self.isolation == "bwrap" else str(self.codex.entrypoint)

    @property
    def codex_path_dir(self) -> str | None:
        """A folder of Codex's helpers (rg) to put on the agent's PATH."""
        if self.codex is None or not self.codex.helpers:
            return None
        if self.isolation == "bwrap":
            return self.codex.path_dir
        return str(next(iter(self.codex.helpers.values())).parent)

    def agent_files(self, folder: Path, role: Role = "agent") -> AgentTree:
        """Safe reads of a folder the agent (or the verifier, `role`) could write, as that
        role's user on the host."""
        return AgentTree(folder, *self.owner(role))

    # --- the bwrap command line -------------------------------------------------------------

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

    # --- the Sandbox protocol ---------------------------------------------------------------

    async def launch(self, argv: Sequence[str], *, env: Mapping[str, str], stdin: bytes
                     ) -> LocalRun:
        """Start the agent with its prompt on stdin (harbor: in the session's container,
        noting what already runs there)."""
        if self.lifetime == "harbor":
            (await self._ensure_container()).mark_agent_start()
        run = await self._spawn(argv, env=env, role="agent", stdin=True)
        self._agent = run
        assert run.process.stdin is not None
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await run.process.stdin.send(stdin)
            await run.process.stdin.aclose()
        return run

    _agent: LocalRun | None = None

    async def confirm_cleanup(self, run: LocalRun, timeout_s: float) -> CleanupReport:
        """Bounded wait until no process of the run is left (structural under bwrap); under
        harbor until the agent's own process group is gone (its detached processes are
        reported as `survivors`)."""
        if run.isolation == "joined":
            with anyio.move_on_after(timeout_s):
                await run.process.wait()
            if run.group_gone is not True:
                return CleanupReport(False, f"the agent's process group was not confirmed "
                                            f"gone within {timeout_s:g} s")
            assert self.container is not None
            return CleanupReport(True, survivors=tuple(self.container.survivors()))
        if self.isolation == "bwrap":
            namespace = run.info().get("pid-namespace")
            if not isinstance(namespace, int):
                return CleanupReport(False, "bwrap reported no PID namespace")
            leftover: list[int] = []
            with anyio.move_on_after(timeout_s):
                while leftover := pids_in_namespace(namespace):
                    await anyio.sleep(0.05)
            if leftover:
                return CleanupReport(False, f"{len(leftover)} processes still in the sandbox's "
                                            f"PID namespace after {timeout_s:g} s")
            return CleanupReport(True)
        return await kill_marked(self.marker, timeout_s)

    async def _agent_gone(self) -> bool:
        """Whether every process of the agent's run is gone (killing any straggler)."""
        if self._agent is None:
            return True
        if self._agent.isolation == "joined":  # its group was killed when it ended
            if self._agent.process.returncode is None:
                await self._agent.stop(0.5)
            return self._agent.group_gone is True
        report = await self.confirm_cleanup(self._agent, 2.0)
        if not report.confirmed and self.isolation == "bwrap":
            namespace = self._agent.info().get("pid-namespace")
            for pid in pids_in_namespace(namespace) if isinstance(namespace, int) else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            report = await self.confirm_cleanup(self._agent, 2.0)
        return report.confirmed

    async def probe(self, timeout_s: float, command: Sequence[str] | None = None
                    ) -> ProbeResult:
        """Alive when a process runs in a fresh sandbox in the workdir within the limit: by
        default our own init (`--probe`), so no program of the environment is needed."""
        if command is None:
            command = [INIT_INSIDE if self.isolation == "bwrap" else str(self.init), "--probe"]
            name = "the init probe"
        else:
            name = f"`{' '.join(command)}`"
        code, timed_out = await self._run_bounded(list(command), timeout_s,
                                                  env=self.base_env(), role="probe")
        if timed_out:
            return ProbeResult(False, f"{name} did not finish within {timeout_s:g} s")
        if code != 0:
            return ProbeResult(False, f"{name} exited with {code}")
        return ProbeResult(True, f"{name} ran in the workdir")

    def base_env(self) -> dict[str, str]:
        """The probe's and verifier's environment: PATH (the image's, over an image), LANG
        and LC_ALL."""
        env = _minimal_env()
        if self.image is not None:
            env["PATH"] = self.image.path
        return env

    async def verify(self, timeout_s: float, env: Mapping[str, str] | None = None
                     ) -> VerifierRun:
        """Run the tests as Harbor does, once every agent process is gone: a fresh,
        writable copy of the task's `tests/` at `/tests`, an empty `/logs/verifier`, and
        `/tests/test.sh` executed in the workdir (its shebang honoured; without one the
        shell runs it: bash where there is one, else sh) with `env` over the base
        environment, its stdout and stderr together into `/logs/verifier/test-stdout.txt`."""
        self._verifications += 1
        if self.lifetime == "harbor":
            return await self._verify_in_container(timeout_s, env)
        logs = self.root / f"verifier-{self._verifications}"
        logs.mkdir(mode=0o700)
        if self.runs_as.switches:
            os.chown(logs, *self.owner("verifier"))
        if not await self._agent_gone():
            return VerifierRun(None, False, logs, "agent processes outlived the run")
        run_it = f'exec "$0" > "$1/{VERIFIER_STDOUT}" 2>&1'
        if self.isolation == "bwrap":
            self._tests_bound = self._fresh_tests()
            shell = "bash" if self.image is None or self.image.has("bash") else "sh"
            command = [shell, "-c", run_it, f"{TESTS_INSIDE}/test.sh", VERIFIER_LOGS_INSIDE]
            env = {**self.base_env(), **(env or {}),
                   "TRIALLEDGER_VERIFIER_DIR": VERIFIER_LOGS_INSIDE}
        else:
            tests = self._unconfined_tests()
            command = ["bash", "-c", run_it, str(tests / "test.sh"), str(logs)]
            env = {**_minimal_env(), **(env or {}), "TRIALLEDGER_VERIFIER_DIR": str(logs),
                   "TRIALLEDGER_TESTS_DIR": str(tests)}
        code, timed_out = await self._run_bounded(command, timeout_s, env=env, role="verifier",
                                                  verifier_logs=logs)
        return VerifierRun(code, timed_out, logs)

    def _copy_tests(self, target: Path) -> None:
        """The task's tests copied to `target` (links as links), the sandbox user's, with
        `test.sh` executable (Harbor's `chmod +x`)."""
        assert self.tests is not None
        shutil.copytree(self.tests, target, symlinks=True, dirs_exist_ok=True)
        script = target / "test.sh"
        if script.is_file() and not script.is_symlink():
            script.chmod(script.stat().st_mode | 0o111)
        if self.runs_as.switches:
            chown_tree(target, self._root_owner if self.range is not None else self.agent_owner)

    def _fresh_tests(self) -> Path | None:
        """The verifier's `/tests`: over an overlay that is its root, a real folder of its
        layer (so a verifier may move it, as in a container), whatever the agent left
        there removed first and the image's own `/tests` merged in below; else a fresh
        copy the sandbox binds (returned)."""
        if self.tests is None:
            return None
        if self.overlay and not self._pristine_view("verifier"):
            clear_planted(self.root / "upper", TESTS_INSIDE, whole=True)
            layer = self.root / "upper" / TESTS_INSIDE.lstrip("/")
            if os.path.lexists(layer):
                remove_tree(layer)
            self._copy_tests(layer)
            return None
        copy = self.root / f"tests-{self._verifications}"
        self._copy_tests(copy)
        return copy

    def _unconfined_tests(self) -> Path:
        """The tests as a process-group verifier reads them: a copy of its own, made after
        the agent is gone (it runs as the sandbox user)."""
        if self.tests is None:
            return Path("/nonexistent")
        copy = self.root / f"tests-{self._verifications}"
        self._copy_tests(copy)
        return copy

    _tests_bound: Path | None = None
    _discarded = False

    async def _run_bounded(self, command: list[str], timeout_s: float, *,
                           env: Mapping[str, str], role: Role,
                           verifier_logs: Path | None = None,
                           copy: CopyIn | None = None
                           ) -> tuple[int | None, bool]:
        run = await self._spawn(command, env=env, role=role, verifier_logs=verifier_logs,
                                copy=copy)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain, run.process.stdout)
                tg.start_soon(_drain, run.process.stderr)
                with anyio.move_on_after(timeout_s) as scope:
                    status = await run.wait()
                if scope.cancelled_caught:
                    await run.stop(0.5)
                    if run.isolation != "joined":  # a joined run's group dies with it
                        await kill_marked(self.marker, 2)
                    tg.cancel_scope.cancel()
                    return None, True
            return status.return_code, False
        finally:
            await run.aclose()

    def discard(self) -> None:
        """Remove the session's folders (they hold config.toml with grant tokens), and its
        cgroup with whatever is left in it; then (range mode) free its slot. Once: a
        separate verifier discards the agent's before the session ends (§17)."""
        if self._discarded:
            return
        self._discarded = True
        try:
            if self.container is not None:
                if self.container.run.process.returncode is None:
                    self.container.run.process.kill()  # `close` was not awaited: bwrap's
                    # PID 1 dies with it, and the cgroup's removal below takes what is left
                self.container.release()
            if self._runc is not None:  # runc's container outlives a killed runc
                self._runc.delete()
            if self.slirp is not None:  # (`close` stops it: here it was not awaited)
                self.slirp.kill()
                self.slirp = None
            if self._lifeline is not None:
                with contextlib.suppress(OSError):
                    os.close(self._lifeline)
                self._lifeline = None
            if self.services is not None:  # their containers, in the cgroup removed below
                self.services.discard()
            if self.cgroup is not None and self.shares is None:  # (a service's is the
                self.cgroup.remove()  # session's)
            self.cgroup = None
            try:
                remove_lock_last(self.root)
            finally:
                with contextlib.suppress(OSError):
                    os.close(self._lock)
            forget_session_folder(self.root)
        finally:
            if self._view is not None:  # unmounted unless another session holds it
                self._view.release()
                self._view = None
            if self.range is not None and self.shares is None:  # the slot is free once
                # the folder is gone (a service's are the session's)
                for fd in (self.range.userns_fd, self.range.netns_fd, self.bridge_fd):
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                self.bridge_fd = None
                self.range.slot.release()
            self.range = None


def _minimal_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}


async def _drain(stream: Any) -> None:
    if stream is not None:
        async for _ in stream:
            pass
