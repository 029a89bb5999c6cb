"""The ways an image or a root filesystem enters the cache (docs/SPEC.md §12; the cache and
what a session runs over are adapters/images/environment.py's): an OCI or docker archive by
its config digest, an engine's image inspected and saved only on a miss (in range mode
both copied into the session image store instead), a root filesystem packed and
unpacked by GNU tar once per digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from trialledger.adapters.images import imageids
from trialledger.adapters.images.environment import (
    DEFAULT_PATH,
    Cache,
    Environment,
    EnvironmentUnavailable,
    Kind,
    _tool,
)


def _file_key(path: Path) -> str:
    info = path.stat()
    identity = f"{path.resolve()}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}"
    return hashlib.sha256(identity.encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


# --- images ------------------------------------------------------------------------------

def _to_layout(archive: Path, layout: Path, what: str) -> None:
    """Copy an OCI archive or a docker-archive into an OCI layout with skopeo."""
    problems = []
    for transport in ("oci-archive", "docker-archive"):
        try:
            _tool(["skopeo", "copy", "--quiet", f"{transport}:{archive}", f"oci:{layout}:image"],
                  what)
            return
        except EnvironmentUnavailable as error:
            if "not installed" in str(error):
                raise
            problems.append(str(error).removeprefix(f"{what}: "))
    raise EnvironmentUnavailable(f"{what}: neither an OCI archive nor a docker-archive "
                                 f"({problems[-1]})")


def _config_digest(layout: Path) -> str:
    """The image config digest an OCI layout's only manifest names."""
    index = json.loads((layout / "index.json").read_text(encoding="utf-8"))
    digest = index["manifests"][0]["digest"]
    blob = layout / "blobs" / "sha256" / digest.removeprefix("sha256:")
    return str(json.loads(blob.read_text(encoding="utf-8"))["config"]["digest"])


def _entrypoint(layout: Path) -> tuple[str, ...]:
    """The ENTRYPOINT of an OCI layout's image (umoci's runtime config joins it with CMD)."""
    blob = layout / "blobs" / "sha256" / _config_digest(layout).removeprefix("sha256:")
    config = json.loads(blob.read_text(encoding="utf-8")).get("config") or {}
    entrypoint = config.get("Entrypoint") or ()
    return tuple(str(arg) for arg in entrypoint) if isinstance(entrypoint, list) else ()


def _unpack_layout(layout: Path, scratch: Path, kind: Kind, ref: str, digest: str,
                   what: str) -> Environment:
    """`umoci unpack --rootless` (single-id mode; range mode uses the image store's layers
    in place), then the runtime config umoci derived from the image."""
    bundle = scratch / "bundle"
    _tool(["umoci", "unpack", "--rootless", "--image", f"{layout}:image", str(bundle)], what)
    config = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    process = config.get("process", {})
    env = [item.split("=", 1) for item in process.get("env", []) if "=" in item]
    user = process.get("user", {})
    os.rename(bundle / "rootfs", scratch / "rootfs")
    shutil.rmtree(bundle)
    values = dict((k, v) for k, v in env)
    return Environment(kind=kind, ref=ref, digest=digest, entrypoint=_entrypoint(layout),
                       env=tuple((k, v) for k, v in env),
                       workdir=str(process.get("cwd") or "/"),
                       uid=int(user.get("uid", 0)), gid=int(user.get("gid", 0)),
                       home=values.get("HOME", "/"))


def prepare_archive(archive: Path, ref: str, cache: Cache, owner: int | None, *,
                    digest: str | None = None) -> Environment:
    """An OCI or docker archive, by its config digest (known already for an engine's
    image; else remembered per file, or found by copying the archive into a layout)."""
    what = f"image_archive {ref}"
    if not archive.is_file():
        raise EnvironmentUnavailable(f"{what}: no such file")
    key = _file_key(archive)
    digest = digest or cache.remembered(key)
    if digest is not None and (found := cache.image(digest)) is not None:
        return found
    if cache.store is not None:
        transport, digest = _archive_config(archive, what, digest)
        cache.remember(key, digest)
        return cache.store.take(f"{transport}:{archive}", digest, kind="image", ref=ref,
                                what=what)
    with tempfile.TemporaryDirectory(prefix="trialledger-image-") as work:
        layout = Path(work) / "layout"
        _to_layout(archive, layout, what)
        digest = digest or _config_digest(layout)
        cache.remember(key, digest)
        known = digest
        return cache.fill(digest, lambda scratch: _unpack_layout(
            layout, scratch, "image", ref, known, what), owner=owner)


