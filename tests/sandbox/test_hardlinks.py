"""Hard links in what the agent controls (SPEC §11): a link to a file only root may read
gives an imported job nothing, and many names of one file cost the archive one copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.test_harbor import CLEAN, trial
from tests.runs import in_process, make_task, run_task
from trialledger.adapters.demo.endpoint import message, shell

CANARY = "canary-0b7e-root-only"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a root runner reads as root")


@ROOT_ONLY
def test_import_harbor_reads_a_hard_link_to_a_root_only_file_as_a_gap(tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text(f"{CANARY}\n" + '{"type":"item.completed","item":{"id":"i","type":'
                      f'"agent_message","text":"{CANARY}"}}}}\n')
    secret.chmod(0o600)
    job = tmp_path / "jobs" / "j"
    job.mkdir(parents=True)
    session = trial(job, "leak__Aa11Bb2", exception=None, rewards={"reward": 1.0},
                    codex=CLEAN)
    agent = job / "leak__Aa11Bb2" / "agent"
    (agent / "codex.txt").unlink()
    os.link(secret, agent / "codex.txt")  # the harness's own file, as the agent left it
    day = agent / "sessions" / "2026" / "10" / "20"
    day.mkdir(parents=True)
    os.link(secret, day / "rollout-2026-10-20T14-04-14-x.jsonl")
    db = tmp_path / "t.db"
    imported = in_process("import-harbor", "--db", str(db), str(job), "--json")
    assert imported.returncode in (0, 1), imported.stderr  # imported: no crash, no refusal
    exported = in_process("export", "--db", str(db), "--session", session)
    assert exported.returncode == 0, exported.stderr
    assert CANARY not in imported.stdout + exported.stdout
    assert CANARY.encode() not in db.read_bytes()
    gaps = [line for line in exported.stdout.splitlines() if "unsafe_agent_file" in line]
    assert any("codex.txt" in line and "Permission denied" in line for line in gaps), gaps
    assert any("rollout-" in line for line in gaps), gaps


def _inodes(folder: Path) -> tuple[int, int, int]:
    """Names, distinct files and their bytes on disk under `folder` (the archive: not the
    verifier's files kept beside it, in `verifier/`)."""
    names, sizes = 0, {}
    for path in folder.rglob("*"):
        if "verifier" in path.relative_to(folder).parts[1:2]:
            continue
        if path.is_file() and not path.is_symlink():
            info = path.stat()
            names += 1
            sizes[(info.st_dev, info.st_ino)] = info.st_blocks * 512
    return names, len(sizes), sum(sizes.values())


@pytest.mark.anyio
async def test_a_rollout_hard_linked_twenty_times_is_archived_once(tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    line = '{"type":"filler","payload":"' + "x" * 1000 + '"}'
    attack = ("f=$(find $CODEX_HOME/sessions -name 'rollout-*.jsonl' | head -1); "
              "d=$(dirname $f); "
              f"yes '{line}' | head -n 2000 > $d/rollout-big.jsonl; "
              "for i in $(seq 1 20); do ln $d/rollout-big.jsonl $d/rollout-big-$i.jsonl; done; "
              "ls $d | wc -l | sed 's/^/NAMES /'")
    archive = tmp_path / "archive"
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(attack), message()],
                         settings={"sandbox_logs_dir": str(archive)})
    said = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert "NAMES 22" in said, said  # Codex's own rollout, the file and its 20 other names
    copied: Any = next(e for e in ran.view.events if e.type == "archive.copied").data
    names, files, on_disk = _inodes(archive)
    big = 2000 * (len(line) + 1)
    assert names == 22, names  # every name is kept ...
    assert files == 2 and copied.files == 2, (files, copied)  # ... each inode copied once
    assert big <= copied.bytes < 2 * big and on_disk < 2 * big + 2**20, (copied, on_disk)
