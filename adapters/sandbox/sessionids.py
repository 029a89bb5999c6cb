"""Who a session's processes are (SPEC §11, §15, §16): `SessionIds`, the first part of
`LocalSandbox` (local.py) — the sandbox user, or in range mode the session's slot of the
sandbox user's subordinate range with the user namespace made over it and each role's
user read from the image; who owns what on the host; whether the container starts under
an OCI runtime; the cgroup's process limit; and what `agent.launched` records of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trialledger.adapters.images.environment import Environment
from trialledger.adapters.sandbox import runc as runtimes
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.bwrap import Role
from trialledger.adapters.sandbox.cgroup import CONTROLLERS, SessionCgroup
from trialledger.adapters.sandbox.identity import PROCESS_LIMIT, SandboxUser
from trialledger.adapters.sandbox.idrange import (
    RangeIds,
    Slot,
    UsernsMaker,
    ensure_filter,
    reserved_range,
    resolve_user,
)
from trialledger.adapters.sandbox.layout import chown_tree


class SessionIds:
    """Who the session's processes are and who owns its files (a part of `LocalSandbox`)."""

    # Set by LocalSandbox's construction
    user: SandboxUser  # the sandbox user (single-id mode's every id)
    image: Environment | None
    runtime: str | None  # the OCI runtime (runc, crun) when the container starts on one
    lifetime: str  # verifier_isolation: harbor or strict
    isolation: str  # bwrap or process-group
    init: Path
    users: dict[str, str]  # phase → its `user` (range mode honours them)
    range: RangeIds | None
    cgroup: SessionCgroup | None
    limits: dict[str, float]
    limits_reason: str | None

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