def _archive_config(archive: Path, what: str, digest: str | None) -> tuple[str, str]:
    """An archive's skopeo transport (OCI or docker) and its image's config digest (read
    from the archive unless known)."""
    problems = []
    for transport in ("oci-archive", "docker-archive"):
        try:
            config = _tool(["skopeo", "inspect", "--config", "--raw", f"{transport}:{archive}"],
                           what)
        except EnvironmentUnavailable as error:
            if "not installed" in str(error):
                raise
            problems.append(str(error).removeprefix(f"{what}: "))
            continue
        return transport, digest or f"sha256:{hashlib.sha256(config.encode()).hexdigest()}"
    raise EnvironmentUnavailable(f"{what}: neither an OCI archive nor a docker-archive "
                                 f"({problems[-1]})")


def prepare_engine_image(ref: str, engine: str, cache: Cache, owner: int | None, *,
                         shown: str | None = None) -> Environment:
    """An image in podman's or docker's storage: inspected, then saved only on a miss."""
    what = f"docker_image {shown or ref}"
    digest = imageids.operator_image_id(engine, ref, what)  # (kept while it is unchanged)
    if (found := cache.image(digest)) is not None:
        return found
    if cache.store is not None and engine == "podman":  # read from its storage, layer by
        # layer (docker's `save` output takes the archive's way into the store, below)
        conf = {k: v for k, v in os.environ.items()  # (its storage, as the engine read it)
                if k in ("CONTAINERS_STORAGE_CONF", "STORAGE_DRIVER", "STORAGE_OPTS")}
        from trialledger.adapters.sandbox.hostside import host_env

        return cache.store.take(f"containers-storage:{ref}", digest, kind="image",
                                ref=shown or ref, what=what, env=host_env(**conf))
    with tempfile.TemporaryDirectory(prefix="trialledger-save-") as work:
        archive = Path(work) / "image.tar"
        save = [engine, "save", "-o", str(archive), ref]
        if engine == "podman":
            save[2:2] = ["--format", "oci-archive"]
        _tool(save, what, operator=True)
        made = prepare_archive(archive, shown or ref, cache, owner, digest=digest)
    return made


def missing(ref: str, engine: str) -> str | None:
    """None when the engine's local storage holds `ref`, else what the engine said."""
    try:
        _tool([engine, "image", "inspect", "--format", "{{.Id}}", ref], ref, operator=True)
    except EnvironmentUnavailable as error:
        return str(error).removeprefix(f"{ref}: ")
    return None


# --- root filesystems ---------------------------------------------------------------------

def _pack(folder: Path, cache: Cache) -> Path:
    """A rootfs folder as a sorted, mtime-0, numeric-owner tar in the cache."""
    cache._prepare_folders()
    (cache.folder / "packed").mkdir(exist_ok=True, mode=0o700)
    fd, name = tempfile.mkstemp(prefix=".pack-", suffix=".tar", dir=cache.folder / "packed")
    os.close(fd)
    _tool(["tar", "--sort=name", "--mtime=@0", "--numeric-owner", "--format=gnu",
           "-C", str(folder), "-cf", name, "."], f"rootfs {folder.name}")
    return Path(name)


def _passwd(root: Path, uid: int) -> str:
    """The home folder of `uid` in a root's /etc/passwd (/ when none)."""
    with contextlib.suppress(OSError):
        passwd = root / "etc" / "passwd"
        if not passwd.is_symlink():
            for line in passwd.read_text(encoding="utf-8", errors="replace").splitlines():
                fields = line.split(":")
                if len(fields) >= 6 and fields[2] == str(uid):
                    return fields[5] or "/"
    return "/"


def prepare_rootfs(path: Path, ref: str, cache: Cache, owner: int | None) -> Environment:
    """A root filesystem folder (packed first) or tarball, by the tarball's sha256."""
    what = f"rootfs {ref}"
    packed = None
    if path.is_dir():
        packed = _pack(path, cache)
        tarball = packed
    elif path.is_file():
        tarball = path
    else:
        raise EnvironmentUnavailable(f"{what}: no such folder or tarball")
    try:
        key = _file_key(tarball)
        digest = (None if packed else cache.remembered(key)) or _sha256_file(tarball)
        if packed is None:
            cache.remember(key, digest)
        else:
            os.replace(packed, cache.folder / "packed" / f"{digest.removeprefix('sha256:')}.tar")
            tarball = packed = cache.folder / "packed" / f"{digest.removeprefix('sha256:')}.tar"

        def unpack(scratch: Path) -> Environment:
            (scratch / "rootfs").mkdir()
            owners = (["--same-owner", "--numeric-owner", "--same-permissions"] if cache.plain
                      else ["--no-same-owner"])
            _tool(["tar", "-xf", str(tarball), "-C", str(scratch / "rootfs"), *owners,
                   "--delay-directory-restore"], what)
            home = _passwd(scratch / "rootfs", 0)
            return Environment(kind="rootfs", ref=ref, digest=digest,
                               env=(("PATH", DEFAULT_PATH),), workdir="/", home=home)

        return cache.lookup(digest) or cache.fill(digest, unpack, owner=owner)
    finally:
        if packed is not None and packed.name.startswith(".pack-"):
            packed.unlink(missing_ok=True)
