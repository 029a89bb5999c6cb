"""The task's artifacts, collected as Harbor collects them (docs/SPEC.md §15 "What is kept").

task.toml's top-level `artifacts` names what to keep after the agent: paths, or tables
with `source`, `destination` and `exclude` (globs, as `tar --exclude` reads them), read and
validated as Harbor 0.26's `ArtifactConfig` is. `/logs/artifacts` is always collected
first, as Harbor's convention entry, unless an entry names it (with excludes, say). Each
lands in the session's artifact folder under `artifacts/`: at its `destination`, else at
its source path (`/app/out.txt` → `artifacts/app/out.txt`). An entry whose place there
overlaps an earlier one's is not collected, as Harbor keeps the first claim: silently when
the earlier one already holds it, else warned by name at load.

The sandbox's files are read where they are on the host, as the overlay shows them to the
agent: the session's layer over the image's root (or, for a host task with workdir `/`,
over its workdir), a whiteout hiding what is below, an opaque folder hiding the lower
folder; a host task without an overlay has only its workdir. Nothing is followed: a link
anywhere on an artifact's path, or inside a folder, is gap `unsafe_agent_file`, as are
FIFOs and devices. The copy is `capture.keep_listed`'s (scrubbed, 0600 / 0700, at most
256 files and 16 MiB, then gap `artifacts_truncated`), under a budget of its own.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from trialledger.adapters.sandbox.agentfiles import (
    MAX_DEPTH,
    MAX_ENTRIES,
    AgentTree,
    UnsafeAgentFile,
    kind,
)
from trialledger.adapters.session import artifacts, capture
from trialledger.adapters.tasks.config import MAIN_SERVICE, TaskInvalid
from trialledger.store.writer import now

if TYPE_CHECKING:
    from trialledger.adapters.sandbox.local import LocalSandbox
    from trialledger.core.settings import Settings
    from trialledger.store import StoredEvent

FOLDER = "artifacts"  # the pass's folder in the session's artifact folder
CONVENTION = "/logs/artifacts"  # Harbor's EnvironmentPaths.artifacts_dir
MANIFEST = "manifest.json"  # reserved by Harbor for its manifest: never a destination
TABLE_KEYS = ("source", "destination", "exclude", "service")
# An overlay's upper folder with one of these set to "y" hides the layers below it: the
# kernel's (a root runner's mount) and `userxattr`'s (one made in a user namespace).
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
LINK = "a symbolic link (not followed)"
MAX_REFUSALS = 64  # `unsafe_agent_file` gaps one pass records, then one that counts the rest


def _relative(path: str) -> str:
    """A sandbox path (or destination) as a path in `artifacts/` ("" for `/`), as Harbor's
    `source_relative_path` maps it."""
    return "/".join(p for p in PurePosixPath(path).parts if p not in ("/", ".."))


@dataclass(frozen=True)
class Artifact:
    """One entry of task.toml's `artifacts` (Harbor's `ArtifactConfig`)."""

    source: str  # a path in the sandbox (a relative one starts at `/`, as `docker cp`'s)
    destination: str | None = None  # in `artifacts/`; None: the source's path
    exclude: tuple[str, ...] = ()  # for a folder: tar's --exclude patterns
    service: str = MAIN_SERVICE  # a compose service's name (task.py checks it is one)

    @property
    def kept(self) -> str:
        """Where it goes in `artifacts/` ("" : that folder itself)."""
        return _relative(self.destination or self.source)


CONVENTION_ONLY = (Artifact(CONVENTION),)


def parse_artifacts(value: Any, where: str) -> tuple[tuple[Artifact, ...], dict[str, str]]:
    """task.toml's `artifacts` as Harbor reads them, `/logs/artifacts` first unless named;
    and the warned ones (name → why): unknown table keys, an entry another one overlaps.
    An entry Harbor refuses is `TaskInvalid`."""
    if not isinstance(value, list):
        raise TaskInvalid(f"{where}: artifacts must be a list of paths or tables")
    warned: dict[str, str] = {}
    entries = [_entry(raw, where, warned) for raw in value]
    if not any(e.source.rstrip("/") == CONVENTION for e in entries):
        entries.insert(0, CONVENTION_ONLY[0])
    return _claimed(entries, warned), warned


def parse_step_artifacts(value: Any, before: Sequence[Artifact], where: str
                         ) -> tuple[tuple[Artifact, ...], dict[str, str]]:
    """A step's `artifacts` after the task's (`before`), as Harbor appends a step's entries
    to the trial's for that step's collection; the warned ones, as `parse_artifacts`."""
    if not isinstance(value, list):
        raise TaskInvalid(f"{where}: artifacts must be a list of paths or tables")
    warned: dict[str, str] = {}
    return _claimed([*before, *(_entry(raw, where, warned) for raw in value)], warned), warned


def _entry(raw: Any, where: str, warned: dict[str, str]) -> Artifact:
    if isinstance(raw, str):
        return Artifact(_source(raw, where))
    if not isinstance(raw, dict):
        raise TaskInvalid(f"{where}: artifacts: {raw!r} is neither a path nor a table")
    for key in raw.keys() - set(TABLE_KEYS):
        warned[f"[[artifacts]] {key}"] = "is not a field of Harbor 0.26's artifact config: ignored"
    source = _source(raw.get("source"), where)
    exclude = raw.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise TaskInvalid(f"{where}: artifacts: {source!r}: exclude must be a list of patterns")
    service = raw.get("service", MAIN_SERVICE)
    if not isinstance(service, str) or not service.strip():
        raise TaskInvalid(f"{where}: artifacts: {source!r}: service must be a service name")
    return Artifact(source, _destination(raw.get("destination"), source, where),
                    tuple(p.rstrip("/") or p for p in exclude), service.strip())


def _source(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise TaskInvalid(f"{where}: artifacts: source {value!r} must be a path")
    if ".." in PurePosixPath(value).parts:  # Harbor's _validate_source
        raise TaskInvalid(f"{where}: artifacts: source {value!r} must not contain '..'")
    return value


def _destination(value: Any, source: str, where: str) -> str | None:
    """Harbor's `_validate_destination`: relative, forward slashes, no `..`, not the
    manifest's name ("" is none)."""
    if value is None or value == "":
        return None
    named = f"{where}: artifacts: {source!r}: destination {value!r}"
    if not isinstance(value, str):
        raise TaskInvalid(f"{named} must be a string")
    path = PurePosixPath(value)
    why = ("must use forward slashes" if "\\" in value else
           "must be a relative path" if path.is_absolute() else
           "must name a file or folder" if not path.parts else
           "must not contain '..'" if ".." in path.parts else
           "is reserved for Harbor's manifest" if value.rstrip("/") == MANIFEST else None)
    if why is not None:
        raise TaskInvalid(f"{named} {why}")
    return value


