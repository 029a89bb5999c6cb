"""The session image store (docs/SPEC.md §16): images copied in by digest, layers used in
place by every range-mode session.

A root-owned, 0700 `containers-storage` (overlay driver) under `/var/lib/trialledger/
images`: no build user, slot or session can write it. An image enters it by `skopeo copy`
as root, each layer once by its digest (a layer the store holds already is never read
again): a built image from an OCI layout the build user writes of the layers the store
lacks (`take_built`), a `docker_image` from the engine's storage and an `image_archive`
from its file (`take`). Beside the storage, root's own record of each image (`meta/`: its
layer folders top first, its `Env`, `WorkingDir`, user, home, entrypoint) and a read-only
view of its layers merged (`views/<id>`, an overlay mounted `nodev,nosuid`), which the
runner reads the image through (its /etc/passwd, a workdir's links). A view is mounted
only while someone holds it (`hold_view`: a session, for its whole life; preparation,
while it reads the image's user): the last to let go unmounts it, and a runner's sweep
unmounts those a killed runner held (`unmount_unheld_views`). A session mounts each layer
folder idmapped onto its slot and lays its overlay on them (adapters/sandbox/layout.py):
one copy of each layer on the machine, none per session.

Over 500 lines: one store's whole life (its copy in, root's records, views held, mounted
and swept), whose locks only read right side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trialledger.adapters.images.environment import (
    TOOL_TIMEOUT_S,
    Cache,
    Entry,
    Environment,
    EnvironmentUnavailable,
    Kind,
    named,
)
from trialledger.adapters.images.unpack import _passwd
from trialledger.adapters.sandbox.hostside import host_env, program

if TYPE_CHECKING:
    from trialledger.adapters.images.buildbox import BuildBox

STORE = Path("/var/lib/trialledger/images")
RUNROOT = Path("/run/trialledger/images")
TAG = "localhost/trialledger-image"
MAX_LAYERS = 120  # overlay's lowerdir option holds ~4 KB of short layer names


@dataclass(frozen=True)
class Layers:
    """An image's layers in the store: `ids` top first, each with its diff's digest."""

    ids: tuple[str, ...]
    digests: tuple[str, ...]


class ImageStore:
    """The session image store: `take` and `take_built` copy an image in (each layer once),
    `environment` gives it to a session."""

    def __init__(self, folder: Path = STORE, runroot: Path = RUNROOT) -> None:
        self.folder = folder
        self.runroot = runroot

    @property
    def storage(self) -> Path:
        return self.folder / "storage"

    @property
    def destination(self) -> str:
        """The store as skopeo's `containers-storage` transport names it (no image)."""
        return f"containers-storage:[overlay@{self.storage}+{self.runroot}]"

    def _prepare(self) -> None:
        """The store's folders, root's alone (a link or another owner is refused)."""
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        for folder in (self.folder, self.folder / "meta", self.folder / "views",
                       self.folder / "locks"):
            _root_folder(folder)
        self.runroot.mkdir(mode=0o700, parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self, digest: str, what: str = "lock") -> Iterator[None]:
        """One image's lock: its copy in (`lock`), or its view's mount and unmount (`view`);
        never taken inside one another (flock: a second descriptor of ours would wait on
        the first)."""
        self._prepare()
        fd = _open_lock(self.folder / "locks" / f"{_hex(digest)}.{what}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # --- copying in ----------------------------------------------------------------------

    def take(self, source: str, digest: str, *, kind: Kind, ref: str, what: str,
             env: dict[str, str] | None = None) -> Environment:
        """The image `source` names (a skopeo source: `containers-storage:REF`,
        `docker-daemon:REF`, `oci:LAYOUT:image`, `oci-archive:PATH`, ...) in the store
        under its config `digest`, copied in unless it is there already."""
        with self._locked(digest):
            if self.layer_folders(digest) is None:  # (else another copied it meanwhile)
                _root_tool([program("skopeo"), "copy", "--quiet", source,
                            f"{self.destination}{TAG}:{_hex(digest)}"], what, env=env)
                self._record(digest, ref, what)
        return self._environment(digest, kind, ref, what)  # (its view: after the lock)

    def _environment(self, digest: str, kind: Kind, ref: str, what: str) -> Environment:
        made = self.environment(digest, kind=kind, ref=ref)
        if made is None:
            raise EnvironmentUnavailable(f"{what}: copied into the image store, then not "
                                         f"found there")
        return made

    def export_built(self, box: BuildBox, layout: Path, outer: Path, tag: str, what: str,
                     *, diffs: list[str] | None = None) -> str:
        """A built image's skopeo source: the build user writes an OCI layout of it
        (uncompressed) at `layout` in its folder, the layers the store holds already left
        as sparse placeholders it never reads; the layout is then moved to `outer` (ours)
        and made root's. `take` copies it in, checking every blob it reads against its
        digest (a placeholder is never read: its layer is in the store). `diffs`: the
        image's layers when known (else podman is asked)."""
        if diffs is None:
            diffs = json.loads(box.run(["podman", "image", "inspect", "--format",
                                        "{{json .RootFS.Layers}}", tag], what) or "[]")
        known = self._diff_sizes()
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True, mode=0o755)
        for diff in diffs if isinstance(diffs, list) else []:
            if isinstance(diff, str) and diff in known:
                with open(blobs / _hex(diff), "wb") as placeholder:
                    placeholder.truncate(known[diff])
        _own_tree(layout, box.builder.uid, box.builder.gid)
        box.run(["skopeo", "copy", "--quiet", "--dest-oci-accept-uncompressed-layers",
                 f"containers-storage:{tag}", f"oci:{layout}:image"], what)
        os.rename(layout, outer)
        _seize(outer, what)
        return f"oci:{outer}:image"

    def _diff_sizes(self) -> dict[str, int]:
        """Each layer the store holds: its diff's digest → its size."""
        return {layer["diff-digest"]: int(layer.get("diff-size") or 0)
                for layer in self._layers_file() if layer.get("diff-digest")}

    def _layers_file(self) -> list[dict[str, Any]]:
        with contextlib.suppress(OSError, ValueError):
            found = json.loads((self.storage / "overlay-layers" / "layers.json").read_text(
                encoding="utf-8"))
            return [layer for layer in found if isinstance(layer, dict)]
        return []

    def _record(self, digest: str, ref: str, what: str) -> None:
        """Root's record of an image copied in: its layers top first and its config."""
        images = json.loads((self.storage / "overlay-images" / "images.json").read_text(
            encoding="utf-8"))
        image = next((i for i in images if i.get("id") == _hex(digest)), None)
        if image is None:
            raise EnvironmentUnavailable(f"{what}: the image store holds no image {digest} "
                                         f"after the copy (the source named another image)")
        parents = {layer["id"]: layer for layer in self._layers_file()}
        ids: list[str] = []
        top = image.get("layer")
        while top:
            ids.append(top)
            top = parents[top].get("parent")
        if len(ids) > MAX_LAYERS:
            raise EnvironmentUnavailable(f"{what}: {len(ids)} layers (at most {MAX_LAYERS})")
        config = json.loads(_root_tool([
            program("skopeo"), "inspect", "--config",
            f"{self.destination}{TAG}:{_hex(digest)}"], what))
        inner = config.get("config") or {}
        sizes = {layer_id: int(layer.get("diff-size") or 0)
                 for layer_id, layer in parents.items()}
        record = {"digest": digest, "ref": ref, "layers": ids, "size": sum(sizes[i] for i in ids),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": {
            "Env": inner.get("Env") or [], "WorkingDir": inner.get("WorkingDir") or "",
            "User": inner.get("User") or "", "Entrypoint": inner.get("Entrypoint") or [],
            "Cmd": inner.get("Cmd") or []}}
        scratch = self.folder / "meta" / f".{_hex(digest)}.json"
        scratch.write_text(json.dumps(record), encoding="utf-8")
        os.replace(scratch, self.folder / "meta" / f"{_hex(digest)}.json")

    def entries(self) -> list[Entry]:
        """Every image the store holds (for `cache ls`; none when this is not root or the
        store was never made), newest first; an image's size counts each of its layers."""
        found = []
        folder = self.folder / "meta"
        for meta in sorted(folder.glob("*.json")) if os.access(folder, os.R_OK) else []:
            with contextlib.suppress(OSError, ValueError, KeyError):
                record = json.loads(meta.read_text(encoding="utf-8"))
                found.append(Entry(record["digest"], "image (store)",
                                   str(record.get("ref") or ""), int(record.get("size") or 0),
                                   str(record.get("created") or ""), self.folder))
        return sorted(found, key=lambda e: e.created, reverse=True)

    def prune(self, digests: Sequence[str] = ()
              ) -> tuple[list[Entry], list[Entry], list[tuple[Entry, str]]]:
        """Remove the images named (every image when none is) that no session holds, each
        under its locks, with its layers that no other image uses: (removed, kept because
        held, kept because removing failed — with why). A holder takes its shared lock
        under the view's lock, which this holds while it looks, so no session starts on an
        image as it goes."""
        removed: list[Entry] = []
        held: list[Entry] = []
        failed: list[tuple[Entry, str]] = []
        for entry in self.entries():
            if not named(entry.digest, digests):
                continue
            with self._locked(entry.digest), self._locked(entry.digest, "view"):
                users = _open_lock(self.folder / "locks" / f"{_hex(entry.digest)}.users")
                try:
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    held.append(entry)
                    continue
                finally:
                    os.close(users)
                try:
                    self._remove(entry.digest)
                except (EnvironmentUnavailable, OSError, subprocess.SubprocessError) as error:
                    failed.append((entry, str(error)))
                    continue
            removed.append(entry)
        return removed, held, failed

    def _remove(self, digest: str) -> None:
        """(Under the image's locks, nobody holding it) its view, the image with the layers
        no other image uses, then its record."""
        what = f"the image store's {digest}"
        view = self.folder / "views" / _hex(digest)
        if os.path.ismount(view):
            _root_tool([program("umount"), str(view)], what)
        with contextlib.suppress(FileNotFoundError):
            view.rmdir()
        try:
            _root_tool([program("skopeo"), "delete", f"{self.destination}{TAG}:{_hex(digest)}"],
                       what)
        except EnvironmentUnavailable:
            if self.layer_folders(digest) is not None:  # (else a copy in never finished)
                raise
        (self.folder / "meta" / f"{_hex(digest)}.json").unlink(missing_ok=True)

    # --- using ---------------------------------------------------------------------------

    def layer_folders(self, digest: str) -> list[Path] | None:
        """The image's layer folders, top first (None when it is not in the store)."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads((self.folder / "meta" / f"{_hex(digest)}.json").read_text(
                encoding="utf-8"))
            folders = [self.storage / "overlay" / str(i) / "diff" for i in record["layers"]]
            if folders and all(f.is_dir() for f in folders):
                return folders
        return None

    def environment(self, digest: str, *, kind: Kind, ref: str) -> Environment | None:
        """The image `digest` as a session uses it (its view mounted), None when the store
        does not hold it."""
        folders = self.layer_folders(digest)
        if folders is None:
            return None
        meta = self.folder / "meta" / f"{_hex(digest)}.json"
        record = json.loads(meta.read_text(encoding="utf-8"))
        if "Cmd" not in record["config"]:  # recorded before CMD was (a compose service's)
            self._record(digest, record["ref"], f"image {ref}")
            record = json.loads(meta.read_text(encoding="utf-8"))
        view = self._view_of(digest, folders)
        config = record["config"]
        env = tuple(tuple(item.split("=", 1)) for item in config["Env"] if "=" in item)
        values = dict(env)
        from trialledger.adapters.sandbox.base import SandboxRefused
        from trialledger.adapters.sandbox.idrange import resolve_user

        with self._held(digest, folders):  # (unmounted after, unless a session holds it)
            try:
                user = resolve_user(view, config["User"] or None, (0, 0))
            except SandboxRefused as error:
                raise EnvironmentUnavailable(f"image {ref}: its USER: {error}") from None
            home = values.get("HOME") or _home(view, user.uid)
        entrypoint = config["Entrypoint"] if isinstance(config["Entrypoint"], list) else []
        return Environment(kind=kind, ref=ref, digest=digest, root=view,
                           env=tuple((k, v) for k, v in env),
                           workdir=config["WorkingDir"] or "/", uid=user.uid, gid=user.gid,
                           home=home, plain=True, entrypoint=tuple(str(a) for a in entrypoint),
                           cmd=tuple(str(a) for a in config["Cmd"] or ()),
                           layers=tuple(folders))

    # --- views: mounted while held -------------------------------------------------------

    def _view_of(self, digest: str, folders: Sequence[Path]) -> Path:
        """Where the image's layers are read merged (a single layer is its own view)."""
        return folders[0] if len(folders) == 1 else self.folder / "views" / _hex(digest)

    @contextlib.contextmanager
    def _held(self, digest: str, folders: Sequence[Path]) -> Iterator[None]:
        hold = self.hold(digest, folders)
        try:
            yield
        finally:
            hold.release()

    def hold(self, digest: str, folders: Sequence[Path]) -> ViewHold:
        """The image held until the hold is released (`prune` keeps it), its view mounted
        (read-only) when it has more than one layer: a shared file lock on
        `locks/<id>.users`, taken under the view's lock, marks each holder, in any process;
        a killed holder's lock goes with it."""
        view = self._view_of(digest, folders)
        with self._locked(digest, "view"):
            users = _open_lock(self.folder / "locks" / f"{_hex(digest)}.users")
            fcntl.flock(users, fcntl.LOCK_SH)
            try:
                if not all(folder.is_dir() for folder in folders):
                    raise ImagePruned(f"image {digest}: no longer in the image "
                                                 f"store (cache prune); prepared again by "
                                                 f"the next run")
                if view not in folders and not os.path.ismount(view):
                    view.mkdir(mode=0o700, exist_ok=True)
                    lower = ":".join(f"{f.parent.name}/diff" for f in folders)
                    _root_tool([program("mount"), "-t", "overlay", "overlay", "-o",
                                f"ro,nodev,nosuid,lowerdir={lower}", str(view)],
                               f"the image store's view of {digest}",
                               cwd=self.storage / "overlay")
            except BaseException:
                os.close(users)
                raise
        return ViewHold(self, digest, users)

    def unmount_unheld(self, digest: str) -> bool:
        """Unmount the image's view when nobody holds it (under the view's lock); whether
        it was unmounted."""
        view = self.folder / "views" / _hex(digest)
        with self._locked(digest, "view"):
            if not os.path.ismount(view):
                return False
            users = _open_lock(self.folder / "locks" / f"{_hex(digest)}.users")
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held: its last holder unmounts it
            finally:
                os.close(users)
            _root_tool([program("umount"), str(view)], f"the image store's view of {digest}")
        return True

    def unmount_unheld_views(self) -> int:
        """Unmount every view nobody holds (those a killed runner's sessions held): how
        many. Nothing where the store was never made or this is not root."""
        views = self.folder / "views"
        if os.geteuid() != 0 or not views.is_dir() or views.is_symlink():
            return 0
        unmounted = 0
        for view in views.iterdir():
            if os.path.ismount(view):
                with contextlib.suppress(EnvironmentUnavailable, OSError):
                    unmounted += self.unmount_unheld(f"sha256:{view.name}")
        return unmounted


