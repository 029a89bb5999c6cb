"""The task's artifacts, collected as Harbor collects them (SPEC §15 "What is kept"): after
the archive and before the verifier, task.toml's `artifacts` and `/logs/artifacts` are
copied into `artifacts/` of the session's artifact folder — scrubbed, 0600 / 0700, never
through a link, at most 256 files — and listed on the verification event beside the
verifier's files. Real runs: the oracle on a host task, and over the tests' Debian rootfs
(range mode), whose overlay the pass reads as the agent saw it."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.runs import in_process, make_task
from tests.sandbox.test_range_mode import _debian_into
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.session import capture
from trialledger.adapters.session.runner import RunOptions, SessionRunner
from trialledger.adapters.tasks.artifacts import CONVENTION, LINK, Artifact, excluded
from trialledger.adapters.tasks.task import Task, TaskInvalid
from trialledger.core.events import CODEX_STREAM_TYPES
from trialledger.store import Ledger

TOKEN = "tl-artifact-token-5Gq8Zr2Vw"
CANARY = "CANARY-artifact-host-file-8d1c"


def session(db: Path) -> Any:
    """The one session of a store, its view."""
    async def read() -> Any:
        async with await Ledger.open(str(db), create=False) as ledger:
            (row,) = await ledger.sessions()
            return await ledger.view(row["session_id"])

    return anyio.run(read)


def verification(view: Any) -> Any:
    """The session's one verification event (else what the session recorded instead)."""
    found = [e for e in view.events if e.type.startswith("verification.")]
    assert len(found) == 1, [(e.type, e.data) for e in view.events
                             if e.type not in CODEX_STREAM_TYPES]
    return found[0]


def gaps(view: Any, code: str) -> list[str]:
    return [g.detail or "" for g in view.observations.gaps if g.code == code]