def _overlap(a: str, b: str) -> bool:
    """Two places in `artifacts/` that are one, or one inside the other."""
    return not a or not b or a == b or b.startswith(f"{a}/") or a.startswith(f"{b}/")


def _covered(prior: Artifact, later: Artifact) -> bool:
    """Harbor's `artifact_is_covered_by`: `prior` already collects `later`'s files where
    `later` would put them."""
    first, source = PurePosixPath(prior.source), PurePosixPath(later.source)
    if not source.is_relative_to(first):
        return False
    if source == first and later.kept == prior.kept:
        return prior.exclude == later.exclude
    inside = source.relative_to(first).as_posix()
    return not prior.exclude and later.kept == "/".join(p for p in (prior.kept, inside)
                                                         if p and p != ".")


def _claimed(entries: Sequence[Artifact], warned: dict[str, str]) -> tuple[Artifact, ...]:
    """The entries collected: Harbor's first claim on a place in `artifacts/` wins."""
    kept: list[Artifact] = []
    for entry in entries:
        prior = next((c for c in kept if _overlap(c.kept, entry.kept)), None)
        if prior is None:
            kept.append(entry)
        elif not _covered(prior, entry):
            warned[f"artifacts {entry.source!r}"] = (
                f"is not collected: its place in artifacts/ overlaps that of "
                f"{prior.source!r}, which Harbor keeps")
    return tuple(kept)


