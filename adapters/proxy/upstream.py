"""Where a session's proxy forwards (server.py), apart from the proxy itself: the
runner and the sandbox's network name their upstreams with these without importing
aiohttp (a fifth of a second at start), which only a session that has a proxy needs —
an oracle's or nop's has none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from trialledger.adapters.sandbox.allowlist import as_address, routable

MODEL_ROUTES = frozenset({("POST", "/responses"), ("GET", "/models")})  # what Codex calls

CallSink = Callable[[str, dict[str, Any]], Awaitable[None]]  # (ended_at, model.call data)


@dataclass(frozen=True)
class Upstream:
    """Where a proxy forwards, and how it authenticates there."""

    base_url: str  # scheme://host[:port][/prefix]
    token: str | None = None  # what the client must present (Bearer); None: anything
    authorization: str | None = None  # what replaces it upstream; None: no Authorization
    # upstream when `token` is set (the token is the proxy's alone), else the client's own
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    routes: frozenset[tuple[str, str]] | None = None  # (method, path under the base path)
    # forwarded, e.g. MODEL_ROUTES; None: every request
    call_max_s: float | None = None  # a call still open this long after it was forwarded
    # is ended, `deadline`; None: no deadline
    public_only: bool = False  # connect only to globally routable addresses (a task's MCP
    # server, docs/SPEC.md §15): the name is resolved, checked, and the checked address used

    def admits(self, method: str, raw_target: str) -> bool:
        """Whether a request (its method and target exactly as sent) is forwarded. The raw
        target is compared, so no encoding, dot segment or absolute form slips past."""
        if self.routes is None:
            return True
        path = raw_target.split("?", 1)[0]
        prefix = urlsplit(self.base_url).path.rstrip("/")
        return any(method == m and path == prefix + under for m, under in self.routes)

    def url_for(self, path_qs: str) -> str:
        """The upstream URL of a request path as the client sent it."""
        base = urlsplit(self.base_url)
        return urlunsplit(base._replace(path="", query="", fragment="")) + path_qs

    def unreachable(self) -> bool:
        """Whether the upstream is an address literal `public_only` forbids (a name is
        checked when it resolves: `PublicResolver`)."""
        host = urlsplit(self.base_url).hostname or ""
        return self.public_only and as_address(host) is not None and not routable(host)
