"""Seed validation (SPEC §5–6): settings, tool grants, the workdir rule, secrets.

A harness hands `validate_seed` the raw seed (grant headers in clear); it returns the
`session.seeded` data to store (headers `[redacted]` and fingerprinted), the session's
secrets to keep in memory, and the optional grants left out (to record as gaps). Anything
that cannot run is a `SeedRejected` whose message says what to change.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trialledger.core.errors import SeedRejected
from trialledger.core.events import Grant, SessionSeededData
from trialledger.core.parsing import describe_invalid
from trialledger.core.redact import REDACTED, fingerprint, header_secrets, scrub_data

GRANT_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class SkippedGrant:
    """An optional grant left out; the harness records it as gap `mcp_server_skipped`."""

    name: str
    reason: str

    @property
    def gap(self) -> dict[str, str]:
        """The `gap.recorded` data for this grant."""
        return {"code": "mcp_server_skipped", "detail": f"grant {self.name!r}: {self.reason}"}


@dataclass(frozen=True)
class ValidSeed:
    """What a validated seed gives the harness."""

    data: SessionSeededData
    grants: tuple[Grant, ...]
    secrets: tuple[str, ...]
    skipped: tuple[SkippedGrant, ...] = field(default=())


def _given(grant: Mapping[str, Any] | Grant) -> Grant:
    """A grant as a harness gives it: headers in clear and no `header_fingerprints` (the
    store makes them; given, they are refused as the unknown field they are here)."""
    given = bool(grant.header_fingerprints) if isinstance(grant, Grant) else (
        isinstance(grant, Mapping) and "header_fingerprints" in grant)
    if isinstance(grant, Mapping):
        grant = {k: v for k, v in grant.items() if k != "header_fingerprints"}
    valid = Grant.model_validate(grant)  # a field's error first, as pydantic orders them
    if given:
        raise SeedRejected("grant field 'header_fingerprints': Extra inputs are not permitted")
    return valid


def _unusable(grant: Grant) -> str | None:
    if grant.kind == "direct_http":
        return "Codex takes tools only from MCP servers; a direct_http grant cannot reach it"
    if not GRANT_NAME.fullmatch(grant.name):
        return "Codex starts only MCP servers whose names use letters, digits, '-' and '_'"
    return None


def _merge_grants(
    own: Sequence[Grant], configured: Sequence[Grant]
) -> tuple[list[Grant], list[SkippedGrant]]:
    names = [g.name for g in own]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SeedRejected(f"grant names must be unique; repeated: {', '.join(duplicates)}")
    merged = [g for g in configured if g.name not in set(names)] + list(own)
    usable, skipped = [], []
    for grant in merged:
        problem = _unusable(grant)
        if problem is None:
            usable.append(grant)
        elif grant.required:
            raise SeedRejected(
                f"required grant {grant.name!r} cannot be used: {problem}; "
                "fix it or make the grant optional"
            )
        else:
            skipped.append(SkippedGrant(grant.name, problem))
    return usable, skipped


def check_workdir(
    workdir: str,
    *,
    private_roots: Iterable[str],
    resolve: Callable[[str], str] = posixpath.normpath,
) -> None:
    """SPEC §5: `/` is accepted; any other workdir must be disjoint from the private roots.

    `resolve` maps a path to its real path (the adapter passes `os.path.realpath`, so a
    symlinked overlap is caught); the default is purely lexical.
    """
    if not workdir.startswith("/") or ".." in workdir.split("/"):
        raise SeedRejected(f"workdir {workdir!r} must be an absolute path without '..'")
    if workdir == "/":
        return
    real = resolve(workdir)
    for root in private_roots:
        real_root = resolve(root)
        if _overlap(real, real_root):
            raise SeedRejected(
                f"workdir {workdir!r} overlaps the session/runtime folder {root!r} "
                "(equal to, containing or inside it); choose a workdir outside it"
            )


def _overlap(a: str, b: str) -> bool:
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    return a == b or a.startswith(b + "/") or b.startswith(a + "/") or "/" in (a, b)


def validate_seed(
    seed: Mapping[str, Any],
    *,
    private_roots: Iterable[str] = (),
    configured_grants: Sequence[Mapping[str, Any] | Grant] = (),
    api_key: str | None = None,
    resolve: Callable[[str], str] = posixpath.normpath,
) -> ValidSeed:
    """Validate a raw seed into what to store, the secrets to keep, and the grants left out."""
    raw = dict(seed)
    try:
        own = [_given(g) for g in raw.pop("grants", None) or []]
        configured = [_given(g) for g in configured_grants]
    except ValidationError as error:
        raise SeedRejected(f"grant {describe_invalid(error, 'grant')}") from None
    usable, skipped = _merge_grants(own, configured)
    try:
        data = SessionSeededData.model_validate(
            {**raw, "grants": [g.stored().model_dump() for g in usable]}
        )
    except ValidationError as error:
        raise SeedRejected(f"seed {describe_invalid(error, 'seed')}") from None
    check_workdir(data.settings.workdir, private_roots=private_roots, resolve=resolve)
    # Every header value that came with the seed is a secret, used or left out.
    secrets = [
        s for g in (*own, *configured) for v in g.headers.values() for s in header_secrets(v)
    ]
    if api_key:
        secrets.append(api_key)
    return ValidSeed(
        data=data,
        grants=tuple(usable),
        secrets=tuple(dict.fromkeys(secrets)),
        skipped=tuple(skipped),
    )


def seal_seed(events: Sequence[Any]) -> tuple[list[Any], tuple[str, ...]]:
    """A recorded log whose seed carries raw grant header values, as a live seed would be
    stored (SPEC §7): each value `[redacted]` with its fingerprint, and every event's
    data scrubbed of them. Returns the log and the secrets found (none: the log as given).
    """
    first = events[0] if events else None
    if not (isinstance(first, Mapping) and first.get("type") == "session.seeded"
            and isinstance(first.get("data"), Mapping)):
        return list(events), ()
    grants = first["data"].get("grants")
    secrets: list[str] = []
    sealed_grants = []
    for grant in grants if isinstance(grants, list) else []:
        headers = grant.get("headers") if isinstance(grant, Mapping) else None
        if not isinstance(headers, Mapping):
            sealed_grants.append(grant)
            continue
        kept = grant.get("header_fingerprints")
        if kept is not None and not isinstance(kept, Mapping):
            sealed_grants.append(grant)  # no grant's shape: the seed's validation names it
            continue
        raw = {k: v for k, v in headers.items() if isinstance(v, str) and v != REDACTED}
        for value in raw.values():
            secrets += header_secrets(value)
        fingerprints = dict(kept or {})
        fingerprints.update({k: fingerprint(v) for k, v in raw.items()})
        sealed_grants.append({**grant, "headers": {k: REDACTED if k in raw else v
                                                   for k, v in headers.items()},
                              **({"header_fingerprints": fingerprints} if raw else {})})
    if not secrets:
        return list(events), ()
    found = tuple(dict.fromkeys(secrets))
    seed = {**first, "data": {**first["data"], "grants": sealed_grants}}
    return [scrub_data(e, found) if isinstance(e, Mapping) else e
            for e in [seed, *events[1:]]], found