class ViewHold:
    """A holder of an image's view (`ImageStore.hold`): released, the view is unmounted
    unless another holds it. Releasing twice does nothing."""

    def __init__(self, store: ImageStore, digest: str, users: int | None) -> None:
        self._store = store
        self._digest = digest
        self._users = users

    def __enter__(self) -> ViewHold:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def release(self) -> None:
        """Let go; unmount the view when this was its last holder (busy: the next sweep)."""
        if self._users is None:
            return
        os.close(self._users)
        self._users = None
        with contextlib.suppress(EnvironmentUnavailable, OSError):
            self._store.unmount_unheld(self._digest)


def hold_view(environment: Environment) -> ViewHold | None:
    """(A session's start) A session image store's image held while the session lives
    (`cache prune` keeps it), its view mounted for the runner to read it through
    `environment.root`; None for any other environment (nothing of the store's)."""
    if not environment.layers or environment.digest is None:
        return None
    store = ImageStore(environment.layers[0].parents[3])  # <store>/storage/overlay/<id>/diff
    return store.hold(environment.digest, environment.layers)


class ImagePruned(EnvironmentUnavailable):
    """An image left the session image store (`cache prune`, another process) between its
    environment's preparation and its hold."""


PREPARE_TRIES = 3  # each lost only to a prune that ran between a preparation and its hold


