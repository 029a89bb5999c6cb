"""What the runner captures from files the agent controls (SPEC §8, §11, §15): usage from
the rollouts, the archive, the verifier's reward and its files — all through `AgentTree`'s
safe reads.

A file that breaks a reading rule becomes gap `unsafe_agent_file` (its path and the rule);
its content never reaches an event, and nothing here raises for what the agent did.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.rollout import iter_usage_events
from trialledger.adapters.codex.zst import Undecodable, decompressed
from trialledger.adapters.sandbox.agentfiles import (
    AgentTree,
    AlreadyRead,
    LongLine,
    Seen,
    UnsafeAgentFile,
    split_lines,
)
from trialledger.core import scrub
from trialledger.core.boundedjson import UnsafeJSON, bounded_loads
from trialledger.core.settings import TASK_FILE_MAX_BYTES

ROLLOUTS = "sessions"
ROLLOUT_PATTERNS = ("rollout-*.jsonl", "rollout-*.jsonl.zst")
MAX_ROLLOUTS = 64


def _gap(error: UnsafeAgentFile, at: str) -> dict[str, Any]:
    return {"type": "gap.recorded", "at": at, "data": error.gap()}


def rollouts(tree: AgentTree, pattern: str) -> tuple[list[str], list[UnsafeAgentFile]]:
    """The rollout files under CODEX_HOME/sessions (relative paths) and what was refused.

    At most `MAX_ROLLOUTS` are read: each is capped, and so is their number, so what an
    agent plants there cannot make the capture read without end (one session writes one).
    """
    files, refused = tree.find(ROLLOUTS, pattern)
    if len(files) > MAX_ROLLOUTS:
        refused.append(UnsafeAgentFile(ROLLOUTS, f"{len(files)} rollout files, over the cap "
                                                 f"of {MAX_ROLLOUTS}; the rest not read"))
    return files[:MAX_ROLLOUTS], refused


class LeftUnscrubbed(UnsafeAgentFile):
    """A compressed rollout that could not be decoded, so not scrubbed: the archive leaves
    it out (never archived raw) and records gap `archive_unscrubbed`."""

    def gap(self) -> dict[str, str]:
        """The `gap.recorded` data for this rollout."""
        return {"code": "archive_unscrubbed", "detail": f"{self}; left out of the archive"}


def _text_lines(tree: AgentTree, path: str, refused: list[UnsafeAgentFile], *,
                seen: Seen | None = None) -> Iterator[str]:
    """A rollout's lines as text, a `.jsonl.zst` one decompressed on the way (an
    undecodable one raises `Undecodable` where the decoder stops)."""
    lines = (split_lines(decompressed(tree.chunks(path, seen=seen), path))
             if path.endswith(".zst") else tree.lines(path, seen=seen))
    for line in lines:
        if isinstance(line, LongLine):
            refused.append(UnsafeAgentFile(path, f"a {line.size}-byte line, over the "
                                                 f"1 MiB line cap (skipped)"))
            continue
        yield line.decode("utf-8", errors="replace")


def refused_lines(path: str, rules: Counter[str]) -> list[UnsafeAgentFile]:
    """One violation per rule the lines of `path` broke (so a file of a million bad lines
    is one gap, not a million), with how many lines broke it."""
    return [UnsafeAgentFile(path, f"{count} line(s) {rule} (skipped)")
            for rule, count in rules.items()]


def usage_events(tree: AgentTree, *, at: str) -> list[dict[str, Any]]:
    """`usage.native` (and gap) events from every rollout (plain, then compressed), read
    safely."""
    files: list[str] = []
    refused: list[UnsafeAgentFile] = []
    for pattern in ROLLOUT_PATTERNS:
        found, unsafe = rollouts(tree, pattern)
        files, refused = files + found, refused + unsafe
    events: list[dict[str, Any]] = []
    for path in files:
        rules: Counter[str] = Counter()
        try:
            events += iter_usage_events(_text_lines(tree, path, refused), at=at,
                                        refused=rules)
        except UnsafeAgentFile as error:
            refused.append(error)
        refused += refused_lines(path, rules)
    return events + [_gap(error, at) for error in refused]


@dataclass
class ArchiveResult:
    """What the archive copied, and what it refused."""

    files: int = 0  # files written (each inode once)
    size: int = 0  # bytes written
    links: int = 0  # further names of a file already written: hard links, no bytes
    refused: list[UnsafeAgentFile] = field(default_factory=list)


def archived_name(path: str) -> str:
    """Where a rollout goes in the archive: a `.jsonl.zst` one is kept decompressed, so
    under its `.jsonl` name."""
    return path.removesuffix(".zst")


def copy_archive(tree: AgentTree, target: Path, secrets: Sequence[str]) -> ArchiveResult:
    """Copy the rollouts that pass the reading rules into `target` (folders 0700, files
    0600), each line scrubbed of the session's secrets; a `.jsonl.zst` one decompressed
    (`archived_name`), or left out when it cannot be decoded (`LeftUnscrubbed`): its
    bytes are never archived as they are. Each file (inode) is read and written once:
    its other names become hard links to that copy in the archive, so one big rollout
    linked many times costs its bytes once."""
    result = ArchiveResult()
    seen: Seen = {}
    written: set[str] = set()
    for pattern in ROLLOUT_PATTERNS:
        files, refused = rollouts(tree, pattern)
        result.refused += refused
        for path in files:
            name = archived_name(path)
            if name in written:  # both `x.jsonl` and `x.jsonl.zst`: the first is kept
                result.refused.append(UnsafeAgentFile(path, f"another rollout is archived "
                                                            f"as {name}"))
                continue
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                size = _write_lines(destination, (scrub(line, secrets) for line in _text_lines(
                    tree, path, result.refused, seen=seen)))
            except AlreadyRead as again:
                if linked := _link(target / archived_name(again.first), destination):
                    result.links += linked
                    written.add(name)
                continue
            except Undecodable as error:
                result.refused.append(LeftUnscrubbed(error.path, error.rule))
                continue
            except UnsafeAgentFile as error:
                result.refused.append(error)
                continue
            written.add(name)
            result.files += 1
            result.size += size
    for folder, _, _ in os.walk(target):
        os.chmod(folder, 0o700)
    return result


MAX_KEPT_FILES = 256  # per capture pass (SPEC §15), then its `*_truncated` gap
MAX_KEPT_BYTES = 16 * 1024 * 1024
HEADER_ROOM = 64  # `keep_text`'s first line, "[N earlier bytes not kept]", at most
FIRST_KEPT = ("test-stdout.txt", "reward.json", "reward.txt")  # kept before the rest


@dataclass
class KeptFiles:
    """What a capture pass kept: the `files` entries of the verification event, what
    broke a reading rule, and how many files it left out (over its caps, or out of time)."""

    files: list[dict[str, Any]] = field(default_factory=list)  # {path, size, sha256}
    refused: list[UnsafeAgentFile] = field(default_factory=list)
    left_out: int = 0
    out_of_time: bool = False
    # Each kept file's permission bits where it was read (its `files` path → bits): not in
    # any event; a separate verifier's copies take them, as Harbor's copies keep them.
    modes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ToKeep:
    """One file a capture pass may keep: where it is read, where it goes, how it is named."""

    tree: AgentTree
    path: str  # in the tree
    kept: str  # in the pass's folder (`test-stdout.txt`), before its name is scrubbed
    named: str  # in a refusal's detail


def keep_files(tree: AgentTree, target: Path, name: str, secrets: Sequence[str], *,
               budget_s: float) -> KeptFiles:
    """Copy every regular file under `tree` into `target/name` (`keep_listed`), a link,
    FIFO or device refused, never followed or opened; `FIRST_KEPT` first, then by path.
    Entries are listed by their path in `target` (`verifier/test-stdout.txt`)."""
    deadline = time.monotonic() + budget_s
    found, refused = tree.find("", "*")
    result = KeptFiles(refused=[UnsafeAgentFile(f"{name}/{e.path.lstrip('/')}", e.rule)
                                for e in refused])
    paths = sorted((p.lstrip("/") for p in found),
                   key=lambda p: (FIRST_KEPT.index(p) if p in FIRST_KEPT else len(FIRST_KEPT), p))
    keep_listed([ToKeep(tree, path, path, f"{name}/{path}") for path in paths], target, name,
                secrets, deadline=deadline, result=result)
    return result


def keep_listed(items: Sequence[ToKeep], target: Path, name: str, secrets: Sequence[str], *,
                deadline: float, result: KeptFiles) -> None:
    """Copy `items` in order into `target/name` (folders 0700, files 0600), each scrubbed of
    the session's secrets (its name too), at most `MAX_KEPT_FILES` files and
    `MAX_KEPT_BYTES` bytes, stopping between files once `deadline` (monotonic) has passed;
    what was kept, refused and left out goes to `result`. Each inode is read and written
    once (another name of it becomes a hard link to that copy)."""
    seen: dict[int, Seen] = {}  # per tree: two trees are two file systems (overlay layers)
    kept: dict[tuple[int, str], dict[str, Any]] = {}  # (tree, source path) → its entry
    written: set[str] = set()
    room = MAX_KEPT_BYTES
    for index, item in enumerate(items):
        if time.monotonic() >= deadline:
            result.out_of_time, result.left_out = True, result.left_out + len(items) - index
            break
        shown = scrub(item.kept, secrets)
        if len(result.files) >= MAX_KEPT_FILES:
            result.left_out += 1
            continue
        if shown in written:
            result.refused.append(UnsafeAgentFile(item.named,
                                                  "its name, scrubbed, is another's"))
            continue
        destination = target / name / shown
        try:
            data, mode = item.tree.read_with_mode(item.path, room,
                                                  seen=seen.setdefault(id(item.tree), {}))
        except AlreadyRead as again:
            if (first := kept.get((id(item.tree), again.first))) is not None:
                destination.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                _link(target / first["path"], destination)
                result.files.append({**first, "path": f"{name}/{shown}"})
                if first["path"] in result.modes:
                    result.modes[f"{name}/{shown}"] = result.modes[first["path"]]
                written.add(shown)
            continue
        except UnsafeAgentFile as error:
            if error.rule.endswith("-byte cap"):  # over what the pass has room left for
                result.left_out += 1
            else:
                result.refused.append(UnsafeAgentFile(item.named, error.rule))
            continue
        data = scrub(data.decode("utf-8", "surrogateescape"), secrets).encode(
            "utf-8", "surrogateescape")  # bytes that are not UTF-8 stay as they were
        if len(data) > room:  # a scrub that made it longer
            result.left_out += 1
            continue
        write_private(destination, data)
        room -= len(data)
        written.add(shown)
        kept[id(item.tree), item.path] = {"path": f"{name}/{shown}", "size": len(data),
                                          "sha256": hashlib.sha256(data).hexdigest()}
        result.files.append(kept[id(item.tree), item.path])
        result.modes[f"{name}/{shown}"] = mode
    for folder, _, _ in os.walk(target / name):  # `mkdir(parents=True)` ignores the mode
        os.chmod(folder, 0o700)
    if target.is_dir():  # the session's folder too: its readers take no other (artifacts)
        os.chmod(target, 0o700)


def keep_text(folder: Path, path: str, output: bytes, left_out: int,
              secrets: Sequence[str], *, empty: bool = False) -> dict[str, Any] | None:
    """`output` — the end of what something in the sandbox wrote, `left_out` earlier bytes
    not read — scrubbed, as `path` in the session's artifact folder `folder` (0600, its
    folders 0700; a first line says how many earlier bytes were not kept): a collect hook's
    output, the oracle's `oracle.txt`. Its `files` entry; None when there was nothing
    (unless `empty`: an empty file is kept), or it could not be written."""
    if not output and not left_out and not empty:
        return None
    if left_out and secrets:  # a secret the cut went through would keep its unscrubbed end
        drop = min(len(output), 6 * max(len(secret.encode()) for secret in secrets))
        output, left_out = output[drop:], left_out + drop  # (6: its longest escaped form)
    data = scrub(output.decode("utf-8", "surrogateescape"), secrets).encode(
        "utf-8", "surrogateescape")  # bytes that are not UTF-8 stay as they were
    room = HEADER_ROOM if left_out or len(data) > MAX_KEPT_BYTES else 0
    if len(data) + room > MAX_KEPT_BYTES:  # (scrubbing may lengthen it: a file past the
        cut = len(data) + room - MAX_KEPT_BYTES  # cap would never be given back)
        data, left_out = data[cut:], left_out + cut
    if left_out:
        data = f"[{left_out} earlier bytes not kept]\n".encode() + data
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(folder / path, data)
        os.chmod((folder / path).parent, 0o700)
    except OSError:
        return None
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_private(destination: Path, data: bytes) -> None:
    """`data` as a new 0600 file, its folders made 0700 (never through a link)."""
    destination.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _write_lines(destination: Path, lines: Iterable[str]) -> int:
    """`lines` joined by newlines into a new 0600 file, written as they come (one line
    held at a time, however many a rollout has); the bytes written. A read that fails on
    the way removes the file: a rollout is archived whole or not at all."""
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    size = 0
    try:
        with os.fdopen(fd, "wb") as handle:
            for index, line in enumerate(lines):
                size += handle.write(b"\n" if index else b"")
                size += handle.write(line.encode())
    except BaseException:
        destination.unlink(missing_ok=True)
        raise
    return size


def _link(first: Path, name: Path) -> int:
    """`name` as a hard link to the archived copy `first` (1), or nothing when `first` was
    refused and so never written (0: its refusal is already recorded)."""
    if not first.is_file():
        return 0
    name.unlink(missing_ok=True)
    os.link(first, name)
    return 1


def _number(value: Any) -> float | None:
    """A reward value as Harbor counts it: a finite number, a boolean as 1 or 0."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def read_reward(tree: AgentTree, return_code: int | None, timed_out: bool, *,
                from_exit_code: bool = False, limit: int = TASK_FILE_MAX_BYTES
                ) -> list[tuple[str, dict[str, Any]]]:
    """What the verifier left, read as Harbor reads it (docs/SPEC.md §15): `reward.json`
    ({name: number}) else `reward.txt` (one number); neither is `no_reward` unless the task
    opted in to its exit code (`from_exit_code`: 0 is 1, anything else 0). An unsafe reward
    file, or one over `limit` bytes (the `task_file_max_bytes` setting), is a gap and a
    `bad_reward` (never its content)."""
    if timed_out:
        return [("verification.failed", {"reason": "timeout",
                                         "detail": "the verifier timed out"})]
    for name in ("reward.json", "reward.txt"):
        try:
            raw = tree.read(name, limit)
        except UnsafeAgentFile as error:
            if error.rule == "missing":
                continue
            return [("gap.recorded", error.gap()),
                    ("verification.failed", {"reason": "bad_reward", "detail": str(error)})]
        return [_parse_reward(name, raw, limit)]
    if not from_exit_code:
        return [("verification.failed", {
            "reason": "no_reward",
            "detail": "the verifier wrote neither reward.json nor reward.txt"})]
    if return_code is None:
        return [("verification.failed", {"reason": "no_reward",
                                         "detail": "the verifier ended without an exit code"})]
    reward = 1.0 if return_code == 0 else 0.0
    return [("verification.recorded", {"rewards": {"reward": reward},
                                       "detail": f"exit code {return_code}"})]


def _parse_reward(name: str, raw: bytes, limit: int) -> tuple[str, dict[str, Any]]:
    """A reward file's value; a malformed one is named, never quoted (`reward.json` goes
    through the bounded JSON reader: its depth and numbers are the agent's to choose)."""
    why = ""
    try:
        if not raw:
            return "verification.failed", {"reason": "bad_reward", "detail": f"{name} is empty"}
        if name == "reward.json":
            found = bounded_loads(raw, limit=limit)
            if isinstance(found, dict):  # `{}` is a result without names, as in Harbor
                rewards = {str(key): _number(value) for key, value in found.items()}
                if None not in rewards.values():
                    return "verification.recorded", {"rewards": rewards, "detail": name}
        else:
            value = float(raw.decode("utf-8").strip())
            if math.isfinite(value):
                return "verification.recorded", {"rewards": {"reward": value}, "detail": name}
    except UnsafeJSON as error:
        why = "" if error.malformed else f" ({error.rule})"
    except (ValueError, UnicodeDecodeError):
        pass
    shape = "an object of finite numbers" if name == "reward.json" else "one finite number"
    return "verification.failed", {"reason": "bad_reward",
                                   "detail": f"{name} is not {shape}{why}"}
