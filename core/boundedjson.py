"""JSON the agent controls, parsed within limits (SPEC §11): one bounded `json.loads`.

Plain `json.loads` recurses once per nesting level (100,000 `[` raise `RecursionError`),
reads a 400-digit integer that no float can hold (and raises `ValueError` past Python's
4,300-digit limit), and accepts `NaN` and `Infinity`. So text the agent wrote — a rollout
line, a reward file, a line of Codex's stdout, a Harbor job folder — is parsed here: first
its size, then its nesting depth by a linear scan of the brackets outside strings (no
recursion, so a deep line is refused cheaply, before parsing), then `json.loads` with
hooks that refuse non-finite numbers and integers beyond 64 bits. Every refusal is
`UnsafeJSON`, naming the rule broken, never the content. A lone surrogate (a `\\ud800`
escape, which JSON lets through and no UTF-8 text can hold) becomes U+FFFD, in keys too.

    >>> bounded_loads('{"reward": 1}', limit=64)
    {'reward': 1}
    >>> bounded_loads("[" * 100_000, limit=2**20)
    Traceback (most recent call last):
    ...
    trialledger.core.boundedjson.UnsafeJSON: nested deeper than 64 levels
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any, NoReturn

from trialledger.core.errors import TrialLedgerError

MAX_DEPTH = 64  # Codex's events and rollouts nest a few levels; 64 leaves MCP results room
INT_RANGE = range(-(2**63), 2**63)  # an integer must fit a signed 64-bit column (token counts do)
NOT_JSON = "not JSON"

# A JSON string, or an unterminated one up to the end (so no start is scanned twice: the
# scan stays linear whatever the text); possessive, so it never backtracks.
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+\\?+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's \\ud800 escapes let these through
# Where a lone surrogate in the parsed value can come from: an escape of one, or one in the
# text itself (a name read with `surrogateescape`).
_SURROGATE_SOURCE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


class UnsafeJSON(TrialLedgerError, ValueError):
    """Agent-written JSON that breaks a rule (the message: the rule, never the content).

    `malformed` is true when the text is simply not JSON (a torn line), false when it
    broke a limit (size, depth, a number)."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule

    @property
    def malformed(self) -> bool:
        """Whether the text is not JSON at all, rather than JSON over a limit."""
        return self.rule.startswith(NOT_JSON)


def nesting_depth(text: str) -> int:
    """The deepest nesting of `[`/`{` outside strings, found without recursion (for text
    that is not JSON, an upper bound of what a left-to-right parser would reach)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _refuse(rule: str) -> NoReturn:
    raise UnsafeJSON(rule)


def _integer(digits: str) -> int:
    if len(digits.lstrip("-")) > 19 or (value := int(digits)) not in INT_RANGE:
        _refuse("an integer beyond 64 bits")
    return value


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _refuse("a non-finite number")
    return value


def _constant(name: str) -> NoReturn:
    _refuse(f"a non-finite number ({name})")


def _size(text: str | bytes) -> int:
    if isinstance(text, bytes):
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def bounded_loads(text: str | bytes, *, limit: int, max_depth: int = MAX_DEPTH) -> Any:
    """`text` parsed as JSON within `limit` bytes (UTF-8) and `max_depth` levels, with
    finite numbers and 64-bit integers only; else `UnsafeJSON`. Bytes must be UTF-8."""
    if len(text) > limit or (len(text) * 4 > limit and _size(text) > limit):
        raise UnsafeJSON(f"over the {limit}-byte cap")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafeJSON(f"{NOT_JSON} (not UTF-8)") from None
    # No deeper than it has opening brackets: most lines need no scan at all.
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise UnsafeJSON(f"nested deeper than {max_depth} levels")
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_number,
                           parse_constant=_constant)
    except UnsafeJSON:
        raise
    except (ValueError, RecursionError) as error:  # RecursionError: never, by the scan
        raise UnsafeJSON(f"{NOT_JSON} ({type(error).__name__})") from None
    return repaired(value) if _SURROGATE_SOURCE.search(text) else value


def as_text(text: str) -> str:
    """`text` with every lone surrogate (a `\\ud800` escape, a byte read with
    `surrogateescape`) made U+FFFD: text UTF-8 can hold."""
    return LONE_SURROGATE.sub("\ufffd", text)


def repaired(value: Any) -> Any:
    """`value` with every lone surrogate made U+FFFD, in keys too (its depth is bounded by
    the reader, so the recursion is)."""
    if isinstance(value, str):
        return as_text(value)
    if isinstance(value, list):
        return [repaired(v) for v in value]
    if isinstance(value, dict):
        return {repaired(k): repaired(v) for k, v in value.items()}
    return value
