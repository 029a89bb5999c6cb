"""A sandbox's part in a compose environment (docs/SPEC.md §17 "Compose environments";
services.py starts the services): `ComposeParts`, a part of `LocalSandbox` (local.py) —
for the session's own sandbox, the services it started, their gaps and where their names
resolve; for a service's sandbox (made with `shares=`), its start, its place on the
session's bridge (bridge.py) and its end.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import anyio

from trialledger.adapters.sandbox import bridge
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.idrange import RangeIds, resolve_user
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.services import Services
from trialledger.adapters.tasks.compose import Service

ENDED_S = 10.0  # how long a container that ended as it started takes to report its end

if TYPE_CHECKING:
    from trialledger.adapters.images.environment import Environment
    from trialledger.adapters.sandbox.allowlist import AllowList


class ComposeParts:
    """The compose parts of a sandbox (a part of `LocalSandbox`)."""

    # Set by LocalSandbox's construction
    services: Services | None  # (a compose task) its other services, started before it
    shares: tuple[Any, Service] | None  # (a compose service's own) the session's, its service
    bridged: bool  # (a compose task) each service on the session's bridge (bridge.py)
    bridge_fd: int | None  # (a bridged compose task) the bridges' network namespace, once made
    networks: tuple[str, ...]  # (a compose task) its networks, a bridge each when bridged
    main_networks: tuple[str, ...]  # (a compose task) those `main` is on
    init: Any  # our init's path (identity.py)
    container: Any  # ContainerPhases' `Container` (container.py), once started
    phase_modes: dict[str, str]  # each phase's network mode
    walled: bool  # (a compose task) `main` on `internal` networks alone: no way out
    modes_used: frozenset[str]  # ... and those a later step's phases may switch to
    allowed_hosts: AllowList | None
    image: Environment | None
    ended_code: int | None = None  # a container that ended as it started: its exit code

    def _shared_range(self, session: Any, service: Service) -> RangeIds:
        """A compose service's range ids: the session's slot, user namespace and (unless
        bridged or `network_mode: none`: runc makes one) network namespace, its users the
        service's `user` (else its image's), read from its own image."""
        assert self.image is not None and self.image.root is not None
        if session.range is None or not session.on_runc:
            raise SandboxRefused("a compose service runs only beside a range-mode session's "
                                 "container on an OCI runtime")
        user = resolve_user(self.image.root, service.user, (self.image.uid, self.image.gid))
        return RangeIds(session.range.slot, session.range.userns_fd,
                        dict.fromkeys(("agent", "probe", "verifier", "container"), user),
                        None if session.bridged or service.isolated
                        else session.range.netns_fd)

    if TYPE_CHECKING:  # ContainerPhases': the container and its way out
        async def _ensure_container(self) -> Any: ...

        async def _connect(self) -> None: ...

        def open_gate(self, *, close_only: bool = False) -> None: ...

        def _container_env(self) -> dict[str, str]: ...

    @property
    def _resolves(self) -> bool:
        """Whether some phase of the session is connected outward (its resolver answers):
        a service's session decides for it — never for a container on `internal` networks
        alone, which has no way out (its hostname then names 127.0.0.1, its resolv.conf is
        empty: a lookup fails at once rather than waiting on a resolver that is not there)."""
        if self.shares[1].walled if self.shares is not None else self.walled:
            return False
        session = self.shares[0] if self.shares is not None else self
        return "public" in session.modes_used or session.allowed_hosts is not None

    @property
    def _neighbours(self) -> list[tuple[str, str]]:
        """(address, name) of `main` and the compose services, for this container's
        /etc/hosts: bridged, those sharing a network with it at their address there; else
        every one at 127.0.0.1 (one namespace)."""
        session = self.shares[0] if self.shares is not None else self
        if session.services is None:
            return []
        names = session.services.names
        if self.shares is not None and self.shares[1].isolated:
            return []  # (`network_mode: none`: nobody to name)
        if not session.bridged:
            return [("127.0.0.1", name) for name in ("main", *names)
                    if name not in {s.name for s in session.services.specs if s.isolated}]
        me = names.index(self.shares[1].name) if self.shares is not None else None
        return [(found, "main" if member is None else names[member])
                for found, member in bridge.hosts(_on(session), me)]

    async def start_service(self) -> int | None:
        """(a compose service's sandbox) its container started: None while it runs, its
        exit code when it ended as it started (OSError: it could not start)."""
        try:
            container = await self._ensure_container()
        except OSError:  # (ContainerFailed: it ended as it started)
            if self.ended_code is not None:
                return self.ended_code
            raise
        if self.shares is not None and self.shares[0].bridged and not self.shares[1].isolated:
            # its own network: on the session's bridges, and outward by a slirp4netns
            # (none on `internal` networks alone, as Docker's) — then its command starts,
            # as Docker starts it on networks already made
            session, made = self.shares[0], False
            try:
                await anyio.to_thread.run_sync(functools.partial(
                    _bridged, session, container.namespace_fd("net"),
                    session.services.names.index(self.shares[1].name)))
                if not self.shares[1].walled:
                    await self._connect()
                made = True
            except SandboxRefused as error:
                raise OSError(str(error)) from None
            finally:  # (not made: its command never starts)
                self.open_gate(close_only=not made)
        return None

    def service_boxes(self) -> list[tuple[str, Any]]:
        """(a compose task) Each started service's name and sandbox, in start order."""
        return list(self.services.boxes.items()) if self.services is not None else []

    def hook_env(self) -> dict[str, str]:
        """(a compose service's sandbox) A collect hook's environment: its PID 1's."""
        return self._container_env()

    def services_exited(self) -> list[dict[str, str]]:
        """Gap `service_exited` for each compose service that ended while the session ran
        (each once; one whose end `main` waited for is none)."""
        if self.services is None:
            return []
        return [{"code": "service_exited", "detail": f"compose service {name} exited with "
                                                      f"{code}"}
                for name, code in self.services.exited()]

    async def _note_end(self, run: LocalRun) -> None:
        """Keep the exit code of a container that ended as it started (runc's is its PID
        1's: a compose service that completed at once)."""
        with anyio.move_on_after(ENDED_S):
            await run.process.wait()
        self.ended_code = run.process.returncode

    def service_exit(self) -> int | None:
        """(a compose service's sandbox) its container's exit code once it ended."""
        if self.container is None:
            return self.ended_code
        if self.container.lost() is None:
            return None
        code: int | None = self.container.run.process.returncode
        return code


def _on(session: Any) -> list[list[int]]:
    """The networks (their bridges' numbers) `main` is on, then each service's."""
    specs = [(session.main_networks), *(s.networks for s in session.services.specs)]
    return [[session.networks.index(name) for name in names] for names in specs]


def _bridged(session: Any, service_netns: int, index: int) -> None:
    """The service at `index` (its network namespace `service_netns`) on its networks'
    bridges, made with `main` on its own when the first service starts (bridge.py)."""
    on = _on(session)
    if session.bridge_fd is None:
        made = bridge.make(session.range.userns_fd, session.init)
        try:
            bridge.start(made, session.range.netns_fd, len(session.networks), on[0])
        except BaseException:
            os.close(made)
            raise
        session.bridge_fd = made
    bridge.attach(session.bridge_fd, service_netns, index, on[index + 1])