# --- the sandbox's files, as the agent saw them ----------------------------------------------


@dataclass(frozen=True)
class Layers:
    """Where the sandbox's files are on the host: `upper` (the session's layer, or a host
    task's workdir) over `lower` (None: nothing below), seen at `at` inside."""

    at: str
    upper: AgentTree
    lower: AgentTree | None = None

    def whiteout(self, info: os.stat_result) -> bool:
        """An upper entry that deletes what is below it (overlayfs's 0/0 character
        device)."""
        return (self.lower is not None and stat.S_ISCHR(info.st_mode)
                and info.st_rdev == 0)

    def opaque(self, upper: str) -> bool:
        """An upper folder that hides the lower one at its place (one swapped for a link
        meanwhile hides it too: reading it is then refused)."""
        try:
            return any(self.upper.xattr(upper, name) == b"y" for name in OPAQUE_XATTRS)
        except UnsafeAgentFile:
            return True


def layers(sandbox: LocalSandbox) -> Layers:
    """The sandbox's filesystem on the host, each layer read as the agent's user: over an
    image in range mode the lower is the cache entry with the image's own ids (mounted
    idmapped only inside), so it is read as the agent's inner ids."""
    if not sandbox.overlay:
        return Layers(sandbox.workdir, sandbox.agent_files(sandbox.host_work))
    upper = sandbox.agent_files(sandbox.root / "upper")
    if (image := sandbox.image) is None or image.root is None:
        return Layers("/", upper, sandbox.agent_files(sandbox.host_work))
    if sandbox.range is not None:
        inner = sandbox.range.users["agent"]
        return Layers("/", upper, AgentTree(image.root, inner.uid, inner.gid))
    return Layers("/", upper, sandbox.agent_files(image.root))


@dataclass(frozen=True)
class Place:
    """A path of the sandbox found in its layers: in the upper one, the lower one, or
    (a folder) both merged."""

    upper: str | None  # its path in the upper layer, when it is there
    lower: str | None  # in the lower one, when that shows
    folder: bool


