"""A session's network, phase by phase (docs/SPEC.md §15): `ContainerNetwork`, a part of
`LocalSandbox` (local.py) — the container's network switched to each phase's mode before
the phase runs, as Harbor switches its egress sidecar (`public`: slirp4netns; `allowlist`:
its nftables rules and our egress proxy inside; `no-network`: neither), a strict phase's
sandbox of its own connected the same way, and a way out that died noticed once.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.egress import (
    NO_RULES,
    EgressProxy,
    apply_rules,
    egress_rules,
    open_ping,
)
from trialledger.adapters.sandbox.network import Network, listen_inside
from trialledger.adapters.sandbox.running import Container
from trialledger.adapters.sandbox.slirp import Slirp, start_slirp

EGRESS_PORT = 15001  # where an allowlist's egress proxy listens in the container


class ContainerNetwork:
    """The session's network, phase by phase (a part of `LocalSandbox`)."""

    # Set by LocalSandbox's construction
    container: Container | None  # the session's one sandbox, once started
    network: Network | None
    allowed_hosts: AllowList | None
    egress: EgressProxy | None
    egress_sink: Callable[[str], Awaitable[None]] | None  # where a refused connection goes
    slirp: Slirp | None  # the container's outward connection (a public network)
    phase_modes: dict[str, str]  # NETWORK_PHASES → the phase's network mode
    modes_used: frozenset[str]  # ... and those a later step's phases may switch to
    walled: bool  # (a compose task) `main` on `internal` networks alone: never a way out
    _net_namespace: int | None  # the container's network namespace's inode (bwrap's)
    shares: tuple[Any, Any] | None  # (a compose service's own) the session's, its service

    def use_modes(self, modes: Mapping[str, str]) -> None:
        """A step's `agent` and `verifier` network modes (adapters/session/steprun.py), for
        its phases from now on: the container switches to them as to any phase's
        (`_use_network`). Each must be one the sandbox was made for (`modes_used`)."""
        for phase in ("agent", "verifier"):
            mode = modes.get(phase, self.phase_modes[phase])
            if mode not in self.modes_used:
                raise SandboxRefused(f"network_mode = {mode!r} for the {phase} phase: the "
                                     f"sandbox was not made for it")
            self.phase_modes[phase] = mode

    async def use_baseline(self) -> None:
        """The container back on `[environment]`'s network mode (Harbor restores its
        baseline policy when a phase ends): a process left by an earlier phase keeps no
        wider network than the environment's (OSError: the container ended)."""
        if self.container is not None:
            await self._use_network("healthcheck")

    async def _connect(self) -> None:
        """slirp4netns started on the container's network (OSError: it could not be)."""
        assert self.container is not None
        try:
            self.slirp = await start_slirp(self.container.pid,
                                           net_namespace=self._net_namespace)
        except SandboxRefused as error:  # also a container that stopped meanwhile
            raise OSError(self.container.lost() or f"the container's network could not be "
                                                   f"set up: {error}") from None

    async def _use_network(self, phase: str) -> None:
        """Set the container's network to `phase`'s mode before the phase runs, as Harbor
        switches its egress sidecar (docs/SPEC.md §15): `public` connected by slirp4netns,
        `allowlist` connected with the rules loaded and the egress proxy listening,
        `no-network` without either (the tap device goes with slirp4netns; so is every
        phase of a `main` on compose `internal` networks alone). A process left
        running from an earlier phase finds the network the phase it runs beside has."""
        assert self.container is not None
        if self.shares is not None:  # a compose service's: the session's container's to set
            return
        mode = "no-network" if self.walled else self.phase_modes.get(phase, "no-network")
        if mode == "no-network" and self.slirp is not None:  # cut off before the rules go
            await self.slirp.stop()
            self.slirp = None
        try:
            if mode != "allowlist" and self.egress is not None:
                await apply_rules(self.container.pid, NO_RULES,
                                  net_namespace=self._net_namespace)
                await self.egress.aclose()
                self.egress = None
            if mode == "allowlist" and self.egress is None:  # the rules before the way out
                await self._open_egress(self.container.pid, self._net_namespace)
        except SandboxRefused as error:
            raise OSError(self.container.lost() or f"the container's network could not be "
                                                   f"set up: {error}") from None
        if mode != "no-network" and self.slirp is None:
            await self._connect()

    async def network_lost(self) -> str | None:
        """Whether the container's way out ended on its own (slirp4netns died), saying
        which, once: the next phase that needs a way out connects a new one."""
        if self.slirp is None or self.slirp.running:
            return None
        slirp, self.slirp = self.slirp, None
        why = f"slirp4netns exited during the session ({slirp.stderr_tail(1)})"
        await slirp.stop()  # (its descriptors closed, its process reaped)
        return why

    async def _open_egress(self, pid: int, net_namespace: int | None) -> None:
        """An allowlist (docs/SPEC.md §15): `ping` opened to every group in the container's
        network, its TCP to non-local addresses redirected by nftables to our egress
        proxy, which listens inside and admits only allowed hosts."""
        assert self.allowed_hosts is not None
        taken = {route.port for route in self.network.routes} if self.network else set()
        port = next(p for p in range(EGRESS_PORT, EGRESS_PORT + 100) if p not in taken)
        await anyio.to_thread.run_sync(functools.partial(open_ping, pid,
                                                         net_namespace=net_namespace))
        await apply_rules(pid, egress_rules(port), net_namespace=net_namespace)
        (listener,) = await anyio.to_thread.run_sync(listen_inside, pid, [port])
        self.egress = EgressProxy(self.allowed_hosts, self._refused)
        await self.egress.start(listener)

    async def _refused(self, detail: str) -> None:
        if self.egress_sink is not None:
            await self.egress_sink(detail)

    async def _disconnect(self) -> None:
        """The egress proxy and slirp4netns stopped (idempotent)."""
        if self.egress is not None:
            await self.egress.aclose()
            self.egress = None
        if self.slirp is not None:
            await self.slirp.stop()
            self.slirp = None

    async def _guard(self, pid: int, net_namespace: int | None, *, allowlist: bool) -> None:
        """One phase's sandbox of its own connected outward (strict: an allowlist, an
        image's public network; docs/SPEC.md §15): the last phase's slirp4netns and egress
        proxy stopped, this namespace connected and (`allowlist`) the rules and proxy
        opened before the phase's command runs (OSError: they could not be)."""
        await self._disconnect()
        try:
            self.slirp = await start_slirp(pid, net_namespace=net_namespace)
            if allowlist:
                await self._open_egress(pid, net_namespace)
        except SandboxRefused as error:
            await self._disconnect()
            raise OSError(f"the sandbox's network could not be set up: {error}") from None
