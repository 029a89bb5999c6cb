"""Dockerfile builds (docs/SPEC.md §12), as the build user of `adapters/images/builder.py`.

A build is keyed as Docker's cache is: its context, the id of every `FROM` image in the
build storage (`adapters/images/dockerfile.py` reads them, `ARG`s and `--platform` resolved) and
its build arguments; the built image is tagged with that key, so a changed base image is
rebuilt and an unchanged one is not. The `FROM` images the operator's storage holds are
copied into the build storage first (one copy at a time, briefly locked); one missing from
both is pulled only with `--pull`, else the task is refused naming it. A build of one key
holds that key's lock only: different images build at once, and finding an image already
built takes no lock. The build reads a copy of `environment/` that the build user owns, in
a private folder with its own TMPDIR. Every engine command of a build runs in its box
(`adapters/images/buildbox.py`: its own cgroup, and for `podman build` its own network), which
ends whole with the build, taking its working containers along. The layers of the built
image the session image store lacks are exported by the build user, moved out of its
reach and copied into the store as root (`adapters/images/imagestore.py`); without that
store (single-id mode) the image is saved, moved out of reach alike, and unpacked into the
cache as an archive.

Over 500 lines: one build's path from its key to its image, whose locks and ownership
changes (operator, build user, root) read in order.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from trialledger.adapters.images import imageids
from trialledger.adapters.images.buildbox import (
    LOCK_NAME,
    BuildBox,
    contained,
    end_dead_builds,
)
from trialledger.adapters.images.builder import (
    LOCKS,
    WHAT,
    Builder,
    build_user,
    storage_driver,
)
from trialledger.adapters.images.dockerfile import (
    INLINE,
    BaseImage,
    ForEngine,
    HeredocUnsupported,
    base_images,
    for_engine,
)
from trialledger.adapters.images.environment import (
    Cache,
    Environment,
    EnvironmentUnavailable,
    Progress,
    Source,
    _tool,
    context_digest,
    copy_tree,
)
from trialledger.adapters.images.imagestore import ImageStore
from trialledger.adapters.images.unpack import prepare_archive
from trialledger.adapters.places import plain_file, read_small
from trialledger.adapters.sandbox.cgroup import BUILD_PREFIX
from trialledger.adapters.sandbox.folders import take_lock
from trialledger.adapters.sandbox.slirp import RESOLVER
from trialledger.core.settings import TASK_FILE_MAX_BYTES

TAG = "localhost/trialledger-build"
FROM_LOCK = "from-images.lock"  # copying FROM images into the build storage: one at a time
BUSY_LOCK = "storage.lock"  # held shared by every build, taken alone by `cache prune`
STEP = re.compile(rb"^(?:\[\d+/\d+\] )?STEP (\d+)/(\d+):", re.MULTILINE)  # podman's output
FOLLOW_S = 0.25  # how often a build's output is read for its step
CONFIG_MAX_BYTES = 4 * 1024 * 1024  # a built image's config read from the build storage


@dataclass(frozen=True)
class Workspace:
    """One build's folders: `outer` is ours; in it the context and `inner` (TMPDIR, the
    saved image) are the build user's."""

    outer: Path

    @property
    def inner(self) -> Path:
        return self.outer / "build"

    @property
    def build_id(self) -> str:
        """The build's id: what follows the prefix in its folder's name."""
        return self.outer.name.removeprefix(BUILD_PREFIX)

    @property
    def context(self) -> Path:
        return self.outer / "context"

    @property
    def tmp(self) -> Path:
        return self.inner / "tmp"

    @property
    def inline(self) -> Path:
        """The files a Dockerfile's `COPY` here-documents became (ours, then the build
        user's): the `INLINE` build context."""
        return self.outer / "inline"


