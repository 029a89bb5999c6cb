"""Page names: a job's name, a trial's or a session's id as one segment of a relative
address and as a file name in an export. Plain names are themselves; any other (a job
named `a/b`, an imported trial id `x:../y`) becomes its plain letters, `+` and a digest, so
no name can leave its folder or read as a URL scheme, and none is a plain name (which
another session's id could be, taking over its page)."""

from __future__ import annotations

import hashlib
import re

_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def slug(name: str) -> str:
    """`name` as a page name (the same in the server and in an export)."""
    if _PLAIN.fullmatch(name):
        return name
    plain = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:40]
    return f"{plain}+{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def is_plain(name: str) -> bool:
    """Whether `name` is its own page name."""
    return _PLAIN.fullmatch(name) is not None
