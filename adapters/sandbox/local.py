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

This module builds the sandbox and serves the Sandbox protocol; its parts are the other
modules' (a chain of classes, each a part of `LocalSandbox`): who its processes are
(`sessionids.py`), the session folder's layout — its overlays, mount points and, when the
runner is root, the staged binds of mount sources the sandbox user cannot read
(`layout.py`), the phases of the session's container under `verifier_isolation = harbor`
(`container.py`) and under runc (`runclaunch.py`), its part in a compose environment
(`composed.py`), each spawn and its bwrap command line (`spawning.py`), and the probe and
the verifier (`phases.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path

import anyio

from trialledger.adapters.codex.install import CodexInstall
from trialledger.adapters.images.environment import HOST, Environment
from trialledger.adapters.images.imagestore import ViewHold, hold_view
from trialledger.adapters.sandbox import runc as runtimes
from trialledger.adapters.sandbox.agentfiles import AgentTree
from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.base import (
    CleanupReport,
    SandboxRefused,
)
from trialledger.adapters.sandbox.bwrap import (
    Role,
)
from trialledger.adapters.sandbox.cgroup import SessionCgroup, hold
from trialledger.adapters.sandbox.container import NETWORK_PHASES
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.sandbox.egress import EgressProxy, egress_problem
from trialledger.adapters.sandbox.folders import (
    forget_session_folder,
    make_session_folder,
    remove_lock_last,
)
from trialledger.adapters.sandbox.hostside import has_program, host_env, program
from trialledger.adapters.sandbox.identity import (
    PROCESS_LIMIT,
    SandboxUser,
    ensure_init,
    sandbox_user,
)
from trialledger.adapters.sandbox.idrange import (
    DOCKER_CAPS,
    RangeIds,
)
from trialledger.adapters.sandbox.layout import check_granted_paths
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.sandbox.phases import PhaseRuns
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.procscan import kill_marked, pids_in_namespace
from trialledger.adapters.sandbox.runc import RuncContainer
from trialledger.adapters.sandbox.running import Container
from trialledger.adapters.sandbox.services import Services
from trialledger.adapters.sandbox.slirp import RESOLVER, Slirp, slirp_problem
from trialledger.adapters.tasks.compose import Compose, Service

log = logging.getLogger(__name__)
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


class LocalSandbox(PhaseRuns):
    """One session's sandbox on this machine: its construction, the agent's launch, its
    cleanup and discard; its parts are its bases' (this module's docstring lists them)."""

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
        later_modes: Collection[str] = (),
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
        self._gate: int | None = None  # (a bridged compose service) written: its command runs
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
        # ... and every mode a phase may be switched to later (a multi-step task's steps:
        # `use_modes`), which what is set up once (slirp4netns, a compose bridge) allows for
        self.modes_used = frozenset({*self.phase_modes.values(), *later_modes})
        if isolation == "process-group":
            self._refuse_unconfined(environment, network)
        if (self.image is not None and isolation == "bwrap"
                and "public" in self.modes_used
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
        # (a compose service's: its own `cap_add` / `cap_drop`, compose.py)
        self.caps = tuple(cap for cap in (shares[1].caps if shares is not None else DOCKER_CAPS)
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
        self.bridged = (compose is not None and self.modes_used == {"public"}
                        and allowed_hosts is None)
        self.bridge_fd: int | None = None  # (bridged) the bridges' network namespace
        # (a compose task) its networks, and main's among them (bridge.py)
        self.networks = compose.networks if compose is not None else ()
        self.main_networks = compose.main.networks if compose is not None else ()
        # (a compose task) `main` on `internal` networks alone: no phase has a way out (in
        # one namespace, every container is on main's networks: none has)
        self.walled = compose is not None and compose.main.walled
        if compose is not None and len({frozenset(s.networks) for s in compose.services
                                        if not s.isolated}) > 1 and not self.bridged:
            # (all on the same ones: as the default network)
            raise SandboxRefused(f"compose networks ({', '.join(self.networks)}) need every "
                                 f"phase of the session public here, each a bridge (its "
                                 f"phases: {', '.join(sorted(self.modes_used))})")
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
                {mode for mode in self.modes_used if mode != "public"})):
            raise SandboxRefused(f"network_mode = {modes[0]!r} needs a private network "
                                 f"namespace, which needs bwrap; --isolation process-group "
                                 f"cannot run it")

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
                no_new_privileges=self.no_new_privileges or service.no_new_privileges,
                sandbox_uid=self.user.uid, task_env=service.env, switch=self.switch,
                shares=(self, service), network_modes=self.phase_modes,
                # (its own container's process limit, within the session's cgroup)
                limits={"pids": service.pids_limit} if service.pids_limit else None)
        return Services([s for s in compose.services if s.name != "main"], make)

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

    _discarded = False

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
            self.open_gate(close_only=True)
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
