"""Policy versions that installed packages provide (docs/SPEC.md §3 "Which policy").

A distribution declares each in the entry point group `trialledger.policies`, its name the
policy's and its value a `Policy` object:

    [project.entry-points."trialledger.policies"]
    acme-strict = "acme_policies:STRICT"

They are registered once per process, the first time a store is opened or `replay` runs,
so a session seeded under such a policy is folded under it by every reader on a machine
where the package is installed (`--policy-file` still registers one from a file).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from trialledger.core import TrialLedgerError
from trialledger.core.policy import Policy, register_policy

GROUP = "trialledger.policies"
_registered: list[str] | None = None  # the names, once this process loaded the group


class PolicyEntryPointBroken(TrialLedgerError, ValueError):
    """An entry point of `trialledger.policies` that cannot be loaded or is no `Policy`."""


def load_installed_policies() -> list[str]:
    """Register every policy of the entry point group (once per process); their names."""
    global _registered
    if _registered is not None:
        return _registered
    names: list[str] = []
    for point in sorted(entry_points(group=GROUP), key=lambda p: p.name):
        where = f"policy entry point {point.name} = {point.value}"
        try:
            policy = point.load()
        except Exception as error:  # the package's own bug: one line naming it
            said = str(error).splitlines()[0] if str(error) else ""
            raise PolicyEntryPointBroken(f"{where} raised {type(error).__name__}: {said}"
                                         ) from None
        if not isinstance(policy, Policy):
            raise PolicyEntryPointBroken(f"{where} is a {type(policy).__name__}, not a Policy")
        if policy.name != point.name:
            raise PolicyEntryPointBroken(f"{where} names policy {policy.name!r}: the entry "
                                         "point's name must be the policy's")
        register_policy(policy)
        names.append(policy.name)
    _registered = names
    return names