def prepare_dockerfile(source: Source, engine: str, cache: Cache, owner: int | None, *,
                       pull: bool = False, progress: Progress | None = None,
                       build_args: Mapping[str, str] | None = None) -> Environment:
    """Build `environment/Dockerfile` (a compose service's: its `dockerfile` in its
    context, to its `target` stage) as the build user once per build key (context, `FROM`
    image ids, build arguments, which Dockerfile and stage), then read the image from the
    build storage into the cache. `progress` hears that the build waits for another build
    of its image, and which step it is at."""
    context = source.path
    if context.is_symlink() or not context.is_dir():
        raise EnvironmentUnavailable(f"{WHAT}: {source.context}/ must be a folder, not a link")
    for tool in ("podman", "buildah"):
        if shutil.which(tool) is None:
            raise EnvironmentUnavailable(f"{WHAT}: {tool} is not installed "
                                         f"(apt-get install {tool})")
    builder = build_user()
    args = dict(build_args or {})
    written = _dockerfile_text(context, source.dockerfile)
    try:
        given = for_engine(written)  # (here-documents: the engine's parser has none)
    except HeredocUnsupported as error:
        raise EnvironmentUnavailable(f"{WHAT}: {source.dockerfile}: {error}") from None
    bases = base_images(given.text, args)
    context_id = context_digest(context)
    recipe = _recipe(source)
    if (found := _built_already(builder, engine, context_id, bases, args, recipe, cache)
            ) is not None:
        return found
    _end_dead_builds_once(builder)
    with _workspace(builder) as work:
        with contained(builder, work.inner, work.tmp, source, build_id=work.build_id) as box:
            with _sweeping:  # one thread of the process sweeps, the others go on after
                if not _swept:
                    _swept.append(box.remove_dead_builds_containers())
            held = _copy_base_images(box, work, engine, [b.ref for b in bases])
            ids = [resolve_base(box, base, engine, pull=pull, held=held.get(base.ref))
                   for base in bases]
            key = build_key(context_id, bases, ids, args, recipe)
            remembered = cache.remembered(f"build-{key}")
            if remembered is not None and (found := cache.image(remembered)) is not None:
                return found
            tag = f"{TAG}:{key[:32]}"
            waiting = functools.partial(progress, "waiting", None) if progress else None
            built: str | None = None
            with _locked(builder.locks / f"{key}.lock", waiting):  # (this image's alone)
                if not box.succeeds(["podman", "image", "exists", tag]):  # built meanwhile?
                    _stage_context(builder, work, context)
                    dockerfile = work.context / source.dockerfile
                    if given.text != written:  # beside the context, never in it
                        dockerfile = _beside(builder, work, context, source.dockerfile,
                                             given)
                    built = _build(box, work, tag, source, dockerfile, args, progress)
            digest = built or _image_id(box, tag)
            cache.remember(f"build-{key}", digest)
            if (found := cache.image(digest)) is not None:
                return found
            if isinstance(cache.store, ImageStore):  # the layers it lacks, copied in below
                exported = cache.store.export_built(box, work.inner / "layout",
                                                    work.outer / "layout", tag, WHAT,
                                                    diffs=_diff_ids(builder, digest))
            else:
                archive = _save(box, work, tag)
        if isinstance(cache.store, ImageStore):
            return cache.store.take(exported, digest, kind="image", ref="Dockerfile",
                                    what=WHAT)
        return prepare_archive(archive, "Dockerfile", cache, owner, digest=digest)


@contextlib.contextmanager
def no_build_running() -> Iterator[bool]:
    """Builds kept from starting while this lasts (True), or False at once when one is
    under way: each build holds the build storage's lock shared from its folder's making
    to its image's copy into the session image store, so that `cache prune` removes no
    `FROM` image, built image or store layer a build is about to use."""
    fd = _lock_file(LOCKS / BUSY_LOCK)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def prune_build_storage() -> None:
    """(Under `no_build_running`) Remove every image of the build storage that no working
    container uses — the built images and the `FROM` images copied in: the next build of
    each builds or copies it again — first ending what killed builds left."""
    builder = build_user()
    end_dead_builds(builder)
    with _workspace(builder, building=False) as work:
        source = Source("dockerfile", "Dockerfile", work.outer)
        with contained(builder, work.inner, work.tmp, source, build_id=work.build_id) as box:
            box.remove_dead_builds_containers()
            box.run(["podman", "image", "prune", "--all", "--force"], "the build storage")


