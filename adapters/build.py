"""Dockerfile builds (docs/SPEC.md §12), as the build user of `adapters/builder.py`.

The build reads a copy of `environment/` that the build user owns, in a private folder with
its own TMPDIR; the `FROM` images the operator's storage holds are copied into the build
storage first; builds into one storage take turns. Past its timeout a build's process group
is killed and its working containers removed. The built image is saved by the build user,
moved out of its reach, and read into the cache as an archive.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.builder import WHAT, Builder, build_user, sweep
from trialledger.adapters.environment import (
    Cache,
    Environment,
    EnvironmentUnavailable,
    Source,
    _tool,
    context_digest,
    copy_tree,
    prepare_archive,
)


@dataclass(frozen=True)
class Workspace:
    """One build's folders: `outer` is ours; in it the context and `inner` (TMPDIR, the
    saved image) are the build user's."""

    outer: Path

    @property
    def inner(self) -> Path:
        return self.outer / "build"

    @property
    def context(self) -> Path:
        return self.outer / "context"

    @property
    def tmp(self) -> Path:
        return self.inner / "tmp"


def prepare_dockerfile(source: Source, engine: str, cache: Cache, owner: int | None
                       ) -> Environment:
    """Build `environment/Dockerfile` as the build user once per context digest, then read
    the image from the build storage into the cache."""
    context = source.path
    if context.is_symlink() or not context.is_dir():
        raise EnvironmentUnavailable(f"{WHAT}: environment/ must be a folder, not a link")
    for tool in ("podman", "buildah"):
        if shutil.which(tool) is None:
            raise EnvironmentUnavailable(f"{WHAT}: {tool} is not installed "
                                         f"(apt-get install {tool})")
    builder = build_user()
    tag = f"localhost/trialledger-build:{context_digest(context)[:32]}"
    dockerfile = (context / "Dockerfile").read_text(encoding="utf-8", errors="replace")
    with _workspace(builder) as work:
        with _locked(builder.lock):
            if not _has(builder, work, tag):
                _stage_context(builder, work, context)
                _copy_base_images(builder, work, engine, base_images(dockerfile))
                _build(builder, work, tag, source.build_timeout_s)
            digest = _image_id(builder, work, tag)
            if (found := cache.lookup(digest)) is not None:
                return found
            archive = _save(builder, work, tag)
        return prepare_archive(archive, "Dockerfile", cache, owner, digest=digest)


@contextlib.contextmanager
def _workspace(builder: Builder) -> Iterator[Workspace]:
    """A fresh private folder with the build user's TMPDIR; removed afterwards."""
    builder.scratch.mkdir(parents=True, exist_ok=True)
    work = Workspace(Path(tempfile.mkdtemp(prefix="trialledger-build-", dir=builder.scratch)))
    try:
        work.outer.chmod(0o711)
        work.inner.mkdir(mode=0o700)
        work.tmp.mkdir(mode=0o700)
        _give(builder, work.inner)
        yield work
    finally:
        shutil.rmtree(work.outer, ignore_errors=True)


def _stage_context(builder: Builder, work: Workspace, context: Path) -> None:
    """A copy of the context, made in our folder, then given to the build user."""
    copy_tree(context, work.context)
    _give(builder, work.context)


def _give(builder: Builder, root: Path) -> None:
    """Give a tree to the build user (nothing to do when the runner builds itself)."""
    if builder.storage is None:
        return
    os.lchown(root, builder.uid, builder.gid)
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(folder, name), builder.uid, builder.gid)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _engine(builder: Builder, work: Workspace, argv: Sequence[str]) -> str:
    """A podman or buildah command as the build user, in its storage."""
    return _tool(argv, WHAT, as_user=builder.as_user, env=builder.env(work.tmp))


def _has(builder: Builder, work: Workspace, tag: str) -> bool:
    return subprocess.run([*builder.as_user, "podman", "image", "exists", tag],
                          env=builder.env(work.tmp), capture_output=True, check=False,
                          stdin=subprocess.DEVNULL).returncode == 0


