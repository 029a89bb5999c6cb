"""Real task images for the environment tests, built offline from Debian packages.

Built once and kept in `.images/` (ignored), each under a folder keyed by its recipe, so a
changed recipe builds afresh:
- a busybox-only root (Debian's `busybox-static`: no bash, no python3), with a user
  `agent` (uid 1000) and a marker file;
- a Debian root made with `mmdebstrap --variant=minbase --include=git` carrying a marker
  file the host lacks (about 2 minutes), as a tarball;
- both imported into a private podman storage (`CONTAINERS_STORAGE_CONF` points at it, so
  the host's storage is never touched), the Debian one also saved as an OCI archive.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / ".images"
DEBIAN_MARKER = "debian-image-marker-5be1"
BUSYBOX_MARKER = "busybox-image-marker-91c2"
DEBIAN_REF = "localhost/tl-debian:plain"  # no WORKDIR, no USER
BUSYBOX_REF = "localhost/tl-busybox:configured"  # WORKDIR /work, ENV, USER agent
# One fixed time for every file and the archive (mmdebstrap honours SOURCE_DATE_EPOCH), so
# every build of a recipe is the same tarball byte for byte: each clean clone's tests find
# the images, cache entries and layers an earlier run left instead of adding 0.7 GB more.
EPOCH = "1700000000"
MMDEBSTRAP = ["mmdebstrap", "--variant=minbase", "--include=git", "--mode=root",
              f"--customize-hook=echo {DEBIAN_MARKER} > \"$1/etc/trialledger-marker\"",
              "bookworm"]


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@contextmanager
def _locked(name: str) -> Iterator[None]:
    IMAGES.mkdir(exist_ok=True)
    with open(IMAGES / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _run(argv: Sequence[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=900,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr[-2000:]}")


def busybox_root() -> Path:
    """A root with only busybox (its applets as symlinks), /etc/passwd and a marker."""
    busybox = Path("/bin/busybox")
    recipe = _key("busybox", busybox.read_bytes(), 2)
    root = IMAGES / f"busybox-{recipe}"
    with _locked("busybox"):
        if not root.is_dir():
            scratch = IMAGES / f".busybox-{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            for folder in ("bin", "etc", "root", "home/agent", "tmp", "work"):
                (scratch / folder).mkdir(parents=True)
            shutil.copy2(busybox, scratch / "bin" / "busybox")
            applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                                     check=True).stdout.split()
            for applet in applets:
                if applet != "busybox":
                    (scratch / "bin" / applet).symlink_to("busybox")
            (scratch / "etc" / "passwd").write_text(
                "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n")
            (scratch / "etc" / "group").write_text("root:x:0:\nagent:x:1000:\n")
            (scratch / "marker").write_text(BUSYBOX_MARKER + "\n")
            os.rename(scratch, root)
    return root


def debian_tarball() -> Path:
    """A minbase Debian root with git and a marker, as a tarball (mmdebstrap)."""
    folder = IMAGES / f"debian-{_key(MMDEBSTRAP, EPOCH)}"
    tarball = folder / "rootfs.tar"
    with _locked("debian"):
        if not tarball.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            _run([*MMDEBSTRAP, str(folder / ".rootfs.tar")],
                 env={**os.environ, "SOURCE_DATE_EPOCH": EPOCH})
            os.rename(folder / ".rootfs.tar", tarball)
    return tarball


def storage_conf() -> Path:
    """A private podman storage (vfs, under .images), named by CONTAINERS_STORAGE_CONF."""
    storage = IMAGES / "podman"
    conf = IMAGES / "storage.conf"
    if not conf.is_file():
        storage.mkdir(parents=True, exist_ok=True)
        conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{storage}/graph"\n'
                        f'runroot = "{storage}/run"\n')
    return conf


@contextmanager
def private_storage() -> Iterator[None]:
    """For the block, every engine call (a test's and the runner's) uses the tests' own
    podman storage (`storage_conf`); the variable is restored after."""
    before = os.environ.get("CONTAINERS_STORAGE_CONF")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(storage_conf())
    try:
        yield
    finally:
        if before is None:
            del os.environ["CONTAINERS_STORAGE_CONF"]
        else:
            os.environ["CONTAINERS_STORAGE_CONF"] = before


@pytest.fixture(name="private_storage")
def private_storage_fixture() -> Iterator[None]:
    """For one test that asks for it: every engine call uses the tests' own storage."""
    with private_storage():
        yield