def prepared_and_held(prepare: Callable[[], Environment],
                      holds: contextlib.ExitStack) -> Environment:
    """`prepare()`'s environment with its images held on `holds` (`images_held`). A prune
    by another process between the two takes nothing a run needs: the environment is
    prepared again (its images copied into the store again), up to PREPARE_TRIES times."""
    for _ in range(PREPARE_TRIES - 1):
        environment = prepare()
        with contextlib.suppress(ImagePruned):
            holds.enter_context(images_held(environment))
            return environment
    environment = prepare()
    holds.enter_context(images_held(environment))
    return environment


@contextlib.contextmanager
def images_held(environment: Environment) -> Iterator[None]:
    """Every session image store image of a prepared environment — its own, its separate
    verifier's, its steps' verifiers', its compose services' — held from its preparation
    until its runs end (a job's: until the job's run ends), so `cache prune` keeps them
    for sessions that have not started yet. EnvironmentUnavailable when one was pruned
    between its preparation and this."""
    found = [environment, *(e for _, e in environment.services),
             *(e for _, e in environment.step_verifiers)]
    found += [e.verifier for e in list(found) if e.verifier is not None]
    holds: list[ViewHold] = []
    try:
        for image in found:
            if (hold := hold_view(image)) is not None:
                holds.append(hold)
        yield
    finally:
        for hold in holds:
            hold.release()