def _image_id(builder: Builder | None, work: Workspace, ref: str, engine: str = "podman"
              ) -> str:
    """An image's id in the build storage (or, with no builder, the operator's)."""
    argv = [engine, "image", "inspect", "--format", "{{.Id}}", ref]
    ident = (_engine(builder, work, argv) if builder else _tool(argv, WHAT)).strip()
    return ident if ident.startswith("sha256:") else f"sha256:{ident}"


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's `FROM` lines name (not `scratch`, not its own stages, not
    one built from an `ARG`)."""
    stages: set[str] = set()
    found: list[str] = []
    for line in dockerfile.splitlines():
        words = [w for w in line.split() if not w.startswith("--")]
        if len(words) < 2 or words[0].upper() != "FROM":
            continue
        image = words[1]
        if image.lower() not in stages and image != "scratch" and "$" not in image \
                and image not in found:
            found.append(image)
        if len(words) >= 4 and words[2].upper() == "AS":
            stages.add(words[3].lower())
    return found


def _copy_base_images(builder: Builder, work: Workspace, engine: str, named: list[str]
                      ) -> None:
    """Copy the base images the operator's storage holds into the build storage (saved by
    us with our environment, loaded by the build user), unless it has them already."""
    if builder.storage is None:
        return  # the runner builds in its own storage
    for image in named:
        try:
            theirs = _image_id(None, work, image, engine)
        except EnvironmentUnavailable:
            continue  # not ours to give; the build pulls it or says it is missing
        with contextlib.suppress(EnvironmentUnavailable):
            if _image_id(builder, work, image) == theirs:
                continue
        archive = work.outer / "base.tar"
        try:
            _tool([engine, "save", "-o", str(archive), image], f"{WHAT}: base image {image}")
            os.chown(archive, builder.uid, builder.gid)
            _engine(builder, work, ["podman", "load", "-q", "-i", str(archive)])
        finally:
            archive.unlink(missing_ok=True)


def _containers(builder: Builder, work: Workspace) -> set[str]:
    return set(_engine(builder, work, ["buildah", "containers", "-q"]).split())


def _build(builder: Builder, work: Workspace, tag: str, timeout: float) -> None:
    """`podman build --isolation chroot` in a session of its own; past `timeout` its group
    is killed, and the working containers it left are removed."""
    before = _containers(builder, work)
    argv = [*builder.as_user, "podman", "build", "--isolation", "chroot", "-t", tag,
            "-f", str(work.context / "Dockerfile"), str(work.context)]
    with open(work.outer / "build.log", "w+b") as log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   env=builder.env(work.tmp), start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise EnvironmentUnavailable(f"{WHAT}: podman ran past {timeout:g} s") from None
        finally:
            _remove_new_containers(builder, work, before)
            sweep(builder)
        if code != 0:
            log.seek(0)
            lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines()
                     if ln.strip()]
            said = lines[-1] if lines else f"exit {code}"
            raise EnvironmentUnavailable(f"{WHAT}: {said[-300:]}")


def _remove_new_containers(builder: Builder, work: Workspace, before: set[str]) -> None:
    """`buildah rm` the working containers that appeared since `before`."""
    with contextlib.suppress(EnvironmentUnavailable):
        for container in sorted(_containers(builder, work) - before):
            _engine(builder, work, ["buildah", "rm", container])


def _save(builder: Builder, work: Workspace, tag: str) -> Path:
    """`podman save` as the build user, moved out of its reach (a plain file, or refused)."""
    saved = work.inner / "image.tar"
    _engine(builder, work, ["podman", "save", "--format", "oci-archive", "-o", str(saved), tag])
    archive = work.outer / "image.tar"
    os.rename(saved, archive)
    info = os.lstat(archive)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise EnvironmentUnavailable(f"{WHAT}: the saved image is not a plain file")
    return archive
