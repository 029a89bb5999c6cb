"""Codex's `config.toml` for one session (SPEC §5–6), written with tomli-w.

The model endpoint is a custom provider (`wire_api = "responses"`); each MCP grant becomes
`[mcp_servers.<name>]` with its URL, its session token as `http_headers`, `required` and
`tool_timeout_sec`; a task's stdio server becomes one with its `command` and `args`
(docs/SPEC.md §15). Approvals are off and Codex's own sandbox is bypassed (the local
sandbox isolates it); update checks, analytics and history are off; the model key's
variable is kept out of every tool's environment (`shell_environment_policy`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tomli_w

from trialledger.core.events import Grant
from trialledger.core.settings import Settings

PROVIDER = "trialledger"
API_KEY_ENV = "TRIALLEDGER_MODEL_API_KEY"
STREAM_IDLE_TIMEOUT_MS = 300_000


def codex_config(
    *,
    model: str,
    base_url: str,
    settings: Settings,
    grants: Sequence[Grant],
    reach: Callable[[str], str] = str,
    stdio: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The config as a TOML-ready dict (`reach`: how the sandbox reaches a URL; `stdio`:
    a task's stdio MCP servers, name → command and args, which Codex runs in the sandbox)."""
    provider: dict[str, Any] = {
        "name": "trialledger model endpoint",
        "base_url": reach(base_url),
        "env_key": API_KEY_ENV,
        "wire_api": "responses",
        "stream_idle_timeout_ms": min(STREAM_IDLE_TIMEOUT_MS, int(settings.timeout_s * 1000)),
    }
    for key in ("request_max_retries", "stream_max_retries"):
        value = getattr(settings, key)
        if value is not None:
            provider[key] = value
    config: dict[str, Any] = {
        "model": model,
        "model_provider": PROVIDER,
        "approval_policy": "never",
        "sandbox_mode": "danger-full-access",
        "check_for_update_on_startup": False,
    }
    if settings.reasoning_effort is not None:  # the seed checked the server forwards it
        config["model_reasoning_effort"] = settings.reasoning_effort
    config["model_providers"] = {PROVIDER: provider}
    config["history"] = {"persistence": "none"}
    # The proxy token reaches Codex in its environment (`env_key`); its tools never see it.
    config["shell_environment_policy"] = {"exclude": [API_KEY_ENV]}
    config["analytics"] = {"enabled": False}
    if settings.features is not None:
        config["features"] = dict(settings.features)
    servers = {}
    for grant in grants:
        if grant.kind != "mcp":
            continue
        server: dict[str, Any] = {"url": reach(grant.url)}
        if grant.headers:
            server["http_headers"] = dict(grant.headers)
        if grant.required:
            server["required"] = True
        if settings.mcp_tool_timeout_s is not None:
            server["tool_timeout_sec"] = settings.mcp_tool_timeout_s
        servers[grant.name] = server
    for name, argv in (stdio or {}).items():
        server = {"command": argv[0], "args": list(argv[1:])}
        if settings.mcp_tool_timeout_s is not None:
            server["tool_timeout_sec"] = settings.mcp_tool_timeout_s
        servers.setdefault(name, server)  # a grant of the same name wins
    if servers:
        config["mcp_servers"] = servers
    return config


def render(config: dict[str, Any]) -> tuple[str, str]:
    """The TOML text and its sha256."""
    text = tomli_w.dumps(config)
    return text, hashlib.sha256(text.encode()).hexdigest()
