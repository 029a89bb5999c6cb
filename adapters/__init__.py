"""The outside world → events, and our decisions → the outside world.

One thing here is public (SPEC §10; docs/library.md, "The public names"): the converter
from a `codex exec --json` stdout line to its events, for a harness that runs Codex
itself and appends to a `Ledger`. The rest — the runner, jobs, the sandbox, the proxy,
the view — is reached through the `trialledger` command; its modules may change. The
name is imported on first use (PEP 562), so loading one adapter loads no other.

By concept: `tasks/` the task format, `images/` task environments and builds, `session/`
a session's run, `jobs/` jobs, trials and Harbor's job folders, `sandbox/` the sandbox
and the container runtime, `codex/` the Codex CLI, `proxy/` the model
proxy, `commands/` and `console/` the command line and what it shows, `view/` the web
view, `demo/` the scripted endpoint and samples; `places.py` resolves paths for every
layer. Each package's `__init__` is its map; docs/map.md finds the module of each rule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trialledger.adapters.codex.stream import StreamRecord, parse_stream_line

__all__ = ["StreamRecord", "parse_stream_line"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.codex.stream"), name)