def build_key(context: str, bases: list[BaseImage], ids: list[str],
              build_args: Mapping[str, str], recipe: Mapping[str, str] | None = None) -> str:
    """A build's key, as Docker's cache has it: the context's digest, each `FROM` image
    (its name, the platform asked for, its id in the build storage), the build arguments,
    and `recipe` (`_recipe`: another Dockerfile than the context's, a target stage)."""
    named = [[b.ref, b.platform, i] for b, i in zip(bases, ids, strict=True)]
    whole = {"context": context, "from": named, "args": sorted(build_args.items()),
             **(recipe or {})}
    return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()


def _dockerfile_text(context: Path, relative: str) -> str:
    """The Dockerfile a build reads and podman is given (`relative` in `context`): a regular
    file reached through no link (a link, staged as one, could lead out of the build's
    folder), at most `TASK_FILE_MAX_BYTES` (EnvironmentUnavailable otherwise)."""
    path = plain_file(context, relative)
    data = read_small(path, TASK_FILE_MAX_BYTES) if path is not None else None
    if data is None:
        raise EnvironmentUnavailable(f"{WHAT}: {relative} in the build context must be a "
                                     f"file of at most {TASK_FILE_MAX_BYTES} bytes, reached "
                                     f"through no symbolic link")
    return data.decode("utf-8", errors="surrogateescape")  # (written back byte for byte)


def _beside(builder: Builder, work: Workspace, context: Path, relative: str,
            rewritten: ForEngine) -> Path:
    """The rewritten Dockerfile in the build's own folder, the build user's, with the
    Dockerfile's own ignore file (`relative.dockerignore`, when the context has one as a
    plain file) beside it, so that the engine reads the same one, and the files its
    `COPY` here-documents became in `work.inline` (the `INLINE` build context)."""
    given = work.outer / "Dockerfile"
    given.write_bytes(rewritten.text.encode("utf-8", errors="surrogateescape"))
    _give(builder, given)
    for path, content in rewritten.files.items():
        target = work.inline / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode("utf-8", errors="surrogateescape"))
        target.chmod(0o644)  # (BuildKit's mode for them)
    if rewritten.files:
        _give(builder, work.inline)
    own = plain_file(context, f"{relative}.dockerignore")
    if own is not None and (data := read_small(own, TASK_FILE_MAX_BYTES)) is not None:
        ignore = work.outer / "Dockerfile.dockerignore"
        ignore.write_bytes(data)
        _give(builder, ignore)
    return given


def _recipe(source: Source) -> dict[str, str]:
    """What a build's key adds for a compose service's `build.dockerfile` and `.target`
    (nothing for the context's own Dockerfile built whole: earlier keys stay valid)."""
    found = {"dockerfile": source.dockerfile} if source.dockerfile != "Dockerfile" else {}
    return found | ({"target": source.target} if source.target is not None else {})


class Held(NamedTuple):
    """An image the build storage holds: its id, and the os and architecture the engine
    records for it."""

    ident: str
    system: str
    arch: str


def _in_build_storage(box: BuildBox, ref: str) -> Held | None:
    """What the build storage holds under `ref` (None: nothing), in one inspect — or none,
    while the build storage is unchanged since it was last asked (adapters/images/imageids.py)."""
    def look() -> Held | None:
        argv = ["podman", "image", "inspect", "--format",
                "{{.Id}}|{{.Os}}|{{.Architecture}}", ref]
        try:
            ident, system, arch = [*box.run(argv).strip().split("|"), "", ""][:3]
        except EnvironmentUnavailable:
            return None
        return Held(ident if ident.startswith("sha256:") else f"sha256:{ident}", system, arch)

    return imageids.remembered(_build_tokens(box.builder), ref, look,
                               keep=lambda held: held is not None, load=_held)


