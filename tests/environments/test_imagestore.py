"""The session image store (SPEC §16): a built image is copied in layer by layer, each layer
once by its digest, into a root-owned 0700 store no build can write; range-mode sessions
use its layer folders in place, idmapped onto their slot, whiteouts and all. A hostile
`RUN` step that leaves its chroot and writes at another image's layer folders changes
nothing a session sees.

Needs root after `trialledger setup` (the build user, range mode), as CI has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import images
from tests.environments.test_builds import LEAVE_CHROOT_C
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from tests.runs import make_task, run_task
from trialledger import cli
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.images.environment import (
    Cache,
    Environment,
    EnvironmentUnavailable,
    Source,
)
from trialledger.adapters.images.imagestore import (
    ImageStore,
    hold_view,
    images_held,
    plain_cache,
    prepared_and_held,
)
from trialledger.adapters.images.prepare import prepare

pytestmark = pytest.mark.anyio

WRITER_C = LEAVE_CHROOT_C + r"""
/* The escape, then a write at each folder named (a file of its own, and over /app/name
   there). argv: the report (in the image), a host-only path, the folders. */
int main(int argc, char **argv) {
    if (argc < 3) return 2;
    FILE *report = fopen(argv[1], "w");
    if (!report) return 1;
    fprintf(report, "escaped: %s\n", leave_chroot(argv[2]));
    for (int i = 3; i < argc; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/hostile", argv[i]);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
        fprintf(report, "create %s: %s\n", argv[i], fd >= 0 ? "WRITTEN" : strerror(errno));
        snprintf(path, sizeof path, "%s/app/name", argv[i]);
        fd = open(path, O_WRONLY | O_TRUNC);
        fprintf(report, "overwrite %s: %s\n", argv[i],
                fd >= 0 && write(fd, "hostile\n", 8) == 8 ? "WRITTEN" : strerror(errno));
    }
    fclose(report);
    return 0;
}
"""


def _cache(tmp_path: Path) -> Cache:
    return plain_cache(tmp_path / "cache")  # range mode: the image store


def _built(folder: Path, dockerfile: str, tmp_path: Path) -> Environment:
    (folder / "environment").mkdir(parents=True, exist_ok=True)
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    return prepare(Source("dockerfile", "Dockerfile", folder), _cache(tmp_path), owner=None)


def _snapshot(folders: tuple[Path, ...]) -> str:
    """Every path, owner, mode and regular file's bytes under `folders` (links as links)."""
    digest = hashlib.sha256()
    for top in folders:
        for folder, dirs, files in sorted(os.walk(top)):
            for name in sorted([*dirs, *files]):
                path = os.path.join(folder, name)
                info = os.lstat(path)
                digest.update(f"{path}\0{info.st_uid}\0{info.st_mode}\0".encode())
                if stat.S_ISREG(info.st_mode):
                    with open(path, "rb") as handle:
                        digest.update(handle.read())
    return digest.hexdigest()


@contextlib.contextmanager
def _read(env: Environment) -> Iterator[Path]:
    """The image's root, its view held (mounted) while the test reads it."""
    assert env.root is not None
    hold = hold_view(env)
    try:
        yield env.root
    finally:
        if hold is not None:
            hold.release()