def oracle(task: Path, db: Path, kept: Path, *extra: str) -> Any:
    """`trialledger run TASK --agent oracle`, its files kept under `kept`; its session."""
    done = in_process("run", str(task), "--agent", "oracle", "--db", str(db),
                      "--set", f"sandbox_logs_dir={kept}", *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    return session(db)


HOST_TOML = """artifacts = [
  "/app/out.txt",
  {source = "/app/results", destination = "res", exclude = ["*.log", "cache"]},
  "/app/link",
  "/app/missing.txt",
  "/app/links",
]
[environment.env]
API_TOKEN = "${TL_TEST_ARTIFACT_TOKEN}"
"""
HOST_SOLVE = """#!/bin/sh
echo "token=$API_TOKEN" > /app/out.txt
mkdir -p /app/results/cache /app/results/sub
echo a > /app/results/a.txt
echo skipped > /app/results/debug.log
echo c > /app/results/cache/c.txt
echo s > /app/results/sub/s.txt
echo skipped > /app/results/sub/deep.log
ln -s {canary} /app/link
ln -s {canary} /app/results/link-inside
mkdir /app/links && for i in $(seq 10 79); do ln -s {canary} /app/links/l$i; done
"""


@dataclass(frozen=True)
class Run:
    """One oracle session of a task: its store, its artifact folder and its view."""

    db: Path
    folder: Path
    view: Any

    @property
    def listed(self) -> dict[str, Any]:
        return {f.path: f for f in verification(self.view).data.files}


@pytest.fixture(scope="module")
def host_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The oracle on a host task that leaves a file, a folder, links and a secret."""
    tmp = tmp_path_factory.mktemp("host")
    canary = tmp / "canary.txt"
    canary.write_text(CANARY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TL_TEST_ARTIFACT_TOKEN", TOKEN)
        task = make_task(tmp / "task", test_sh="exit 0\n", toml=HOST_TOML,
                         solve_sh=HOST_SOLVE.format(canary=canary))
        view = oracle(task.folder, tmp / "t.db", tmp / "kept")
    yield Run(tmp / "t.db", tmp / "kept" / view.session_id, view)


def test_a_file_and_a_folder_less_its_excludes_are_kept_and_listed(host_run: Run) -> None:
    event = verification(host_run.view)
    assert event.type == "verification.recorded" and event.schema_ == 3
    listed = host_run.listed
    assert set(listed) == {"artifacts/app/out.txt", "artifacts/res/a.txt",
                           "artifacts/res/sub/s.txt", "verifier/test-stdout.txt",
                           "agent/oracle.txt"}  # (the oracle's output, SPEC §15)
    folder = host_run.folder
    for path, entry in listed.items():
        data = (folder / path).read_bytes()
        assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert stat.S_IMODE((folder / path).stat().st_mode) == 0o600
    for inside in ("artifacts", "artifacts/app", "artifacts/res", "artifacts/res/sub"):
        assert stat.S_IMODE((folder / inside).stat().st_mode) == 0o700
    assert (folder / "artifacts/res/sub/s.txt").read_text() == "s\n"
    with closing(sqlite3.connect(host_run.db)) as conn:
        rows = sorted(conn.execute("SELECT path, size, sha256 FROM verification_files"))
    assert rows == sorted((p, f.size, f.sha256) for p, f in listed.items())


def test_a_link_at_an_artifact_path_or_inside_one_is_refused_never_followed(
        host_run: Run) -> None:
    refused = gaps(host_run.view, "unsafe_agent_file")
    assert refused[:2] == [f"/app/results/link-inside: {LINK}", f"/app/link: {LINK}"]
    # 72 planted: one gap each up to 64, then one that counts the rest
    assert refused[2:-1] == [f"/app/links/l{i}: {LINK}" for i in range(10, 72)]
    assert refused[-1] == "artifacts: 8 more refused, not listed one by one"
    for where, _, names in os.walk(host_run.folder):
        for name in names:
            path = Path(where, name)
            assert not path.is_symlink() and CANARY not in path.read_text(errors="replace")
    with closing(sqlite3.connect(host_run.db)) as conn:
        stored = "\n".join(row[0] for row in conn.execute("SELECT data FROM events"))
    assert CANARY not in stored


def test_a_secret_in_an_artifact_is_scrubbed(host_run: Run) -> None:
    kept = host_run.folder / "artifacts/app/out.txt"
    assert kept.read_text() == "token=[redacted]\n"
    assert TOKEN not in kept.read_text()


def test_show_and_artifacts_print_the_task_artifacts(host_run: Run) -> None:
    sid, db = host_run.view.session_id, str(host_run.db)
    shown = in_process("show", sid, "--db", db)
    assert shown.returncode == 0, shown.stderr
    listed = host_run.listed
    for path in ("artifacts/app/out.txt", "artifacts/res/a.txt", "artifacts/res/sub/s.txt"):
        assert f"{path}  {listed[path].size} bytes" in shown.stdout
    printed = in_process("artifacts", sid, "artifacts/res/a.txt", "--db", db)
    assert (printed.returncode, printed.stdout) == (0, "a\n")


IMAGE_TOML = """version = "1.0"
artifacts = ["/etc/skel", "/etc/default", "/root/report.txt", "/srv/many"]
[environment]
rootfs = "rootfs.tar"
"""
IMAGE_SOLVE = """#!/bin/bash
set -e
rm /etc/skel/.bash_logout
echo added > /etc/skel/added
rm -rf /etc/default && mkdir /etc/default && echo only > /etc/default/only
echo report > /root/report.txt
mkdir -p /logs/artifacts /srv/many
echo note > /logs/artifacts/note.txt
ln -s /etc/shadow /logs/artifacts/shadow-link
for i in $(seq 1 300); do echo "$i" > "/srv/many/f$(printf %03d "$i")"; done
"""


@pytest.fixture(scope="module", params=["range", "single"])
def image_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Run:
    """The oracle over the tests' Debian rootfs, in range mode (`setup` ran: the image's
    own ids below) and in single-id mode (`--sandbox-uid`: a rootless cache entry below):
    it deletes a file of the image, replaces a folder, writes `/logs/artifacts` and 300
    files."""
    tmp = tmp_path_factory.mktemp("image")
    folder = tmp / "task"
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    _debian_into(folder)
    (folder / "task.toml").write_text(IMAGE_TOML)
    (folder / "instruction.md").write_text("Leave some artifacts.\n")
    for path, text in ((folder / "solution/solve.sh", IMAGE_SOLVE),
                       (folder / "tests/test.sh", "#!/bin/bash\necho 1 > "
                                                  "/logs/verifier/reward.txt\n")):
        path.write_text(text)
        path.chmod(0o755)
    single = ("--sandbox-uid", str(sandbox_user().uid)) if request.param == "single" else ()
    view = oracle(folder, tmp / "t.db", tmp / "kept", *single)
    (launched,) = [e for e in view.events if e.type == "agent.launched"]
    assert launched.data.identity["mode"] == request.param
    return Run(tmp / "t.db", tmp / "kept" / view.session_id, view)


def test_an_image_sessions_artifacts_are_read_as_its_overlay_shows_them(
        image_run: Run) -> None:
    """The image's files below, the agent's above: a file it deleted (a whiteout) and a
    folder it replaced (opaque) are not taken from the image; `/logs/artifacts` first."""
    event = verification(image_run.view)
    assert event.type == "verification.recorded" and event.data.rewards == {"reward": 1.0}
    paths = list(image_run.listed)
    assert paths[0] == "agent/oracle.txt"  # (the oracle's output first, SPEC §15)
    assert paths[1:7] == ["artifacts/logs/artifacts/note.txt", "artifacts/etc/skel/.bashrc",
                         "artifacts/etc/skel/.profile", "artifacts/etc/skel/added",
                         "artifacts/etc/default/only", "artifacts/root/report.txt"]
    # the verifier's pass has caps of its own
    assert paths[-2:] == ["verifier/test-stdout.txt", "verifier/reward.txt"]
    kept = image_run.folder
    assert (kept / "artifacts/etc/skel/.bashrc").read_bytes().startswith(b"#")  # the image's
    assert not (kept / "artifacts/etc/default/useradd").exists()


def test_a_link_in_logs_artifacts_is_refused(image_run: Run) -> None:
    assert gaps(image_run.view, "unsafe_agent_file") == [
        f"/logs/artifacts/shadow-link: {LINK}"]
    assert not (image_run.folder / "artifacts/logs/artifacts/shadow-link").exists()


def test_past_256_files_the_pass_stops_with_artifacts_truncated(image_run: Run) -> None:
    many = [p for p in image_run.listed if p.startswith("artifacts/srv/many/")]
    assert len(many) == capture.MAX_KEPT_FILES - 6 and many[0].endswith("/f001")
    (truncated,) = gaps(image_run.view, "artifacts_truncated")
    assert truncated.startswith("50 file(s) not kept"), truncated
    (seq,) = [e.seq for e in image_run.view.events if e.type == "gap.recorded"
              and e.data.code == "artifacts_truncated"]
    assert seq < verification(image_run.view).seq  # kept before the verifier ran


def test_harbors_artifact_entries_are_read_and_refused_as_harbor_reads_them(
        tmp_path: Path) -> None:
    def load(toml: str) -> Task:
        return make_task(tmp_path / f"t{len(list(tmp_path.iterdir()))}", test_sh="exit 0\n",
                         toml=toml)

    assert load("").artifacts == (Artifact(CONVENTION),)
    task = load('artifacts = ["out.txt", {source = "/logs/artifacts/", exclude = ["*.tmp"]}]\n')
    assert task.artifacts == (Artifact("out.txt"), Artifact("/logs/artifacts/", None,
                                                            ("*.tmp",)))
    assert task.ignored_fields == {}
    assert [a.kept for a in task.artifacts] == ["out.txt", "logs/artifacts"]
    covered = load('artifacts = ["/app", "/app/out.txt"]\n')  # Harbor skips it silently
    assert [a.source for a in covered.artifacts] == [CONVENTION, "/app"]
    assert covered.ignored_fields == {}
    for bad in ('artifacts = ["/app/../etc"]\n', 'artifacts = [{source = "/a", '
                'destination = "/abs"}]\n', 'artifacts = [{source = "/a", destination = '
                '"x/../../y"}]\n', 'artifacts = [{source = "/a", destination = '
                '"manifest.json"}]\n', 'artifacts = [{destination = "x"}]\n',
                'artifacts = "/app"\n', 'artifacts = [{source = "/a", exclude = "*"}]\n'):
        with pytest.raises(TaskInvalid):
            load(bad)


@pytest.mark.parametrize(("path", "patterns", "out"), [
    ("debug.log", ["*.log"], True), ("sub/deep.log", ["*.log"], True),
    ("cache", ["cache"], True), ("sub/cache", ["cache"], True),
    ("sub/s.txt", ["sub/*.log"], False), ("sub/x.log", ["sub/*.log"], True),
    ("a/sub/x.log", ["sub/*.log"], True), ("cached", ["cache"], False),
    ("x.txt", ["./x.txt"], True), ("sub/x.txt", ["./x.txt"], False),
])
def test_excludes_match_as_gnu_tar_matches_them(path: str, patterns: list[str], out: bool
                                                ) -> None:
    assert excluded(path, patterns) is out


def test_a_verifier_that_cannot_run_still_lists_the_task_artifacts(tmp_path: Path) -> None:
    """The library runner on a task without `tests/test.sh`: `verification.failed`
    {reason: error} lists what the artifact pass kept (schema 3)."""
    task = make_task(tmp_path / "task", toml='artifacts = ["/app/out.txt"]\n',
                     solve_sh="#!/bin/sh\necho kept > /app/out.txt\n")
    assert task.tests is None

    async def run() -> Any:
        async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
            options = RunOptions(agent="oracle",
                                 overrides={"sandbox_logs_dir": str(tmp_path / "kept")})
            return (await SessionRunner(ledger, task, options).run_session()).view

    view = anyio.run(run)
    event = verification(view)
    assert (event.type, event.data.reason, event.schema_) == ("verification.failed", "error", 3)
    assert [f.path for f in event.data.files] == ["agent/oracle.txt", "artifacts/app/out.txt"]
    kept = tmp_path / "kept" / view.session_id / "artifacts/app/out.txt"
    assert kept.read_text() == "kept\n"
