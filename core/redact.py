"""Secrets never reach the database (SPEC §7): `scrub`, `redact`, and scrubbing event data.

>>> scrub("token=sk-live-0123456789 ok", ["sk-live-0123456789"])
'token=[redacted] ok'
>>> scrub("echoed sk-live-01…", ["sk-live-0123456789"])  # cut echoes of 8+ characters too
'echoed [redacted]…'
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REDACTED = "[redacted]"
MIN_ECHO = 8  # a cut echo this long or longer is still a secret
MAX_LINE = 500
MAX_TAIL = 2000
AUTH_SCHEMES = ("bearer ", "basic ", "token ")


def _forms(secret: str) -> set[str]:
    return {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]}


@functools.lru_cache(maxsize=1024)
def _match_forms(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """Every form of every secret to look for (cached: a session scrubs each string of
    each of its events against the same few secrets)."""
    return tuple(dict.fromkeys(form for secret in expand(secrets) for form in _forms(secret)))


def _echo_spans(text: str, form: str) -> Iterable[tuple[int, int]]:
    """Spans of `text` where `form` stands whole, or a prefix of it of 8+ characters."""
    anchor = form[:MIN_ECHO]
    start = text.find(anchor)
    while start != -1:
        length = len(anchor)
        limit = min(len(form), len(text) - start)
        while length < limit and text[start + length] == form[length]:
            length += 1
        yield start, start + length
        start = text.find(anchor, start + 1)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """Replace each maximal run of characters covered by a secret's echo with `[redacted]`.

    Each secret matches as written and JSON-escaped (ASCII and not), whole or cut to a
    prefix of at least 8 characters; one pass over the original text. A header value
    `Bearer X` (`Basic X`, `Token X`) also matches as `X` alone.
    """
    spans = sorted(span for form in _match_forms(tuple(secrets))
                   for span in _echo_spans(text, form))
    if not spans:
        return text
    out: list[str] = []
    kept_from = 0
    run_start, run_end = spans[0]
    for start, end in spans[1:]:
        if start <= run_end:
            run_end = max(run_end, end)
            continue
        out += (text[kept_from:run_start], REDACTED)
        kept_from, run_start, run_end = run_end, start, end
    out += (text[kept_from:run_start], REDACTED, text[run_end:])
    return "".join(out)


def redact(text: str, secrets: Iterable[str]) -> str:
    """`scrub`, then cut each line to 500 code points (499 and `…`), then keep the last 2,000."""
    lines = scrub(text, secrets).split("\n")
    cut = "\n".join(line if len(line) <= MAX_LINE else line[: MAX_LINE - 1] + "…" for line in lines)
    return cut[-MAX_TAIL:]


def scrub_data(value: Any, secrets: Sequence[str]) -> Any:
    """Scrub every string (keys included) anywhere inside a JSON-like value."""
    if not secrets:
        return value
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, Mapping):
        return {scrub(str(k), secrets): scrub_data(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_data(item, secrets) for item in value]
    return value


def expand(secrets: Iterable[str]) -> list[str]:
    """The secrets to match: each given one and, for `Bearer X` & co., `X` too."""
    return list(dict.fromkeys(s for secret in secrets if secret
                              for s in header_secrets(secret)))


def header_secrets(value: str) -> list[str]:
    """A header value's secrets: the value, and `X` of `Bearer X`, `Basic X` or `Token X`."""
    found = [value]
    for scheme in AUTH_SCHEMES:
        if value.lower().startswith(scheme) and value[len(scheme):].strip():
            found.append(value[len(scheme):].strip())
    return found


def fingerprint(value: str) -> str:
    """A stable, non-reversible label for a secret: `sha256:` and 12 hex digits."""
    return "sha256:" + hashlib.sha256(value.encode("utf-8")).hexdigest()[:12]