def _mount_points() -> set[str]:
    """This mount namespace's mount points (/proc/self/mountinfo's fifth field)."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return {line.split()[4].encode().decode("unicode_escape") for line in lines}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


async def test_images_on_one_base_share_its_layer_and_a_session_reads_them_in_place(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = images.podman_image(images.BUSYBOX_REF)
    nonce = os.urandom(6).hex()
    first = _built(tmp_path / "a", f"FROM {base}\nENV RUN={nonce}\nUSER root\n"
                   f"RUN mkdir -p /app && echo first > /app/name\n", tmp_path)
    second = _built(tmp_path / "b", f"FROM {base}\nENV RUN={nonce}\nUSER root\n"
                    f"RUN mkdir -p /app && echo second > /app/name && rm /bin/ls\n", tmp_path)
    store = ImageStore()
    for env in (first, second):
        assert env.plain and env.layers and env.root is not None
        assert all(layer.is_relative_to(store.storage) for layer in env.layers)
        with _read(env) as root:
            assert (root / "app" / "name").read_text() == (
                "first\n" if env is first else "second\n")
    # the base's layer is one folder serving both: a layer per digest, never a copy
    assert first.layers[-1] == second.layers[-1]
    assert first.layers[0] != second.layers[0]
    info = os.lstat(store.folder)
    assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o700
    # nothing of either image was unpacked into the cache; `cache ls` lists them in the store
    assert not list((tmp_path / "cache").glob("environments/*-plain"))
    listed = [json.loads(line) for line in _cli(capsys, "cache", "ls", "--json", "--cache-dir",
                                                str(tmp_path / "cache")).splitlines()]
    for env in (first, second):
        shown = next(e for e in listed if e["digest"] == env.digest)
        assert shown["kind"] == "image (store)" and shown["bytes"] > 0, shown

    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [
        shell("cat /app/name; ls /bin/ls 2>&1; echo made > /app/made; cat /app/made; id -u"),
        message()], environment=second)
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert "second" in out and "made" in out, out
    assert "No such file" in out, out  # the layer's whiteout hides the base's /bin/ls
    assert not any((layer / "app" / "made").exists() for layer in second.layers)


async def test_a_finished_session_leaves_no_mount_behind_and_a_killed_holders_view_is_swept(
        tmp_path: Path) -> None:
    """An image's view is mounted on the host while a session (or preparation) reads the
    image, and unmounted when the last one lets go: once a session ends, no mount of its
    own is left (neither its image's view nor anything in its session folder). A killed
    runner's hold goes with it; the next sweep unmounts what it held."""
    from trialledger.adapters.sandbox.leftovers import sweep_image_views

    base = images.podman_image(images.BUSYBOX_REF)
    nonce = os.urandom(6).hex()  # an image of this test's own: no other session holds it
    env = _built(tmp_path / "image", f"FROM {base}\nENV RUN={nonce}\nUSER root\n"
                 f"RUN mkdir -p /app && echo {nonce} > /app/name\n", tmp_path)
    assert env.root is not None and len(env.layers) > 1  # a view of its layers merged
    view = str(env.root)
    sessions = os.path.join(tempfile.gettempdir(), "trialledger-")

    def own(points: set[str]) -> set[str]:
        return {p for p in points if p == view or p.startswith(sessions)}

    assert view not in _mount_points(), "preparation left the image's view mounted"
    before = _mount_points()
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [shell("cat /app/name"), message()],
                         environment=env)
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert nonce in out, out  # the session did read the image
    assert own(_mount_points() - before) == set(), "the session left a mount behind"
    assert view not in _mount_points()

    holder = (f"import os, signal\nfrom pathlib import Path\n"
              f"from trialledger.adapters.images.imagestore import ImageStore\n"
              f"ImageStore().hold({env.digest!r}, [Path(p) for p in "
              f"{[str(layer) for layer in env.layers]!r}])\n"
              f"os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", holder], capture_output=True, text=True,
                            timeout=120, check=False)
    assert killed.returncode == -9, killed.stderr
    assert view in _mount_points()  # what a crashed runner's session leaves
    sweep_image_views()
    assert view not in _mount_points(), "the sweep left a killed holder's view mounted"


