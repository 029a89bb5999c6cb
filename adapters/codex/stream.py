"""Codex's `exec --json` stdout lines → events (SPEC §2.2).

Every line is kept: a known type becomes its event with Codex's object (minus `type`) as
data, Codex's top-level `error` becomes `stream.error`, an unknown type becomes
`codex.unknown` {line}, and a line that is not JSON becomes `codex.unknown` plus a
`codex_unparsable_line` gap.

The lines are untrusted (a tool can write to Codex's stdout, SPEC §11): invalid UTF-8 and
lone surrogates (a `\\ud800` escape) become U+FFFD, a line the sandbox cut at 1 MiB is
kept as `codex.unknown` with its first MiB plus gap `codex_line_truncated`, and JSON over
the bounded reader's limits (nested deeper than 64, a non-finite number, an integer beyond
64 bits) is kept as a line that is not JSON, its gap naming the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trialledger.adapters.sandbox.process import LINE_LIMIT, CutLine
from trialledger.core import BadEvent
from trialledger.core.boundedjson import UnsafeJSON, as_text, bounded_loads
from trialledger.core.events import CODEX_STREAM_TYPES
from trialledger.core.parsing import parse_event

RENAMED = {"error": "stream.error"}  # Codex's top-level error line
# Codex's own type names: ours, less the two that are ours alone.
KNOWN = CODEX_STREAM_TYPES - {"stream.error", "codex.unknown"}


@dataclass(frozen=True)
class StreamRecord:
    """What one stdout line becomes: an event's type and data, and maybe a gap."""

    type: str
    data: dict[str, Any]
    gap: dict[str, str] | None = None

    def events(self, at: str) -> list[dict[str, Any]]:
        """The JSONL events for this line, stamped `at`."""
        out = [{"type": self.type, "at": at, "data": self.data}]
        if self.gap is not None:
            out.append({"type": "gap.recorded", "at": at, "data": self.gap})
        return out


# A line's text after decoding: the sandbox cut it at LINE_LIMIT bytes, and each invalid
# byte may have become a 3-byte U+FFFD.
TEXT_LIMIT = 3 * LINE_LIMIT


def stream_events(line: bytes | CutLine, at: str) -> list[dict[str, Any]]:
    """The events for one raw stdout line from the sandbox, stamped `at`."""
    if isinstance(line, CutLine):
        return [{"type": "codex.unknown", "at": at,
                 "data": {"line": line.head.decode("utf-8", errors="replace")}},
                {"type": "gap.recorded", "at": at, "data": {
                    "code": "codex_line_truncated",
                    "detail": f"a {line.size}-byte stdout line, cut to {len(line.head)} bytes"}}]
    return parse_stream_line(line.decode("utf-8", errors="replace")).events(at)


def parse_stream_line(line: str) -> StreamRecord:
    """Map one `codex exec --json` stdout line (without its newline) to a record."""
    line = as_text(line)
    try:
        obj = bounded_loads(line, limit=TEXT_LIMIT)  # lone surrogates made U+FFFD
    except UnsafeJSON as error:
        detail = line[:200] if error.malformed else f"{error.rule}: {line[:200]}"
        return StreamRecord("codex.unknown", {"line": line},
                            {"code": "codex_unparsable_line", "detail": detail})
    kind = obj.get("type") if isinstance(obj, dict) else None
    if not isinstance(kind, str) or (kind not in KNOWN and kind not in RENAMED):
        return StreamRecord("codex.unknown", {"line": line})
    record = StreamRecord(RENAMED.get(kind, kind), {k: v for k, v in obj.items() if k != "type"})
    try:  # a known type in a shape we do not know is kept whole, as unknown
        parse_event({"type": record.type, "at": "2000-01-01T00:00:00Z", "data": record.data})
    except BadEvent:
        return StreamRecord("codex.unknown", {"line": line})
    return record