@functools.cache
def idmapped_layers_problem(init: Path, host_start: int) -> str | None:
    """Why a session cannot lay its overlay on layers of the store idmapped onto a slot here
    (None: it can): two folders in the store's file system mounted idmapped (ids from
    `host_start`) and an overlay over them in TMPDIR, as a session's are; tried once per
    process. Range mode is unavailable where it fails — never a copy per slot."""
    store = ImageStore()
    try:
        store._prepare()
    except (OSError, EnvironmentUnavailable) as error:
        return f"the session image store: {error}"
    child = None
    with tempfile.TemporaryDirectory(prefix=".probe-", dir=store.folder) as layers, \
            tempfile.TemporaryDirectory(prefix="trialledger-probe-") as points:
        sources = [Path(layers, "a"), Path(layers, "b")]
        lowers = [Path(points, "lower-0"), Path(points, "lower-1")]
        for folder in [*sources, *lowers, *(Path(points, n) for n in ("up", "work", "on"))]:
            folder.mkdir()
        try:
            child = subprocess.Popen([program("unshare"), "--user", program("sleep"), "30"],
                                     env=host_env(), stdin=subprocess.DEVNULL)
            ours = os.readlink("/proc/self/ns/user")
            for _ in range(400):  # until it has its namespace (a few ms)
                if os.readlink(f"/proc/{child.pid}/ns/user") != ours:
                    break
                time.sleep(0.005)
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{child.pid}/{name}").write_text(f"0 {host_start} 65536\n")
            userns = os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            try:
                done = subprocess.run(
                    [str(init), "--stage", "--mount-ns",
                     *(part for source, point in zip(sources, lowers, strict=True)
                       for part in ("--idmap", str(userns), str(source), str(point))),
                     f"lowerdir={lowers[0]}:{lowers[1]},upperdir={points}/up,"
                     f"workdir={points}/work", f"{points}/on", "--", "--", program("true")],
                    capture_output=True, text=True, check=False, env=host_env(),
                    pass_fds=(userns,), timeout=30)
            finally:
                os.close(userns)
        except (OSError, subprocess.SubprocessError) as error:
            return f"idmapped image layers cannot be tried here ({error})"
        finally:
            if child is not None:
                child.kill()
                child.wait()
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"idmapped image layers cannot be mounted here ({said[-200:]})"
    return None