def _build_tokens(builder: Builder) -> Path:
    """The build storage's write token (adapters/images/imageids.py)."""
    return imageids.token_file(builder.graphroot, storage_driver(os.uname().release))


def _held(answer: Any) -> Held:
    """A kept answer of `_in_build_storage` made again from its JSON."""
    ident, system, arch = answer
    return Held(str(ident), str(system), str(arch))


def _built_already(builder: Builder, engine: str, context: str, bases: list[BaseImage],
                   args: Mapping[str, str], recipe: Mapping[str, str], cache: Cache
                   ) -> Environment | None:
    """The environment a build made before, found from kept answers alone — no build box,
    no engine asked: each `FROM` image's id in the operator's storage is the one the build
    storage holds (neither written since they were asked), and the key they make names a
    built image the cache has. None: the whole way (copy, look-ups, build)."""
    ids = []
    for base in bases:
        theirs = imageids.peek(imageids.operator_token_file(engine), base.ref)
        held = imageids.peek(_build_tokens(builder), base.ref, _held)
        found = _for_platform(held, base)
        if found is None or not _holds(held, str(theirs)):
            return None
        ids.append(found)
    remembered = cache.remembered(f"build-{build_key(context, bases, ids, args, recipe)}")
    return cache.image(remembered) if remembered is not None else None


def _for_platform(held: Held | None, base: BaseImage) -> str | None:
    """The id of what the build storage holds for `base`, if it is for the platform `base`
    asks (os and architecture as the engine records them; any, when it asks none)."""
    if held is None:
        return None
    if base.platform is not None:
        wanted = base.platform.split("/")
        if wanted[0] != held.system or (len(wanted) > 1 and wanted[1] != held.arch):
            return None
    return held.ident


def resolve_base(box: BuildBox, base: BaseImage, engine: str, *, pull: bool,
                 held: Held | None = None) -> str:
    """The id of a `FROM` image in the build storage (for the platform it asks), from
    `held` (what `_copy_base_images` found there) or one inspect; one missing there is
    pulled with `pull`, else the task is refused naming it."""
    found = _for_platform(held or _in_build_storage(box, base.ref), base)
    if found is None and pull:
        platform = ["--platform", base.platform] if base.platform else []
        box.run(["podman", "pull", "-q", *platform, base.ref],
                f"{WHAT}: pulling FROM image {base.ref}")
        found = _for_platform(_in_build_storage(box, base.ref), base)
    if found is None:
        asked = f" for {base.platform}" if base.platform else ""
        raise EnvironmentUnavailable(
            f"{WHAT}: FROM image {base.ref}{asked} is in neither the build storage nor "
            f"{engine}'s local storage; --pull pulls it")
    return found


