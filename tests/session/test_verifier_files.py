"""The verifier's files, kept as Harbor keeps `/logs/verifier` (SPEC §15 "What is kept"):
copied after the verifier by a capture pass of their own into the session's artifact
folder, scrubbed, listed on the verification event (schema 3 `files`) and in the
`verification_files` view, shown by `show` and given back by `trialledger artifacts`."""

from __future__ import annotations

import hashlib
import os
import pty
import stat
import sys
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from sqlalchemy import text

from tests.runs import in_process, make_task, run_task
from tests.scenarios import CLEAN, LogBuilder
from trialledger.adapters.demo.endpoint import message
from trialledger.adapters.sandbox.agentfiles import AgentTree
from trialledger.adapters.session import capture
from trialledger.adapters.view.names import slug
from trialledger.core.events import VerificationRecordedData
from trialledger.core.parsing import event_dict, parse_event
from trialledger.store import Ledger
from trialledger.store.engine import open_engines

pytestmark = pytest.mark.anyio
SECRET = "sk-verifier-files-7Qm2Xw9Lp4Zt"
CANARY = "CANARY-host-file-4f1e9b"


async def cli(*argv: str) -> Any:
    """`trialledger ARGV` in this process, off the test's event loop."""
    return await anyio.to_thread.run_sync(lambda: in_process(*argv))


def verification(view: Any) -> Any:
    (event,) = [e for e in view.events if e.type.startswith("verification.")]
    return event


async def verifier_run(tmp_path: Path, test_sh: str, **settings: Any) -> Any:
    task = make_task(tmp_path / "task", test_sh=test_sh)
    return await run_task(str(tmp_path / "t.db"), task, [message()], api_key=SECRET,
                          settings={"sandbox_logs_dir": str(tmp_path / "kept"), **settings})


async def view_rows(db: str, session_id: str) -> list[tuple[Any, ...]]:
    async with open_engines(db) as engines, engines.reader.begin() as conn:
        return sorted(tuple(r) for r in await conn.execute(text(
            "SELECT path, size, sha256 FROM verification_files WHERE session_id = :s "
            "ORDER BY path"), {"s": session_id}))


WRITES = f"""echo hello-from-the-verifier
cat > /logs/verifier/junit.xml <<'EOF'
<testsuite name="t" tests="1"><testcase name="ok"/></testsuite>
EOF
mkdir -p /logs/verifier/deeper
echo "key={SECRET} and a cut echo {SECRET[:12]}" > /logs/verifier/deeper/leak.txt
printf '\\377\\376 not utf-8' > /logs/verifier/raw.bin
exit 0
"""


async def test_the_verifier_files_are_kept_scrubbed_listed_and_read_back(
        tmp_path: Path, postgres: Any) -> None:
    ran = await verifier_run(tmp_path, WRITES)
    sid = ran.result.session_id
    event = verification(ran.view)
    assert event.type == "verification.recorded" and event.schema_ == 3
    folder = tmp_path / "kept" / sid
    listed = {f.path: f for f in event.data.files}
    assert set(listed) == {"verifier/test-stdout.txt", "verifier/junit.xml",
                           "verifier/deeper/leak.txt", "verifier/raw.bin"}
    for path, entry in listed.items():
        on_disk = folder / path
        data = on_disk.read_bytes()
        assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert stat.S_IMODE(on_disk.stat().st_mode) == 0o600
    for inside in (folder, folder / "verifier", folder / "verifier" / "deeper"):
        assert stat.S_IMODE(inside.stat().st_mode) == 0o700
    assert b"hello-from-the-verifier" in (folder / "verifier/test-stdout.txt").read_bytes()
    assert b'<testcase name="ok"/>' in (folder / "verifier/junit.xml").read_bytes()
    leak = (folder / "verifier/deeper/leak.txt").read_bytes()
    assert SECRET[:8].encode() not in leak and leak.count(b"[redacted]") == 2
    assert (folder / "verifier/raw.bin").read_bytes() == b"\xff\xfe not utf-8"  # as written

    expected = sorted((p, f.size, f.sha256) for p, f in listed.items())
    assert await view_rows(str(tmp_path / "t.db"), sid) == expected
    async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
        log = await ledger.export(sid)
    pg = postgres.create_database()
    async with await Ledger.open(pg) as ledger:
        await ledger.import_log(log)
    assert await view_rows(pg, sid) == expected

    shown = await cli("show", sid, "--db", str(tmp_path / "t.db"))
    assert shown.returncode == 0
    assert "verifier/junit.xml" in shown.stdout and f"{listed['verifier/junit.xml'].size} " \
        "bytes" in shown.stdout
    listing = await cli("artifacts", sid, "--db", str(tmp_path / "t.db"))
    assert listing.returncode == 0 and str(folder) in listing.stdout
    assert all(path in listing.stdout for path in listed)
    printed = await cli("artifacts", sid, "verifier/junit.xml", "--db", str(tmp_path / "t.db"))
    assert printed.returncode == 0
    assert printed.stdout == (folder / "verifier/junit.xml").read_text()
    copied = await cli("artifacts", sid, "--out", str(tmp_path / "out"), "--db",
                        str(tmp_path / "t.db"))
    assert copied.returncode == 0
    assert (tmp_path / "out/verifier/deeper/leak.txt").read_bytes() == leak