def _seize(layout: Path, what: str) -> None:
    """Make a layout the build user wrote root's, each folder before it is listed (so no
    entry is added after: it may no longer write there), refusing anything but folders and
    plain files of one link — a link or a fifo would lead skopeo, as root, elsewhere."""
    _take_over(str(layout), stat.S_ISDIR, what)
    for folder, dirs, files in os.walk(layout):  # (a folder is listed after its parent's turn)
        for name in dirs:
            _take_over(os.path.join(folder, name), stat.S_ISDIR, what)
        for name in files:
            _take_over(os.path.join(folder, name), stat.S_ISREG, what)


def _take_over(path: str, kind: Callable[[int], bool], what: str) -> None:
    info = os.lstat(path)
    if not kind(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink != 1):
        raise EnvironmentUnavailable(f"{what}: the exported image holds {path!r}, neither a "
                                     f"folder nor a plain file")
    os.lchown(path, 0, 0)
    os.chmod(path, 0o700 if stat.S_ISDIR(info.st_mode) else 0o600)


def _own_tree(root: Path, uid: int, gid: int) -> None:
    """Give `root` and everything in it (links themselves, never followed) to uid:gid."""
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in [*dirs, *files])]:
            os.lchown(name, uid, gid)


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _home(root: Path, uid: int) -> str:
    return _passwd(root, uid)


def _root_folder(folder: Path) -> None:
    """`folder` made (0700) when missing; refused unless a real folder of root's that no
    one else may write."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
        raise EnvironmentUnavailable(f"the image store {folder}: must be a folder of root's, "
                                     f"mode 0700")


def _root_tool(argv: Sequence[str], what: str, *, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> str:
    """A tool run as root with an environment built from scratch (docs/SPEC.md §16), or
    `env` (host_env and the operator's engine storage)."""
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                          timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL,
                          env=env or host_env(), cwd=cwd)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise EnvironmentUnavailable(f"{what}: {(lines or [f'exit {done.returncode}'])[-1][-300:]}")
    return done.stdout


def plain_cache(folder: Path | None = None) -> Cache:
    """A cache for range mode: plain entries, its images in the session image store."""
    return Cache(folder, plain=True, store=ImageStore())
