"""The canonical text of an event, reproducible ids, and the per-session hash chain (SPEC §2)."""

from __future__ import annotations

import _json
import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

NS = uuid.UUID("c103da3a-5624-571b-8699-c4e4db20453f")
_NS_BYTES = NS.bytes
GENESIS = "0" * 64
CANONICAL_KEYS = ("session_id", "seq", "event_id", "type", "at", "data", "schema")
# The identity fields a stored row also keeps in columns of their own, for SQL to read: the
# hash covers only the canonical text, so `audit` checks each copy against it.
COPIED_KEYS = ("session_id", "seq", "event_id", "type", "at", "schema")


def event_id_for(session_id: str, seq: int) -> str:
    """The reproducible id of the event at `seq` of a session: uuid5(NS, "<session_id>:<seq>").

    Computed as `uuid.uuid5` does (sha1 of the namespace and the name, version 5, RFC 4122
    variant), without building a `UUID`: it runs for every appended event.
    """
    digest = bytearray(hashlib.sha1(_NS_BYTES + f"{session_id}:{seq}".encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50
    digest[8] = (digest[8] & 0x3F) | 0x80
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def session_id_for_seed(seed_data: Mapping[str, Any]) -> str:
    """The session id replay gives a log whose events carry none: uuid5 of the seed data."""
    text = json.dumps(seed_data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return str(uuid.uuid5(NS, text))


# One encoder for every event, made once: `json.dumps` with these options builds a
# `JSONEncoder` per call, which builds its C encoder and a dict of markers per call (the
# markers find cycles; an event's fields come from `model_dump`, which refuses them, so
# this encoder runs without: a cycle would still stop at the recursion limit).
_ENCODER = _json.make_encoder(
    None, json.JSONEncoder().default, _json.encode_basestring, None,  # markers, indent
    ":", ",", True, False, False)  # separators, sort_keys, skipkeys, allow_nan


def _encode(value: Any) -> str:
    return "".join(_ENCODER(value, 0))


def canonical_text(fields: Mapping[str, Any]) -> str:
    """The canonical JSON text of an event's seven identity fields: keys sorted, no
    whitespace, UTF-8 as is, no NaN or infinity."""
    return _encode({key: fields[key] for key in CANONICAL_KEYS})


def chain_hash(prev_hash: str, canonical: str) -> str:
    """sha256 over the previous hash's hex digits followed by the canonical text (UTF-8)."""
    digest = hashlib.sha256(prev_hash.encode("ascii"))
    digest.update(canonical.encode("utf-8"))
    return digest.hexdigest()


def chain(canonicals: Iterable[str], prev_hash: str = GENESIS) -> list[str]:
    """The hashes of consecutive canonical texts, starting from `prev_hash`."""
    hashes = []
    for text in canonicals:
        prev_hash = chain_hash(prev_hash, text)
        hashes.append(prev_hash)
    return hashes


def copy_fault(canonical: str, columns: Mapping[str, Any]) -> str | None:
    """The first column of a stored row (`COPIED_KEYS`) whose value is not the one its
    canonical text holds, described; None when every copy agrees (and for a text that is
    not an event: the chain check names that)."""
    try:
        fields = json.loads(canonical)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    for key in COPIED_KEYS:
        if key in columns and columns[key] != fields.get(key):
            return (f"its {key} column says {columns[key]!r} where its hashed text says "
                    f"{fields.get(key)!r} (the row was altered outside the hash)")
    return None


def first_broken_link(
    links: Iterable[tuple[int, str, str]], *, head_seq: int, head_hash: str
) -> str | None:
    """Check (seq, canonical, stored hash) rows of one session in order; describe the first fault.

    Detects an altered event (hash mismatch), a removed, reordered or inserted one (seq
    gap or hash mismatch) and a removed last one (head mismatch). Returns None when intact.
    """
    prev, expected_seq = GENESIS, 1
    for seq, canonical, stored in links:
        if seq != expected_seq:
            return f"seq {seq}: expected seq {expected_seq} (an event was removed or inserted)"
        try:
            embedded_seq = json.loads(canonical)["seq"]
        except (ValueError, KeyError, TypeError):
            return f"seq {seq}: stored text is not a canonical event"
        if embedded_seq != seq:
            return f"seq {seq}: stored text says seq {embedded_seq} (events were reordered)"
        prev = chain_hash(prev, canonical)
        if prev != stored:
            return f"seq {seq}: hash mismatch (the event was altered or moved)"
        expected_seq += 1
    if expected_seq - 1 != head_seq or prev != (head_hash if head_seq else GENESIS):
        return (
            f"head: the log ends at seq {expected_seq - 1} but the head says seq {head_seq}"
            " (an event was removed or the head altered)"
        )
    return None