@pytest.fixture(scope="module")
def base_images() -> None:
    """The two base images the tests' task folders name (`DEBIAN_REF`, `BUSYBOX_REF`), in
    the tests' podman storage."""
    podman_image(DEBIAN_REF)
    podman_image(BUSYBOX_REF)


@pytest.fixture(scope="module", autouse=True)
def module_private_storage() -> Iterator[None]:
    """For a test module that imports it: every engine call (the tests' and the runner's)
    uses the tests' own podman storage."""
    with private_storage():
        yield


def _podman(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(storage_conf())}
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=False,
                          env=env, timeout=900)


def busybox_image(ref: str, fill: Callable[[tarfile.TarFile], None]) -> str:
    """`ref` in the tests' storage: the busybox root (root's, but `/home/agent` and `/work`
    the agent's) with what `fill` adds, `USER agent`, `WORKDIR /work`. Imported once, under
    the storage's lock and from a tarball of its own: two test processes would otherwise
    both write one tarball and import it, the second moving the tag to an image of its
    own (`podman import` stamps the time) under the first one's run."""
    root = busybox_root()  # (under its own lock, before the storage's)
    with _locked("podman"):
        if _podman("image", "exists", ref).returncode == 0:
            return ref
        with tempfile.TemporaryDirectory(dir=IMAGES) as scratch:
            tarball = Path(scratch) / "image.tar"
            with tarfile.open(tarball, "w") as archive:
                archive.add(root, arcname=".", filter=_as_root)
                fill(archive)
            done = _podman("import", "--change", "USER agent", "--change", "WORKDIR /work",
                           str(tarball), ref)
    if done.returncode != 0:
        raise RuntimeError(f"podman import {ref} failed: {done.stderr[-2000:]}")
    return ref


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    if info.name in ("./home/agent", "./work"):
        info.uid = info.gid = 1000
    return info


def podman_image(ref: str) -> str:
    """Import one of the test images into the private podman storage (once); its ref."""
    with _locked("podman"):
        if _podman("image", "exists", ref).returncode == 0:
            return ref
        if ref == DEBIAN_REF:
            done = _podman("import", str(debian_tarball()), ref)
        else:
            tarball = IMAGES / f"busybox-{_key(busybox_root())}.tar"
            _run(["tar", "-C", str(busybox_root()), "--sort=name", f"--mtime=@{EPOCH}",
                  "--owner=0", "--group=0", "--numeric-owner", "-cf", str(tarball), "."])
            done = _podman("import", "--change", "WORKDIR /work", "--change",
                           "ENV FOO=from-the-image", "--change", "USER agent",
                           str(tarball), ref)
        if done.returncode != 0:
            raise RuntimeError(f"podman import failed: {done.stderr[-2000:]}")
    return ref


def oci_archive(ref: str, target: Path) -> Path:
    """`podman save --format oci-archive` of a test image into `target`."""
    done = _podman("save", "--format", "oci-archive", "-o", str(target), podman_image(ref))
    if done.returncode != 0:
        raise RuntimeError(f"podman save failed: {done.stderr[-2000:]}")
    return target


def build_all() -> None:
    """Every image the tests use (each built once, kept in .images/)."""
    debian_tarball()
    busybox_root()
    podman_image(DEBIAN_REF)
    podman_image(BUSYBOX_REF)


if __name__ == "__main__":  # `.ci/run` builds them before the tests, as it installs tools
    build_all()