def test_a_hostile_run_step_cannot_write_into_another_images_layers(
        tmp_path: Path) -> None:
    base = images.podman_image(images.BUSYBOX_REF)
    nonce = os.urandom(6).hex()
    victim = _built(tmp_path / "victim", f"FROM {base}\nENV RUN={nonce}\nUSER root\n"
                    f"RUN mkdir -p /app && echo victim > /app/name\n", tmp_path)
    store = ImageStore()
    targets = [*victim.layers, store.folder, store.storage, store.folder / "meta",
               store.folder / "views" / (victim.digest or "").removeprefix("sha256:")]
    before = _snapshot(victim.layers)
    hostile = tmp_path / "hostile"
    context = hostile / "environment"
    context.mkdir(parents=True)
    (context / "writer.c").write_text(WRITER_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(context / "writer"),
                    str(context / "writer.c")], check=True, capture_output=True)
    arguments = ", ".join(f'"{t}"' for t in targets)
    made = _built(hostile, f"FROM {base}\nENV RUN={nonce}\nUSER root\nCOPY writer /writer\n"
                  f'RUN ["/writer", "/report", "{Path(__file__).resolve()}", {arguments}]\n',
                  tmp_path)
    with _read(made) as root:
        report = (root / "report").read_text()
    assert "escaped: yes" in report, report  # the step did reach the host's folders
    assert "WRITTEN" not in report, report
    assert report.count("Permission denied") >= 2 * len(targets), report
    assert _snapshot(victim.layers) == before
    with _read(victim) as root:
        assert (root / "app" / "name").read_text() == "victim\n"
    assert not any((layer / "hostile").exists() for layer in victim.layers)


def test_an_exported_layout_with_a_link_or_a_fifo_is_refused_before_root_reads_it(
        tmp_path: Path) -> None:
    """The build user writes the layout root copies in: a planted link (to a host file) or
    fifo in it is refused, never followed by root's skopeo."""
    from trialledger.adapters.images.environment import EnvironmentUnavailable
    from trialledger.adapters.images.imagestore import _seize

    for plant in ("link", "fifo", "hard link"):
        layout = tmp_path / plant.replace(" ", "-")
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        (layout / "index.json").write_text("{}")
        if plant == "link":
            (blobs / ("0" * 64)).symlink_to("/etc/shadow")
        elif plant == "fifo":
            os.mkfifo(blobs / ("0" * 64))
        else:
            os.link(layout / "index.json", blobs / ("0" * 64))
        with pytest.raises(EnvironmentUnavailable, match="neither a folder nor a plain file"):
            _seize(layout, "build")
    good = tmp_path / "good"
    (good / "blobs").mkdir(parents=True)
    (good / "blobs" / "b").write_text("x")
    _seize(good, "build")
    assert stat.S_IMODE(os.lstat(good).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(good / "blobs" / "b").st_mode) == 0o600


