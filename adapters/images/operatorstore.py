"""The operator's engine storage, asked once per change of it (docs/SPEC.md §16).

A warm job asks the operator's storage for the id of every task's `FROM` image (is there a
newer pull to copy into the build storage?) and of every `docker_image`: one `podman image
inspect`, ≈ 0.1 s, per task. The answer only changes when the storage's image store is
written, and containers/storage records every such write in a token of its own (the 64
bytes of `<graphroot>/<driver>-images/images.lock`, which podman itself reads to know
whether to reload). So an id is kept with the token it was read under and given again
while the token is the same: a pull, a tag, a removal or a load in between changes it and
the next look-up asks podman again.

The token's file is found from the storage's configuration as podman reads it (for root,
as the runner runs: `CONTAINERS_STORAGE_CONF`, else /etc/containers/storage.conf, else
/usr/share/containers/storage.conf; `graphroot` default /var/lib/containers/storage;
`driver` the one image store there when the file names none) and trusted only once an
image the engine named is seen in it (its folder in that image store). Anything else — the
driver or options set by the environment, docker, a storage that cannot be placed — is
never remembered: every look-up asks the engine, as before. Only the operator's storage is
remembered this way: the build storage is the build user's, whose token a hostile build
could keep constant.
"""

from __future__ import annotations

import os
import threading
import tomllib
from pathlib import Path

from trialledger.adapters.images.environment import _tool

CONFS = ("/etc/containers/storage.conf", "/usr/share/containers/storage.conf")
GRAPHROOT = Path("/var/lib/containers/storage")  # containers/storage's default for root
TOKEN_BYTES = 64  # containers/storage's lock file: its last writer's token

_lock = threading.Lock()
_tokens: dict[tuple[str | None, ...], Path | None] = {}  # its configuration → token file
_known: dict[tuple[str, str], tuple[bytes, str]] = {}  # (token file, ref) → (token, id)


def image_id(engine: str, ref: str, what: str) -> str:
    """`engine image inspect --format {{.Id}} ref` as `sha256:…` (EnvironmentUnavailable
    when the storage has no such image), from memory while the storage is unchanged."""
    token_file = _token_file(engine)
    token = _read_token(token_file) if token_file is not None else None
    if token is not None:
        with _lock:
            kept = _known.get((str(token_file), ref))
        if kept is not None and kept[0] == token:
            return kept[1]
    ident = _tool([engine, "image", "inspect", "--format", "{{.Id}}", ref], what).strip()
    ident = ident if ident.startswith("sha256:") else f"sha256:{ident}"
    if token is not None and token_file is not None and _holds(token_file, ident):
        with _lock:  # (the token read before the look-up: a write meanwhile changes it)
            _known[(str(token_file), ref)] = (token, ident)
    return ident


def _token_file(engine: str) -> Path | None:
    """The write token of the image store `engine` reads, as its configuration places
    it; None when it cannot be placed (then nothing is remembered)."""
    if engine != "podman" or os.geteuid() != 0 or {"STORAGE_DRIVER", "STORAGE_OPTS"} & set(
            os.environ):
        return None
    conf = os.environ.get("CONTAINERS_STORAGE_CONF")
    key = (conf,)
    with _lock:
        if key in _tokens:
            return _tokens[key]
    found = _place(conf)
    with _lock:
        _tokens[key] = found
    return found


def _place(conf: str | None) -> Path | None:
    path = conf or next((c for c in CONFS if os.path.isfile(c)), None)
    storage: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                table = tomllib.load(handle).get("storage", {})
        except (OSError, tomllib.TOMLDecodeError):
            return None
        storage = table if isinstance(table, dict) else {}
    root = Path(str(storage.get("graphroot") or GRAPHROOT))
    driver = storage.get("driver")
    if not driver:
        stores = [p for p in root.glob("*-images") if (p / "images.lock").is_file()]
        if len(stores) != 1:
            return None
        return stores[0] / "images.lock"
    return root / f"{driver}-images" / "images.lock"


def _read_token(token_file: Path) -> bytes | None:
    try:
        fd = os.open(token_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        token = os.read(fd, TOKEN_BYTES)
    finally:
        os.close(fd)
    return token if len(token) == TOKEN_BYTES else None


def _holds(token_file: Path, ident: str) -> bool:
    """Whether the image store beside `token_file` is the one that answered: it has the
    image's own folder."""
    return (token_file.parent / ident.removeprefix("sha256:")).is_dir()