@contextlib.contextmanager
def _locked(lock: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """A lock of the build storage's: one build key's (held while that image builds: other
    keys build meanwhile), or the FROM copy's (held while a FROM image is copied in).
    `waiting` is told when another holds it (then it is waited for)."""
    fd = _lock_file(lock)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _lock_file(path: Path) -> int:
    """A lock file of root's folder of build locks, opened (made when missing)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


_swept: list[int] = []  # non-empty once this process removed what killed builds left
_sweeping = threading.Lock()  # a process's builds start at once (a job's -n): one sweeps


def _end_dead_builds_once(builder: Builder) -> None:
    """At a process's first build: end the cgroups and folders of builds whose run was
    killed (their containers go once this build's box exists)."""
    with _sweeping:
        if not _swept:
            end_dead_builds(builder)


@contextlib.contextmanager
def _workspace(builder: Builder, *, building: bool = True) -> Iterator[Workspace]:
    """A fresh private folder with the build user's TMPDIR, its lock held while the build
    lives (a sweep takes a folder whose lock is free for a killed run's); removed
    afterwards, the lock let go last. A build (`building`) holds the build storage's lock
    shared meanwhile (`no_build_running`; it waits only while a prune runs)."""
    busy = _lock_file(builder.locks / BUSY_LOCK) if building else None
    try:
        if busy is not None:
            fcntl.flock(busy, fcntl.LOCK_SH)
        builder.scratch.mkdir(parents=True, exist_ok=True)
        work = Workspace(Path(tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=builder.scratch)))
        lock = take_lock(work.outer, LOCK_NAME)
        try:
            work.outer.chmod(0o711)
            work.inner.mkdir(mode=0o700)
            work.tmp.mkdir(mode=0o700)
            _give(builder, work.inner)
            yield work
        finally:
            shutil.rmtree(work.outer, ignore_errors=True)
            os.close(lock)
    finally:
        if busy is not None:
            os.close(busy)


def _stage_context(builder: Builder, work: Workspace, context: Path) -> None:
    """A copy of the context, made in our folder, then given to the build user."""
    copy_tree(context, work.context)
    _give(builder, work.context)


def _give(builder: Builder, root: Path) -> None:
    """Give a tree to the build user."""
    os.lchown(root, builder.uid, builder.gid)
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(folder, name), builder.uid, builder.gid)


def _image_id(box: BuildBox, ref: str) -> str:
    """An image's id in the build storage."""
    ident = box.run(["podman", "image", "inspect", "--format", "{{.Id}}", ref]).strip()
    return ident if ident.startswith("sha256:") else f"sha256:{ident}"


def _copy_base_images(box: BuildBox, work: Workspace, engine: str, named: list[str]
                      ) -> dict[str, Held | None]:
    """Copy the base images the operator's storage holds into the build storage (saved by
    us with our environment, loaded by the build user), unless it has them already; what
    the build storage then holds under each name (one inspect each, unless copied). Only a
    copy takes a lock (one copy at a time, checked again under it): a build whose bases are
    in place waits on no one."""
    held: dict[str, Held | None] = {}
    for image in named:
        if image in held:
            continue
        held[image] = _in_build_storage(box, image)
        try:
            theirs = imageids.operator_image_id(engine, image, WHAT)
        except EnvironmentUnavailable:
            continue  # not ours to give: pulled with --pull, else the task is refused
        if _holds(held[image], theirs):
            continue
        with _locked(box.builder.locks / FROM_LOCK):
            held[image] = _in_build_storage(box, image)
            if _holds(held[image], theirs):
                continue  # another build copied it meanwhile
            archive = work.outer / "base.tar"
            try:
                _tool([engine, "save", "-o", str(archive), image],
                      f"{WHAT}: base image {image}", operator=True)
                os.chown(archive, box.builder.uid, box.builder.gid)
                box.run(["podman", "load", "-q", "-i", str(archive)])
            finally:
                archive.unlink(missing_ok=True)
            held[image] = _in_build_storage(box, image)
    return held


def _holds(held: Held | None, ident: str) -> bool:
    """Whether the build storage's image is the one with the id `ident`."""
    return held is not None and held.ident == ident


