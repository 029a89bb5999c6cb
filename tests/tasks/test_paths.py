"""Every path a task names stays inside its folder, links resolved first (SPEC §12): a
symbolic link out of the task folder never packs or mounts a host folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.runs import in_process, make_task
from trialledger.adapters.images.environment import Cache, EnvironmentUnavailable, within
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.tasks.task import Task, TaskInvalid

CANARY = "canary-5d1c-host-folder"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host folder outside every task: what a link would pack, mount or copy."""
    folder = tmp_path / "host"
    (folder / "etc").mkdir(parents=True)
    (folder / "etc" / "canary").write_text(CANARY)
    (folder / "test.sh").write_text(f"echo {CANARY}\nexit 0\n")
    (folder / "Dockerfile").write_text(f"FROM scratch\nCOPY etc /etc\n# {CANARY}\n")
    (folder / "image.tar").write_text(CANARY)
    (folder / "prompt.md").write_text(CANARY)
    return folder


def _plant(task: Path, host: Path, case: str) -> None:
    """Point one path the task names at the host folder, itself or on the way."""
    def link(name: str, to: Path) -> None:
        path = task / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        path.symlink_to(to)

    toml = (task / "task.toml").read_text() if (task / "task.toml").exists() else ""
    if case == "workspace":
        link("workspace", host)
    elif case == "tests":
        link("tests", host)
    elif case == "test.sh":
        link("tests/test.sh", host / "test.sh")
    elif case == "instruction":
        link("instruction.md", host / "prompt.md")
    elif case == "environment":
        link("environment", host)
    elif case == "image_archive":  # through a link in a parent folder
        link("archives", host)
        (task / "task.toml").write_text(toml + '[environment]\nimage_archive = '
                                               '"archives/image.tar"\n')
    elif case == "rootfs":
        link("rootfs", host)
        (task / "task.toml").write_text(toml + '[environment]\nrootfs = "rootfs"\n')
    elif case == "rootfs-relative":  # a relative link that climbs out
        link("rootfs", Path("..") / host.name)
        (task / "task.toml").write_text(toml + '[environment]\nrootfs = "rootfs"\n')
    elif case == "rootfs-chain":  # a link inside that leads to a link out
        link("outward", host)
        link("rootfs", Path("outward") / "etc")
        (task / "task.toml").write_text(toml + '[environment]\nrootfs = "rootfs"\n')


CASES = ["workspace", "tests", "test.sh", "instruction", "environment", "image_archive",
         "rootfs", "rootfs-relative", "rootfs-chain"]


@pytest.mark.parametrize("case", CASES)
def test_a_path_that_leads_out_of_the_task_folder_is_refused_in_one_line(
        tmp_path: Path, host: Path, case: str) -> None:
    task = tmp_path / "task"
    make_task(task, test_sh="exit 0\n", workspace={"a.txt": "a"})
    _plant(task, host, case)
    db, cache = tmp_path / "store.db", tmp_path / "cache"
    done = in_process("run", str(task), "--db", str(db), "--model-base-url",
                      "http://127.0.0.1:9", "--model", "m", "--cache-dir", str(cache))
    # Refused before anything was prepared or seeded: nothing of the host in a cache entry
    # (an image or a packed rootfs), no store.
    assert not any(CANARY in p.read_text(errors="replace")
                   for p in cache.rglob("*") if p.is_file()), "the host folder was packed"
    assert not db.exists()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "must be a path inside the task folder" in done.stderr, done.stderr
    assert CANARY not in done.stderr + done.stdout
    with pytest.raises(TaskInvalid):
        Task.load(task)


def test_links_that_stay_inside_the_task_folder_are_fine(tmp_path: Path) -> None:
    task = tmp_path / "task"
    make_task(task, test_sh="exit 0\n")
    (task / "src").mkdir()
    (task / "src" / "f.txt").write_text("inside")
    (task / "workspace").symlink_to("src")
    (task / "rootfs-folder").mkdir()
    (task / "rootfs").symlink_to("rootfs-folder")
    (task / "task.toml").write_text('[environment]\nrootfs = "rootfs"\n')
    loaded = Task.load(task)
    assert loaded.workspace is not None and (loaded.workspace / "f.txt").read_text() == "inside"
    assert loaded.source is not None and loaded.source.kind == "rootfs"


def test_within_resolves_every_link_on_the_way(tmp_path: Path) -> None:
    folder = tmp_path / "task"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "up").symlink_to("../..")
    (folder / "dangling").symlink_to("/nonexistent-host-path")
    assert within(folder, "a") == (folder / "a").resolve()
    assert within(folder, "a/up/outside") is None
    assert within(folder, "a/up/task/a") == (folder / "a").resolve()  # out and back in
    assert within(folder, "dangling") is None
    assert within(folder, "/etc") is None and within(folder, "../task/a") is not None
    assert within(folder, "..") is None


def test_a_link_planted_after_loading_is_refused_when_the_environment_is_prepared(
        tmp_path: Path, host: Path) -> None:
    task = tmp_path / "task"
    (task / "rootfs" / "etc").mkdir(parents=True)
    loaded = make_task(task, test_sh="exit 0\n", toml='[environment]\nrootfs = "rootfs"\n')
    shutil.rmtree(task / "rootfs")
    (task / "rootfs").symlink_to(host)  # swapped between loading and preparing
    cache = Cache(tmp_path / "cache")
    with pytest.raises(EnvironmentUnavailable, match="leads out of the task folder"):
        prepare(loaded.source, cache, owner=None)
    assert not any(CANARY in p.read_text(errors="replace")
                   for p in cache.folder.rglob("*") if p.is_file())