async def test_a_hostile_verifier_plants_links_a_fifo_and_too_many_files(
        tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text(CANARY)
    hostile = f"""cd /logs/verifier
ln -s {canary} link-to-canary
ln -s {tmp_path} link-to-folder
mkfifo a-fifo
mkdir many
for i in $(seq 1 300); do echo "file $i" > many/f$i.txt; done
echo 1 > reward.txt
"""
    with anyio.fail_after(120):  # the FIFO is never opened for reading: no hang
        ran = await verifier_run(tmp_path, hostile)
    sid = ran.result.session_id
    event = verification(ran.view)
    assert event.type == "verification.recorded" and event.data.rewards == {"reward": 1.0}
    assert len(event.data.files) == capture.MAX_KEPT_FILES
    assert [f.path for f in event.data.files][:2] == ["verifier/test-stdout.txt",
                                                      "verifier/reward.txt"]
    gaps = {(g.code, (g.detail or "").split(":")[0]) for g in ran.view.observations.gaps}
    assert {("unsafe_agent_file", "verifier/link-to-canary"),
            ("unsafe_agent_file", "verifier/link-to-folder"),
            ("unsafe_agent_file", "verifier/a-fifo")} <= gaps
    (truncated,) = [g for g in ran.view.observations.gaps
                    if g.code == "verifier_output_truncated"]
    assert (truncated.detail or "").startswith("46 file(s) not kept")  # 302 regular, 256 kept
    kept = tmp_path / "kept" / sid
    for folder, _, names in os.walk(kept):
        for name in names:
            path = Path(folder, name)
            assert not path.is_symlink() and stat.S_ISREG(path.lstat().st_mode)
            assert CANARY not in path.read_text(errors="replace")
    async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
        assert CANARY not in str(await ledger.export(sid))
    assert ran.view.state == "closed"


async def test_artifacts_refuses_a_path_outside_a_link_and_a_changed_file(
        tmp_path: Path) -> None:
    ran = await verifier_run(tmp_path, "echo printed\necho '<x/>' > /logs/verifier/junit.xml\n")
    sid, db = ran.result.session_id, str(tmp_path / "t.db")
    folder = tmp_path / "kept" / sid / "verifier"
    (tmp_path / "kept" / "outside.txt").write_text("not the session's")
    for path in ("../outside.txt", "verifier/../../outside.txt", "/etc/passwd",
                 "verifier/not-kept.txt"):
        refused = await cli("artifacts", sid, path, "--db", db)
        assert refused.returncode == 2 and refused.stdout == "", path
        assert len(refused.stderr.strip().splitlines()) == 1

    (folder / "junit.xml").write_text("<x/> edited\n")  # tampered after it was kept
    refused = await cli("artifacts", sid, "verifier/junit.xml", "--db", db)
    assert refused.returncode == 2 and "changed since it was kept" in refused.stderr
    assert refused.stdout == ""
    copy = await cli("artifacts", sid, "--out", str(tmp_path / "out"), "--db", db)
    assert copy.returncode == 2 and not (tmp_path / "out").exists()  # nothing half-copied

    os.unlink(folder / "test-stdout.txt")  # a link where a kept file was
    os.symlink(tmp_path / "kept" / "outside.txt", folder / "test-stdout.txt")
    refused = await cli("artifacts", sid, "verifier/test-stdout.txt", "--db", db)
    assert refused.returncode == 2 and "symbolic link" in refused.stderr
    assert "not the session's" not in refused.stdout + refused.stderr


async def test_a_folder_not_on_this_machine_is_named_not_read(tmp_path: Path) -> None:
    ran = await verifier_run(tmp_path, "echo printed\n")
    sid, db = ran.result.session_id, str(tmp_path / "t.db")
    (tmp_path / "kept").rename(tmp_path / "elsewhere")
    listing = await cli("artifacts", sid, "--db", db)
    assert listing.returncode == 1
    assert "verifier/test-stdout.txt" in listing.stdout
    assert str(tmp_path / "kept" / sid) in listing.stderr.replace("\n", "")
    printed = await cli("artifacts", sid, "verifier/test-stdout.txt", "--db", db)
    assert printed.returncode == 1 and printed.stdout == ""


def test_the_pass_stops_at_its_caps_and_its_budget(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "logs"
    (source / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (source / name).write_bytes(b"x" * 100)
    os.link(source / "a.txt", source / "sub/a-again.txt")  # one inode, copied once
    whole = capture.keep_files(AgentTree(source), tmp_path / "whole", "verifier", [],
                               budget_s=60)
    assert [f["path"] for f in whole.files] == [
        "verifier/a.txt", "verifier/b.txt", "verifier/sub/a-again.txt", "verifier/sub/c.txt"]
    again = tmp_path / "whole/verifier/sub/a-again.txt"
    assert again.stat().st_ino == (tmp_path / "whole/verifier/a.txt").stat().st_ino

    monkeypatch.setattr(capture, "MAX_KEPT_BYTES", 250)
    kept = capture.keep_files(AgentTree(source), tmp_path / "out", "verifier", [],
                              budget_s=60)
    assert [f["path"] for f in kept.files] == ["verifier/a.txt", "verifier/b.txt"]
    assert kept.left_out == 2 and not kept.out_of_time  # over the 50 bytes left
    monkeypatch.setattr(capture, "MAX_KEPT_FILES", 1)
    few = capture.keep_files(AgentTree(source), tmp_path / "few", "verifier", [], budget_s=60)
    assert ([f["path"] for f in few.files], few.left_out) == (["verifier/a.txt"], 3)

    late = capture.keep_files(AgentTree(source), tmp_path / "late", "verifier", [],
                              budget_s=0)
    assert (late.files, late.left_out, late.out_of_time) == ([], 4, True)


def test_an_older_verification_reads_no_files_and_dumps_as_written() -> None:
    for schema in (1, 2):
        written: dict[str, Any] = {
            "type": "verification.recorded", "at": "2026-01-01T00:00:00Z",
            "schema": schema, "data": {"rewards": {"reward": 1.0}, "detail": "x"}}
        event = parse_event(written)
        data = cast(VerificationRecordedData, event.data)
        assert data.files == [] and event.schema_ == schema
        assert event_dict(event)["data"] == written["data"]
    new = parse_event({**written, "schema": 3, "data": {**written["data"], "files": []}})
    assert event_dict(new)["data"]["files"] == []


def _log_pointing_at(logs_dir: Path, session_id: str | None, kept: bytes) -> list[Any]:
    """An imported log whose verification lists `verifier/test-stdout.txt` with `kept`'s
    sha256, its seed naming `logs_dir` and (when given) its own session id."""
    log = LogBuilder(settings={"sandbox_logs_dir": str(logs_dir)}).launched()
    log.codex(CLEAN).finish(0)
    log.events.append({"type": "verification.recorded", "at": "2026-11-29T09:00:00Z",
                       "schema": 3, "data": {
                           "rewards": {"reward": 1.0}, "detail": None,
                           "files": [{"path": "verifier/test-stdout.txt", "size": len(kept),
                                      "sha256": hashlib.sha256(kept).hexdigest()}]}})
    log.add("session.closed", {"reason": "normal"})
    if session_id is not None:
        log.events[0]["session_id"] = session_id
    return log.events


@pytest.mark.parametrize("how", ["absolute id", "relative id", "logs dir"])
async def test_an_imported_log_cannot_point_the_readers_at_another_folder(
        tmp_path: Path, how: str) -> None:
    """The folder is `<sandbox_logs_dir>/<session id>`, both the log's: an id of `/x` or
    `../x`, or a logs dir naming a folder of the host, read it (its files' contents when
    their sha256 is known, their existence always). Only a plain id's 0700 folder of this
    user, as the runner makes it, is read."""
    victim = tmp_path / "victim"  # another folder of the host: 0755, as most are
    (victim / "verifier").mkdir(parents=True)
    (victim / "verifier" / "test-stdout.txt").write_bytes(b"HOST-FILE")
    (tmp_path / "logs").mkdir(mode=0o700)  # the logs dir a runner here would have made
    logs, sid = {"absolute id": (tmp_path / "logs", str(victim)),
                 "relative id": (tmp_path / "logs", "../victim"),
                 "logs dir": (tmp_path, "victim")}[how]
    db = str(tmp_path / "t.db")
    async with await Ledger.open(db) as ledger:
        session_id = await ledger.import_log(_log_pointing_at(logs, sid, b"HOST-FILE"))
    printed = await cli("artifacts", session_id, "verifier/test-stdout.txt", "--db", db)
    assert printed.returncode == 1 and "HOST-FILE" not in printed.stdout
    assert "not on this machine" in printed.stderr
    from trialledger.adapters.view.site import Site
    from trialledger.adapters.view.store import open_read_only
    async with await open_read_only(db) as reader:
        page = await Site(reader).session(slug(session_id))
    assert "HOST-FILE" not in page and 'id="files-elsewhere"' in page


async def test_a_kept_file_that_grew_is_changed_even_when_kept_empty(tmp_path: Path) -> None:
    """A file past its recorded size was read as empty, which has the sha256 of an empty
    file kept: it was given back as empty, and copied so."""
    ran = await verifier_run(tmp_path, ": > /logs/verifier/empty.txt\n")
    sid, db = ran.result.session_id, str(tmp_path / "t.db")
    kept = tmp_path / "kept" / sid / "verifier" / "empty.txt"
    assert kept.read_bytes() == b""
    kept.write_bytes(b"appended later")
    printed = await cli("artifacts", sid, "verifier/empty.txt", "--db", db)
    assert printed.returncode == 2 and "changed since it was kept" in printed.stderr
    copied = await cli("artifacts", sid, "--out", str(tmp_path / "out"), "--db", db)
    assert copied.returncode == 2 and not (tmp_path / "out").exists()


async def test_a_kept_file_is_printed_to_a_terminal_without_its_escapes(
        tmp_path: Path) -> None:
    ran = await verifier_run(tmp_path, "printf 'a\\033]52;c;cm0gLXJmIH4K\\007b\\n' "
                                       "> /logs/verifier/esc.txt\n")
    sid, db = ran.result.session_id, str(tmp_path / "t.db")
    main, attached = pty.openpty()
    try:
        done = await anyio.run_process(
            [sys.executable, "-m", "trialledger.cli", "artifacts", sid, "verifier/esc.txt",
             "--db", db], stdout=attached, check=False)
        shown = os.read(main, 4096)
    finally:
        os.close(main)
        os.close(attached)
    assert done.returncode == 0 and b"\x1b" not in shown and b"ab" in shown
    piped = await cli("artifacts", sid, "verifier/esc.txt", "--db", db)  # not a terminal
    assert "\x1b]52" in piped.stdout  # the bytes as kept