def _join(folder: str | None, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def locate(found: Layers, inside: str) -> Place | None:
    """Where `inside` is, resolved as the overlay resolves it (None: missing, or outside
    what the sandbox keeps); a link on the way raises `UnsafeAgentFile`."""
    path = "/" + _relative(inside)
    top = found.at.rstrip("/")
    if path != (top or "/") and not path.startswith(f"{top}/"):
        return None
    parts = [p for p in path[len(top):].split("/") if p]
    upper: str | None = ""
    lower: str | None = "" if found.lower is not None else None
    for index, part in enumerate(parts):
        shown = "/".join([top, *parts[:index + 1]])
        over = found.upper.lstat(_join(upper, part)) if upper is not None else None
        if over is not None and found.whiteout(over):
            return None
        under = (found.lower.lstat(_join(lower, part))
                 if found.lower is not None and lower is not None
                 and (over is None or stat.S_ISDIR(over.st_mode)) else None)
        seen = over if over is not None else under
        if seen is None:
            return None
        if stat.S_ISLNK(seen.st_mode):
            raise UnsafeAgentFile(shown, LINK)
        if not stat.S_ISDIR(seen.st_mode):
            if index < len(parts) - 1:
                return None  # a file where a folder would be: no such path
            return (Place(_join(upper, part), None, False) if over is not None
                    else Place(None, _join(lower, part), False))
        upper, lower = _descend(found, upper, lower, part, over, under)
    return Place(upper, lower, True)


def _descend(found: Layers, upper: str | None, lower: str | None, name: str,
             over: os.stat_result | None, under: os.stat_result | None
             ) -> tuple[str | None, str | None]:
    """The layers' folders at `name` below a merged folder: the lower one shows unless
    the upper one is opaque or what is below is not a folder."""
    below = (_join(lower, name) if under is not None and stat.S_ISDIR(under.st_mode)
             else None)
    if over is None:
        return None, below
    above = _join(upper, name)
    return above, None if below is None or found.opaque(above) else below


def excluded(relative: str, patterns: Sequence[str]) -> bool:
    """GNU tar's `--exclude` as Harbor passes it (`tar czf - --exclude=P -C SOURCE .`): a
    pattern matching the member's name (`./a/b`) or any tail of it after a `/` (`a/b`,
    `b`), `*` matching `/` too; an excluded folder is left out whole."""
    parts = relative.split("/")
    names = [f"./{relative}", *("/".join(parts[i:]) for i in range(len(parts)))]
    return any(fnmatch.fnmatchcase(name, p) for name in names for p in patterns)


@dataclass
class Listed:
    """What one pass found to keep, and what it refused on the way."""

    items: list[capture.ToKeep] = field(default_factory=list)
    refused: list[UnsafeAgentFile] = field(default_factory=list)
    out_of_time: bool = False


def list_artifacts(found: Layers, entries: Sequence[Artifact], *, deadline: float) -> Listed:
    """Every file the entries name, in order (a folder's by path), as `capture.ToKeep`s
    whose `kept` is their place in `artifacts/`."""
    listed = Listed()
    for entry in entries:
        try:
            place = locate(found, entry.source)
            if place is not None and place.folder:
                _walk(found, place.upper, place.lower, entry, "", 0, listed, deadline)
            elif place is not None:
                tree, path = ((found.upper, place.upper) if place.upper is not None
                              else (found.lower, place.lower))
                assert tree is not None and path is not None
                listed.items.append(capture.ToKeep(tree, path, entry.kept, entry.source))
            # else not there: Harbor's download fails quietly too
        except UnsafeAgentFile as error:  # the agent's doing: a gap, never the session's end
            listed.refused.append(error)
    return listed


def _walk(found: Layers, upper: str | None, lower: str | None, entry: Artifact, below: str,
          depth: int, listed: Listed, deadline: float) -> None:
    """A merged folder's files into `listed`, its subfolders after its files."""
    base = entry.source.rstrip("/")
    named = f"{base}/{below}" if below else (base or "/")
    if time.monotonic() >= deadline:
        listed.out_of_time = True
        return
    try:
        over = found.upper.listing(upper) if upper is not None else None
        under = found.lower.listing(lower) if found.lower is not None and lower is not None \
            else None
    except UnsafeAgentFile as error:  # swapped for a link meanwhile
        listed.refused.append(UnsafeAgentFile(named, error.rule))
        return
    if (over is not None and over.more) or (under is not None and under.more):
        listed.refused.append(UnsafeAgentFile(named, f"over {MAX_ENTRIES} entries"))
    above = over.entries if over is not None else {}
    beneath = under.entries if under is not None else {}
    folders = []
    for name in sorted(above.keys() | beneath.keys()):
        relative = _join(below, name)
        if excluded(relative, entry.exclude):
            continue
        on, off = above.get(name), beneath.get(name)
        if on is not None and found.whiteout(on):
            continue
        seen = on if on is not None else off
        assert seen is not None
        if stat.S_ISDIR(seen.st_mode):
            folders.append((name, on, off))
        elif stat.S_ISREG(seen.st_mode):
            tree, path = ((found.upper, _join(upper, name)) if on is not None
                          else (found.lower, _join(lower, name)))
            assert tree is not None
            listed.items.append(capture.ToKeep(tree, path, _join(entry.kept, relative),
                                               f"{named.rstrip('/')}/{name}"))
        else:
            listed.refused.append(UnsafeAgentFile(f"{named.rstrip('/')}/{name}", LINK if
                                                  stat.S_ISLNK(seen.st_mode)
                                                  else kind(seen.st_mode)))
    for name, on, off in folders:
        if depth >= MAX_DEPTH:
            listed.refused.append(UnsafeAgentFile(f"{named.rstrip('/')}/{name}",
                                                  "nested too deep"))
            continue
        deeper = _descend(found, upper, lower, name, on, off)
        _walk(found, *deeper, entry, _join(below, name), depth + 1, listed, deadline)


# --- the pass ----------------------------------------------------------------------------------


def keep_artifacts(found: Layers, entries: Sequence[Artifact], folder: Path,
                   secrets: Sequence[str], *, budget_s: float) -> capture.KeptFiles:
    """The artifacts listed, then copied into `folder/artifacts` within `budget_s`."""
    deadline = time.monotonic() + budget_s
    listed = list_artifacts(found, entries, deadline=deadline)
    result = capture.KeptFiles(refused=listed.refused, out_of_time=listed.out_of_time)
    if listed.items:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        capture.keep_listed(listed.items, folder, FOLDER, secrets, deadline=deadline,
                            result=result)
    return result


class Recording(Protocol):
    """What the pass needs of the runner's recorder."""

    @property
    def session_id(self) -> str: ...

    @property
    def log(self) -> Sequence[StoredEvent]: ...

    async def append(self, events: Sequence[Mapping[str, Any]]) -> None: ...


async def keep(rec: Recording, entries: Sequence[Artifact], sandbox: LocalSandbox,
               settings: Settings, secrets: Sequence[str], modes: dict[str, int] | None = None
               ) -> list[dict[str, Any]]:
    """SPEC §15's artifact pass, after the archive and before the verifier (none when the
    sandbox is lost): the task's artifacts kept in the session's artifact folder within
    `session_close_timeout_s`, their refusals and `artifacts_truncated` appended as gaps;
    the `files` entries for the verification event. Each kept file's permission bits as
    the sandbox had them go to `modes` (by `files` path), for a separate verifier."""
    if any(s.event.type == "sandbox.lost" for s in rec.log):
        return []
    folder = artifacts.session_folder(settings.sandbox_logs_dir, rec.session_id)
    budget_s = settings.session_close_timeout_s
    gaps: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    try:
        with anyio.fail_after(budget_s + 1.0):  # the pass stops itself between files
            kept = await anyio.to_thread.run_sync(functools.partial(
                keep_artifacts, layers(sandbox), entries, folder, secrets,
                budget_s=budget_s), abandon_on_cancel=True)
    except TimeoutError:
        gaps.append(_truncated(f"the copy ran past its budget of {budget_s:.1f} s"))
    except OSError as error:
        gaps.append(_truncated(f"the copy into {folder / FOLDER} failed: {error}"))
    else:
        files = kept.files
        if modes is not None:
            modes.update(kept.modes)
        refused = kept.refused[:MAX_REFUSALS]
        if len(kept.refused) > MAX_REFUSALS:  # planted by the thousand: one gap says how many
            refused.append(UnsafeAgentFile(FOLDER, f"{len(kept.refused) - MAX_REFUSALS} more "
                                                   f"refused, not listed one by one"))
        gaps += [{"type": "gap.recorded", "at": now(), "data": error.gap()}
                 for error in refused]
        if kept.out_of_time:
            gaps.append(_truncated(f"the capture budget of {budget_s:.1f} s ran out: "
                                   f"{kept.left_out} file(s) listed were not kept"))
        elif kept.left_out:
            gaps.append(_truncated(
                f"{kept.left_out} file(s) not kept: each pass keeps at most "
                f"{capture.MAX_KEPT_FILES} files and {capture.MAX_KEPT_BYTES} bytes"))
    await rec.append(gaps)
    return files


def _truncated(detail: str) -> dict[str, Any]:
    return {"type": "gap.recorded", "at": now(),
            "data": {"code": "artifacts_truncated", "detail": detail}}
