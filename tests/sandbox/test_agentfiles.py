"""Reading what the agent controls (SPEC §11): no link followed, regular files only,
bounded; and Codex's stdout split into bounded lines whatever the chunking."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trialledger.adapters.codex.stream import stream_events
from trialledger.adapters.sandbox.agentfiles import AgentTree, LongLine, UnsafeAgentFile
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.process import CutLine, LineSplitter
from trialledger.core.parsing import parse_event


@pytest.fixture
def tree(tmp_path: Path) -> AgentTree:
    (tmp_path / "home" / "sessions").mkdir(parents=True)
    return AgentTree(tmp_path / "home")


def rule(tree: AgentTree, path: str, limit: int = 100) -> str:
    with pytest.raises(UnsafeAgentFile) as caught:
        tree.read(path, limit)
    assert "secret content" not in str(caught.value)
    return caught.value.rule


def test_links_fifos_devices_folders_and_big_files_are_refused(
        tree: AgentTree, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("secret content")
    home = tree.root
    (home / "link").symlink_to(secret)
    (home / "zero").symlink_to("/dev/zero")
    os.mkfifo(home / "fifo")  # would block a plain open forever
    (home / "folder").mkdir()
    (home / "big").write_bytes(b"x" * 101)
    (home / "sessions" / "parent-link").symlink_to(tmp_path)  # a link in a parent
    (home / "ok").write_text("fine")
    assert rule(tree, "link") == rule(tree, "zero") == "a symbolic link (not followed)"
    assert rule(tree, "fifo") == "a FIFO"
    assert rule(tree, "folder") == "a folder"
    assert "over the 100-byte cap" in rule(tree, "big")
    assert rule(tree, "sessions/parent-link/secret") == "a symbolic link (not followed)"
    assert rule(tree, "missing") == "missing"
    assert rule(tree, "../secret") == "'..' in the path"
    assert tree.read("ok", 100) == b"fine"


def test_find_lists_regular_files_and_names_what_it_refused(tree: AgentTree) -> None:
    day = tree.root / "sessions" / "2026" / "11"
    day.mkdir(parents=True)
    (day / "rollout-a.jsonl").write_text("{}\n")
    (day / "rollout-b.jsonl").symlink_to("/etc/passwd")
    (day / "other.txt").symlink_to("/etc/passwd")  # not a rollout: not reported
    (tree.root / "sessions" / "linked-dir").symlink_to("/etc")
    found, refused = tree.find("sessions", "rollout-*.jsonl")
    assert found == ["sessions/2026/11/rollout-a.jsonl"]
    assert [(e.path, e.rule) for e in refused] == [
        ("sessions/2026/11/rollout-b.jsonl", "a symbolic link")]


def test_a_linked_top_folder_is_refused(tree: AgentTree, tmp_path: Path) -> None:
    (tree.root / "sessions").rmdir()
    (tree.root / "sessions").symlink_to(tmp_path)
    found, refused = tree.find("sessions", "*")
    assert found == [] and [e.rule for e in refused] == ["a symbolic link (not followed)"]


def test_lines_over_the_cap_are_skipped_and_the_file_cap_holds(tree: AgentTree) -> None:
    path = tree.root / "rollout.jsonl"
    path.write_bytes(b"short\n" + b"y" * 50 + b"\nlast")
    assert list(tree.lines("rollout.jsonl", line_limit=10)) == [
        b"short", LongLine(50), b"last"]
    with pytest.raises(UnsafeAgentFile, match="cap"):
        list(tree.lines("rollout.jsonl", file_limit=10))


@pytest.mark.skipif(os.geteuid() != 0, reason="the fs-uid switch is what root does")
def test_as_root_the_reads_have_only_the_sandbox_users_rights(
        tree: AgentTree, tmp_path: Path) -> None:
    user = sandbox_user()
    tmp_path.chmod(0o711)
    os.chown(tree.root, user.uid, user.gid)  # the session folder is the sandbox user's
    private = tree.root / "root-only"
    private.write_text("secret")
    private.chmod(0o600)  # root's, as a hard link to a host file would be
    sandboxed = AgentTree(tree.root, user.uid, user.gid)
    assert "Permission denied" in rule(sandboxed, "root-only")
    assert tree.read("root-only", 100) == b"secret"  # the same read as root succeeds
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(os.stat(private).st_uid))
    worker.start()
    worker.join()
    assert seen == [0] and os.access(private, os.R_OK)  # our own rights came back


@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(1, 60), st.data())
def test_the_splitter_matches_split_for_any_chunking(
        lines: list[bytes], limit: int, data: st.DataObject) -> None:
    stream = b"\n".join(line.replace(b"\n", b"") for line in lines)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    splitter = LineSplitter(limit)
    got = [line for chunk in chunks for line in splitter.feed(chunk)] + splitter.end()
    expected = stream.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()  # a stream ending in a newline has no torn last line
    assert [line if isinstance(line, bytes) else line.head for line in got] == [
        line[:limit] for line in expected]
    assert all(isinstance(g, CutLine) == (len(e) > limit) for g, e in
               zip(got, expected, strict=True))


@given(st.binary(max_size=300))
def test_any_stdout_bytes_become_valid_events(raw: bytes) -> None:
    for line in (raw, CutLine(raw, len(raw) + 1)):
        for event in stream_events(line, "2026-11-30T00:00:00Z"):
            parsed = parse_event(event)
            parsed.model_dump_json().encode("utf-8")  # storable: no lone surrogate


def test_the_number_of_rollouts_read_is_capped(tree: AgentTree) -> None:
    from trialledger.adapters.session.capture import MAX_ROLLOUTS, rollouts, usage_events

    day = tree.root / "sessions" / "2026"
    day.mkdir()
    for n in range(MAX_ROLLOUTS + 5):  # an agent's flood of planted rollouts
        (day / f"rollout-{n:04d}.jsonl").write_text("{}\n")
    files, refused = rollouts(tree, "rollout-*.jsonl")
    assert len(files) == MAX_ROLLOUTS and "over the cap" in refused[-1].rule
    gaps = [e["data"]["code"] for e in usage_events(tree, at="2026-11-30T00:00:00Z")]
    assert gaps == ["unsafe_agent_file"]
