"""Whether range mode is available here (docs/SPEC.md §15, §16): a root runner, the
sandbox user's subordinate range, a pids controller, our init and seccomp filter, the image
store's idmapped layers and an OCI runtime that starts a container — said once when not.
Apart from the id range (sandbox/idrange.py), which the image store and the runtimes use:
this asks all of them.
"""

from __future__ import annotations

import functools
import logging
import os

from trialledger.adapters.images import imagestore
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.identity import SANDBOX_USER, ensure_init
from trialledger.adapters.sandbox.idrange import (
    ensure_filter,
    has_pids_controller,
    reserved_range,
)
from trialledger.adapters.sandbox.ociruntime import chosen_runtime, recorded_problem


@functools.cache
def _problem_once(problem: str) -> None:
    logging.getLogger(__name__).warning(
        "range mode is unavailable (%s): image and rootfs sessions run in single-id mode "
        "(gap root_emulated)", problem)


def _runtime_problem(runtime: str | None) -> str | None:
    """Why `runtime` (None: range mode's default) cannot start range-mode containers, as
    `setup` recorded (None: it found it able, or never checked it)."""
    if runtime is not None:
        return recorded_problem(runtime)
    chosen, why = chosen_runtime()
    return None if chosen is not None else f"no OCI runtime can start a container here ({why})"


def range_problem(runtime: str | None = None) -> str | None:
    """Why image sessions cannot run in range mode here (None: they can) with `runtime`
    starting their containers (None: the OCI runtime `setup` found able; bwrap needs
    none). Said once."""
    problem = None
    if os.geteuid() != 0:
        problem = "the runner is not root"
    elif reserved_range() is None:
        problem = f"{SANDBOX_USER} has no subordinate range: run `trialledger setup`"
    elif not has_pids_controller():
        problem = "no pids controller for a cgroup of each session's own"
    else:
        try:
            ensure_filter()
            init = ensure_init()
        except SandboxRefused as error:
            problem = str(error)
        else:  # (sessions lay their overlay on the image store's layers, each idmapped)
            ids = reserved_range()
            problem = imagestore.idmapped_layers_problem(init, ids.start) if ids else None
    if problem is None and runtime != "bwrap":
        problem = _runtime_problem(runtime)
    if problem is not None:
        _problem_once(problem)
    return problem
