"""A `docker_image` task's image (docs/SPEC.md §15): pulled with `--pull`, else built from
its environment/Dockerfile when missing (or always with `--force-build`), else refused;
a prebuilt image gets the task's environment/ folder on its workdir; a job prepares its
tasks' environments concurrently and starts the ready ones' trials meanwhile. Real podman
storage (tests/images.py), real builds as the build user, real sessions under bwrap."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests import images
from tests.environments.test_environments import launched, owner, tool_output
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from tests.runs import make_task, run_task
from trialledger import cli
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.images import builder as builders
from trialledger.adapters.images.environment import Cache, EnvironmentUnavailable
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.tasks.task import Task

MISSING = "localhost/tl-never-stored:1"
ONLY_THE_DOCKERFILE = "written-by-the-dockerfile-7c1e"


def nonce() -> str:
    """Makes a Dockerfile's context new, so the build storage has no tag for it yet."""
    return f"{os.getpid()}-{time.time_ns()}"


def image_task(folder: Path, ref: str, *, dockerfile: str | None = None,
               test_sh: str = "exit 0\n", **kwargs: Any) -> Task:
    """A task naming `ref` as its docker_image, with `dockerfile` as environment/Dockerfile."""
    if dockerfile is not None:
        (folder / "environment").mkdir(parents=True)
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
    return make_task(folder, test_sh=test_sh, toml=f'[environment]\ndocker_image = "{ref}"\n',
                     **kwargs)


def writing_dockerfile(*lines: str) -> str:
    """FROM the busybox test image, as root, writing the file only a build writes."""
    base = images.podman_image(images.BUSYBOX_REF)
    return "\n".join([f"FROM {base}", "USER root",
                      f"RUN echo {ONLY_THE_DOCKERFILE} > /built.txt", *lines, ""])


def stored(ref: str, *, as_builder: bool = False) -> bool:
    """Whether the tests' storage (or the build user's) holds `ref`."""
    prefix, env = [], None
    if as_builder:
        builder = builders.build_user()
        prefix, env = builder.as_user, builder.env(Path("/tmp"))
    return subprocess.run([*prefix, "podman", "image", "exists", ref], env=env,
                          capture_output=True, check=False).returncode == 0


@pytest.mark.anyio
async def test_a_missing_image_is_built_from_its_dockerfile_and_runs(tmp_path: Path) -> None:
    task = image_task(tmp_path / "task", MISSING,
                      dockerfile=writing_dockerfile(f"RUN echo {nonce()} > /nonce"),
                      test_sh=f"grep -q {ONLY_THE_DOCKERFILE} /built.txt\n")
    assert not stored(MISSING)
    env = prepare(task.source, Cache(tmp_path / "cache"), owner=owner())
    assert env.ref == f"Dockerfile (for {MISSING})" and env.upload is None
    ran = await run_task(str(tmp_path / "t.db"), task, [shell("cat /built.txt"), message()],
                         environment=env)
    assert ONLY_THE_DOCKERFILE in tool_output(ran)
    assert ran.view.rewards == {"reward": 1.0}
    assert launched(ran).environment == {"kind": "image", "ref": f"Dockerfile (for {MISSING})",
                                         "digest": env.digest}
    # tagged like any Dockerfile build, never with the docker_image's name
    assert not stored(MISSING) and not stored(MISSING, as_builder=True)