def _build(box: BuildBox, work: Workspace, tag: str, source: Source, dockerfile: Path,
           build_args: Mapping[str, str], progress: Progress | None = None) -> str | None:
    """`podman build --isolation chroot` in the build's box, past the source's build
    timeout killed (`dockerfile` over the staged context, to `source.target`); the
    built image's id as podman wrote it (`--iidfile`: no inspect after it), None when that
    file is not one. Its id goes in `--cgroup-parent` (recorded by each working container,
    used by nothing under chroot isolation); `RUN` steps resolve names through slirp's
    resolver. It never pulls: its `FROM` images are the ones its key names, in the build
    storage already. `progress` hears each `STEP n/m` podman prints as it gets there."""
    args = [a for name, value in sorted(build_args.items())
            for a in ("--build-arg", f"{name}={value}")]
    args += ["--target", source.target] if source.target is not None else []
    timeout = source.build_timeout_s
    iidfile = work.inner / "image-id"
    if work.inline.is_dir():
        args += ["--build-context", f"{INLINE}={work.inline}"]
    argv = ["podman", "build", "--isolation", "chroot", "--cgroup-parent", box.build_id,
            "--pull=never", "--dns", RESOLVER, *args, "-t", tag, "--iidfile", str(iidfile),
            "-f", str(dockerfile), str(work.context)]
    with open(work.outer / "build.log", "w+b") as log, _following(log.name, progress):
        code = box.build(argv, log, timeout)
        if code is None:
            raise EnvironmentUnavailable(f"{WHAT}: podman ran past {timeout:g} s")
        if code != 0:
            log.seek(0)
            lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines()
                     if ln.strip()]
            said = lines[-1] if lines else f"exit {code}"
            raise EnvironmentUnavailable(f"{WHAT}: {said[-300:]}")
    return _written_id(iidfile)


def _written_id(path: Path) -> str | None:
    """The `sha256:<hex>` id podman wrote at `path` (the build user's folder), None when it
    is not one."""
    text = (read_small(path, 128) or b"").decode("ascii", errors="replace").strip()
    ident = text if text.startswith("sha256:") else f"sha256:{text}"
    return ident if re.fullmatch(r"sha256:[0-9a-f]{64}", ident) else None


def _diff_ids(builder: Builder, digest: str) -> list[str] | None:
    """The layers (diff ids) of the built image `digest`, from its config as the build
    storage keeps it (`<driver>-images/<id>/=<base64 of the id>`; no podman start), taken
    only when its bytes hash to `digest` — an image's id is its config's digest, so what
    the build user's storage holds is checked, not trusted. None: ask podman."""
    images = imageids.token_file(builder.graphroot, storage_driver(os.uname().release)).parent
    name = "=" + base64.b64encode(digest.encode()).decode()
    data = read_small(images / digest.removeprefix("sha256:") / name, CONFIG_MAX_BYTES)
    if data is None or f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
        return None
    try:
        diffs = json.loads(data).get("rootfs", {}).get("diff_ids")
    except (ValueError, AttributeError):
        return None
    return diffs if isinstance(diffs, list) and all(isinstance(d, str) for d in diffs) \
        else None


@contextlib.contextmanager
def _following(log: str, progress: Progress | None) -> Iterator[None]:
    """While the block runs, a thread reads the build's output as it grows and tells
    `progress` each new step (`STEP n/m:`, a stage's `[i/k] ` before it)."""
    if progress is None:
        yield
        return
    progress("building", None)
    done = threading.Event()

    def follow() -> None:
        seen: tuple[int, int] | None = None
        with open(log, "rb") as handle:
            tail = b""
            while not done.wait(FOLLOW_S):
                tail += handle.read()
                complete, _, tail = tail.rpartition(b"\n")
                steps = STEP.findall(complete)
                if steps and (step := (int(steps[-1][0]), int(steps[-1][1]))) != seen:
                    seen = step
                    progress("building", step)

    thread = threading.Thread(target=follow, name="build-steps", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _save(box: BuildBox, work: Workspace, tag: str) -> Path:
    """`podman save` as the build user, moved out of its reach (a plain file, or refused)."""
    saved = work.inner / "image.tar"
    box.run(["podman", "save", "--format", "oci-archive", "-o", str(saved), tag])
    archive = work.outer / "image.tar"
    os.rename(saved, archive)
    info = os.lstat(archive)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise EnvironmentUnavailable(f"{WHAT}: the saved image is not a plain file")
    return archive