def test_idmapped_layers_are_tried_once_and_where_they_cannot_be_mounted_range_mode_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The probe lays an overlay on two idmapped folders of the store's file system, as a
    session does: here it can (range mode holds); an init that cannot mount them is named.
    Where the probe fails, an image task runs in single-id mode, said once — never a copy
    of the image per slot."""

    from tests.sandbox.test_range_mode import oracle_falling_back
    from trialledger.adapters.images import imagestore
    from trialledger.adapters.sandbox.identity import ensure_init
    from trialledger.adapters.sandbox.idrange import reserved_range
    from trialledger.adapters.sandbox.rangemode import range_problem

    ids = reserved_range()
    assert ids is not None and range_problem() is None
    assert imagestore.idmapped_layers_problem(ensure_init(), ids.start) is None
    failing = imagestore.idmapped_layers_problem(Path("/bin/false"), ids.start)
    assert failing is not None and "cannot be mounted here" in failing

    why = f"idmapped image layers cannot be mounted here ({tmp_path.name})"
    monkeypatch.setattr(imagestore, "idmapped_layers_problem", lambda init, start: why)
    code, launched, said = oracle_falling_back(tmp_path, caplog, why)
    assert launched.identity is not None and launched.identity["mode"] == "single"
    assert len(said) == 1 and "single-id mode" in said[0], said
    assert code == 0


def _imported(tmp_path: Path, nonce: str) -> Environment:
    """An image of one layer of its own (a file named after `nonce`), in the store."""
    (tmp_path / "layer").mkdir(parents=True)
    (tmp_path / "layer" / nonce).write_text(nonce)
    tarball = tmp_path / "layer.tar"
    subprocess.run(["tar", "-C", str(tmp_path / "layer"), "-cf", str(tarball), "."], check=True)
    ref = f"localhost/tl-prune:{nonce}"
    done = images._podman("import", str(tarball), ref)
    assert done.returncode == 0, done.stderr
    return prepare(Source("docker_image", ref, tmp_path), _cache(tmp_path), owner=None)


def test_an_image_pruned_between_its_preparation_and_its_hold_is_prepared_again(
        tmp_path: Path) -> None:
    """Another process's `cache prune` between a job's preparation of a task and its hold
    takes the image out of the store: the task is prepared again (the image copied in
    again), not failed, and the environment held is the one whose layers are there."""
    nonce = os.urandom(6).hex()
    first = _imported(tmp_path / "first", nonce)
    prepared: list[Environment] = []

    def prepare_then_lose_a_race() -> Environment:
        environment = prepare(Source("docker_image", f"localhost/tl-prune:{nonce}", tmp_path),
                              _cache(tmp_path), owner=None)
        if not prepared:  # the prune lands between this preparation and its hold
            assert ImageStore().prune([str(environment.digest)])[0]
        prepared.append(environment)
        return environment

    with contextlib.ExitStack() as holds:
        held = prepared_and_held(prepare_then_lose_a_race, holds)
        assert len(prepared) == 2 and held is prepared[1]
        assert held.digest == first.digest and all(layer.is_dir() for layer in held.layers)
        removed, kept, _ = ImageStore().prune([str(held.digest)])
        assert not removed and kept, "the image a run holds was pruned"


def test_cache_prune_removes_the_store_images_no_session_holds_and_frees_their_own_layers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = images.podman_image(images.BUSYBOX_REF)
    nonce = os.urandom(6).hex()
    built = [_built(tmp_path / name, f"FROM {base}\nUSER root\nRUN echo {nonce} > /{name}\n",
                    tmp_path) for name in ("held", "free")]
    single = _imported(tmp_path / "single", nonce)  # a view of its own layer: no mount
    assert len(single.layers) == 1 and all(len(env.layers) > 1 for env in built)
    store = ImageStore()
    digests = [str(env.digest) for env in (*built, single)]
    prune = ("cache", "prune", "--cache-dir", str(tmp_path / "cache"), *digests)
    # a job holds what it prepared: an image and its separate verifier's
    holding = images_held(dataclasses.replace(single, verifier=built[0]))
    holding.__enter__()
    try:
        said = _cli(capsys, *prune)
        assert "removed 1 image from the image store; kept 2 a session holds" in said, said
        assert "build storage" not in said  # digests named: the build storage is left be
        assert store.layer_folders(built[1].digest or "") is None
        assert not built[1].layers[0].exists(), "the removed image's own layer is still there"
        assert all(layer.is_dir() for layer in built[1].layers[1:]), "a shared layer went"
        for env in (built[0], single):
            assert store.layer_folders(env.digest or "") == list(env.layers)
            with _read(env) as root:  # a held image still reads whole
                assert any(root.iterdir())
    finally:
        holding.__exit__(None, None, None)
    with pytest.raises(EnvironmentUnavailable, match="no longer in the image store"), \
            images_held(built[1]):  # pruned between its preparation and its hold
        pass
    assert "removed 2 images from the image store\n" in _cli(capsys, *prune)
    assert not single.layers[0].exists() and not built[0].layers[0].exists()
    listed = _cli(capsys, "cache", "ls", "--json", "--cache-dir", str(tmp_path / "cache"))
    assert not any(digest in listed for digest in digests)