def test_force_build_builds_from_the_dockerfile_when_the_image_is_present(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task = image_task(tmp_path / "task", images.BUSYBOX_REF, dockerfile=writing_dockerfile(),
                      test_sh=f"grep -q {ONLY_THE_DOCKERFILE} /built.txt\n")
    cache = Cache(tmp_path / "cache")
    present = prepare(task.source, cache, owner=owner())
    assert present.ref == images.BUSYBOX_REF and present.root is not None
    assert not (present.root / "built.txt").exists()  # the image as stored, not built
    assert present.upload is None  # a folder with a Dockerfile is a build spec, not uploaded
    db = tmp_path / "store.db"
    code = cli.main(["run", str(task.folder), "--agent", "nop", "--force-build", "--db",
                     str(db), "--cache-dir", str(cache.folder)])
    assert code == 0, capsys.readouterr()  # the verifier found the file only a build writes
    with sqlite3.connect(db) as conn:
        (ref,) = conn.execute("SELECT environment_ref FROM sessions").fetchone()
    assert ref == f"Dockerfile (for {images.BUSYBOX_REF})"


def run_refused(tmp_path: Path, task: Task, capsys: pytest.CaptureFixture[str], *flags: str
                ) -> str:
    """`run` refused before anything is seeded: exit 2, one line, no traceback."""
    db = tmp_path / "store.db"
    code = cli.main(["run", str(task.folder), "--agent", "nop", "--db", str(db),
                     "--cache-dir", str(tmp_path / "cache"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not db.exists()
    return err


def test_a_missing_image_without_a_dockerfile_is_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_refused(tmp_path, image_task(tmp_path / "task", MISSING), capsys)
    assert f"docker_image {MISSING}: not in podman's local storage" in err, err


@pytest.mark.parametrize("dockerfile", [False, True])
def test_pull_is_tried_and_its_failure_is_one_line_naming_the_image(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], dockerfile: bool) -> None:
    """No registry is reachable here: the pull is tried (even with a Dockerfile that could
    build the image) and fails as one line."""
    ref = "127.0.0.1:9/trialledger/no-registry:1"
    task = image_task(tmp_path / "task", ref,
                      dockerfile=writing_dockerfile() if dockerfile else None)
    err = run_refused(tmp_path, task, capsys, "--pull")
    assert f"docker_image {ref}: pull failed: " in err, err


@pytest.mark.anyio
async def test_a_prebuilt_images_environment_folder_lands_on_its_workdir(
        tmp_path: Path, kept: list[LocalSandbox]) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("host-secret-of-the-runner")
    task = image_task(tmp_path / "task", images.podman_image(images.BUSYBOX_REF),
                      workspace={"given.txt": "from the workspace"})
    uploaded = task.folder / "environment"
    (uploaded / "sub").mkdir(parents=True)
    (uploaded / "data.txt").write_text("from the environment folder\n")
    (uploaded / "sub" / "nested.txt").write_text("nested in the environment folder\n")
    (uploaded / "leak").symlink_to(secret)  # a link stays a link: nothing of the host
    (uploaded / "near").symlink_to("data.txt")
    env = prepare(task.source, Cache(tmp_path / "cache"), owner=owner())
    assert env.upload == uploaded and env.ref == images.BUSYBOX_REF
    # (`cat leak`'s refusal on stdout: Codex's output merges the two streams in whatever
    # order they arrive, and a refusal first once took the place of `pwd`'s line)
    probe = ("pwd; cat data.txt sub/nested.txt near given.txt; readlink leak; cat leak 2>&1; "
             "echo more >> data.txt && echo APPENDED")
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(probe), message()],
                         environment=env)
    out = tool_output(ran)
    assert out.splitlines()[0] == "/work", out  # the image's WorkingDir
    for said in ("from the environment folder", "nested in the environment folder",
                 "from the workspace", str(secret), "APPENDED"):
        assert said in out, out
    assert "host-secret-of-the-runner" not in out, out
    (sandbox,) = kept
    work = sandbox.root / "upper" / "work"
    assert os.readlink(work / "leak") == str(secret)
    if sandbox.user.switches:  # owned by the sandbox user, as the workspace is
        assert {os.lstat(work / name).st_uid for name in ("data.txt", "sub", "leak",
                                                          "given.txt")} == {sandbox.user.uid}
    assert (uploaded / "data.txt").read_text() == "from the environment folder\n"


def test_an_environment_folder_leading_out_of_the_task_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "host.txt").write_text("host")
    task = image_task(tmp_path / "task", images.podman_image(images.BUSYBOX_REF))
    (task.folder / "environment").symlink_to(outside)
    with pytest.raises(EnvironmentUnavailable, match="leads out of the task folder"):
        prepare(task.source, Cache(tmp_path / "cache"), owner=owner())


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_a_jobs_ready_task_runs_while_another_task_still_builds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    slow = "localhost/tl-slow-to-build:1"
    image_task(data / "a-slow", slow, dockerfile=writing_dockerfile(
        f"RUN echo {nonce()} > /nonce && sleep 20"), solve_sh="#!/bin/sh\necho solved\n",
        test_sh=f"grep -q {ONLY_THE_DOCKERFILE} /built.txt\n")
    make_task(data / "b-ready", test_sh="exit 0\n", solve_sh="#!/bin/sh\necho solved\n")
    db = tmp_path / "jobs.db"
    started = time.monotonic()
    code = cli.main(["job", "run", "images", str(data), "--agent", "oracle", "-n", "2",
                     "--db", str(db), "--cache-dir", str(tmp_path / "cache")])
    assert code == 0, capsys.readouterr()
    assert time.monotonic() - started >= 20  # the slow build did take its 20 s
    with sqlite3.connect(db) as conn:
        sessions = {task: (_at(created), _at(closed), ref) for task, created, closed, ref in
                    conn.execute("SELECT task, created_at, closed_at, environment_ref "
                                 "FROM sessions")}
    assert sessions["a-slow"][2] == f"Dockerfile (for {slow})"
    # The ready task's trial ran to its end before the slow task's environment was ready
    # (its session is seeded only then).
    assert sessions["b-ready"][1] < sessions["a-slow"][0], sessions
    assert (sessions["a-slow"][0] - sessions["b-ready"][0]).total_seconds() > 10, sessions


def test_a_dockerfiles_missing_from_image_is_refused_naming_it_without_pull(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A `FROM` image in neither the build storage nor ours is never pulled unasked: the
    task is refused before any build, one line naming the image (with `--pull` the engine
    would pull it: no registry is reachable here to show it)."""
    missing = f"localhost/tl-from-nowhere-{nonce()}:1"
    base = images.podman_image(images.BUSYBOX_REF)
    folder = tmp_path / "task"
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text(
        f"ARG WHERE=tl-from-nowhere\nFROM {base} AS first\nFROM {missing}\n"
        f"COPY --from=first /marker /marker\n")
    task = make_task(folder, test_sh="exit 0\n")
    err = run_refused(tmp_path, task, capsys)
    assert f"FROM image {missing} is in neither the build storage nor podman's" in err, err
    assert "--pull pulls it" in err, err
    assert not stored(missing, as_builder=True)
