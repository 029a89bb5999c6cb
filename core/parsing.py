"""An event's JSONL form, in and out (SPEC §2): parsing with upcasting, and the line reader.

`parse_event` validates one JSONL object into its model (events.py), upcasting one of an
older schema first and refusing one newer than this code; `parse_events` and
`parse_stored` are the fast paths of replay and the store; `parse_jsonl` reads the lines
of a log; `event_dict` is the way back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from trialledger.core.boundedjson import LONE_SURROGATE
from trialledger.core.errors import BadEvent
from trialledger.core.events import EVENT_TYPES, SCHEMA_VERSION, Envelope, Event

# An upcaster maps the data of (type, version) to that of version + 1 (SPEC §2); one is
# registered here when a new schema version changes a field (events.py's SCHEMA_VERSION).
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}

_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
_EVENTS_ADAPTER: TypeAdapter[list[Event]] = TypeAdapter(list[Event])


def describe_invalid(error: ValidationError, whole: str = "event") -> str:
    """A pydantic error in one line, the one formatter for events, seeds and grants: every
    missing field at once (a user fixes them together), else the first problem and its
    field; `whole` names the object when the problem is not in a field."""
    errors = error.errors()
    missing = [".".join(_field_path(e["loc"])) for e in errors if e["type"] == "missing"]
    if len(missing) > 1:
        return f"missing fields: {', '.join(missing)}"
    first = errors[0]
    if first["type"] == "union_tag_invalid":
        return f"unknown event type {first['input'].get('type')!r}"
    if first["type"] == "union_tag_not_found":
        return "field 'type' is required"
    field = ".".join(_field_path(first["loc"])) or whole
    return f"field {field!r}: {first['msg'].removeprefix('Value error, ')}"


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    path = [str(part) for part in loc]
    return path[1:] if path and path[0] in EVENT_TYPES else path  # the union's branch name


def _upcast(obj: dict[str, Any]) -> dict[str, Any]:
    kind, version = obj.get("type"), obj.get("schema", 1)
    if not isinstance(kind, str) or not isinstance(version, int):
        return obj
    while (kind, version) in UPCASTERS:
        obj = {**obj, "data": UPCASTERS[(kind, version)](obj.get("data", {})),
               "schema": version + 1}
        version += 1
    return obj


# Fields the store adds to an exported line; a parsed event ignores them.
STORE_FIELDS = frozenset({"position", "recorded_at", "hash"})


def parse_event(obj: Mapping[str, Any] | Event) -> Event:
    """Validate one JSONL event dict into its model; raise `BadEvent` naming the field."""
    if isinstance(obj, Envelope):  # already an event model
        return obj
    if not isinstance(obj, Mapping):
        raise BadEvent(f"an event is a JSON object, not {type(obj).__name__}")
    fields = {k: v for k, v in obj.items() if k not in STORE_FIELDS}
    try:
        event = _EVENT_ADAPTER.validate_python(_upcast(fields))
    except ValidationError as error:
        raise BadEvent(describe_invalid(error)) from None
    if event.schema_ > SCHEMA_VERSION[event.type]:
        raise BadEvent(f"field 'schema': {event.type} schema {event.schema_} is newer than "
                       f"this trialledger reads (up to {SCHEMA_VERSION[event.type]}); "
                       "upgrade trialledger")
    return event


def parse_stored(text: str) -> Event:
    """An event from its canonical text as the store holds it: validated straight from the
    JSON (about half the time of `json.loads` and `parse_event`); one of an older schema,
    or text that does not validate, goes through `parse_event` (upcast, or `BadEvent`)."""
    try:
        event = _EVENT_ADAPTER.validate_json(text)
    except ValidationError:
        return parse_event(json.loads(text))
    if event.schema_ != SCHEMA_VERSION[event.type]:
        return parse_event(json.loads(text))
    return event


def parse_events(events: Iterable[Mapping[str, Any] | Event]) -> list[Event]:
    """`parse_event` of each, a `BadEvent` naming the index of the first bad one: the one
    parsing loop of replay and the store.

    A list of plain dicts without store fields (what a harness and an export write) is
    validated at once, which costs half as much per event, and an event of an older schema
    in it is then parsed again alone (upcast); anything else, or a list that does not
    validate so, goes one event at a time (which names the first bad one)."""
    given = events if isinstance(events, list) else list(events)
    if all(type(raw) is dict and STORE_FIELDS.isdisjoint(raw) for raw in given):
        try:
            parsed = _EVENTS_ADAPTER.validate_python(given)
        except ValidationError:
            return _parse_each(given)
        for index, event in enumerate(parsed):
            if event.schema_ != SCHEMA_VERSION[event.type]:
                try:
                    parsed[index] = parse_event(given[index])
                except BadEvent as error:
                    raise error.at(index=index) from None
        return parsed
    return _parse_each(given)


def _parse_each(events: Iterable[Mapping[str, Any] | Event]) -> list[Event]:
    parsed = []
    for index, raw in enumerate(events):
        try:
            parsed.append(parse_event(raw))
        except BadEvent as error:
            raise error.at(index=index) from None
    return parsed


def event_dict(event: Envelope) -> dict[str, Any]:
    """The JSONL form of an event, with every field."""
    return event.model_dump(mode="json")


MAX_DEPTH = 64
_INT64 = range(-(2**63), 2**63)


def _storable(value: Any, depth: int = 0) -> str | None:
    """Why a parsed JSON value cannot be stored as given (None: it can)."""
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, str):
        return "a lone surrogate (\\ud800–\\udfff) in a string" if LONE_SURROGATE.search(value) \
            else None
    if isinstance(value, int) and not isinstance(value, bool):
        return None if value in _INT64 else "an integer beyond 64 bits"
    if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity, 1e999
        return "a number JSON cannot hold (NaN or infinite)"
    if isinstance(value, dict):
        items: Iterable[Any] = (x for kv in value.items() for x in kv)
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((why for item in items if (why := _storable(item, depth + 1))), None)


def parse_jsonl(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) per non-blank line; raise `BadEvent` with the line number
    for a line that is not a JSON object or could not be stored as it is."""
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as error:
            reason = "nested too deep" if isinstance(error, RecursionError) else str(error)
            raise BadEvent(f"not JSON ({reason})", line=number) from None
        if not isinstance(obj, dict):
            raise BadEvent(f"an event is a JSON object, not {type(obj).__name__}", line=number)
        if why := _storable(obj):
            raise BadEvent(why, line=number)
        yield number, obj
