"""The operator's image ids, asked of podman once per change of its storage (docs/SPEC.md
§16, adapters/images/imageids.py): a warm job's tasks on one base ask once, and a
pull, a tag or a removal in between is seen at the next look-up. Over the tests' own
podman storage."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import images
from tests.images import base_images, module_private_storage  # noqa: F401 (fixtures)
from trialledger.adapters.images import imageids
from trialledger.adapters.images.environment import EnvironmentUnavailable, _tool

NAME = f"localhost/tl-image-ids:{os.getpid()}"


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Sequence[str]]]:
    """The engine commands the module runs (each still run); answers are kept for later
    processes in a folder of the test's own (root's, 0700)."""
    monkeypatch.setattr(imageids, "KEPT", tmp_path / "kept")
    calls: list[Sequence[str]] = []
    def counted(argv: Sequence[str], what: str, **options: Any) -> str:
        calls.append(argv)
        return _tool(argv, what, **options)

    monkeypatch.setattr(imageids, "_tool", counted)
    yield calls
    images._podman("rmi", NAME)


def image(ref: str) -> str:
    done = images._podman("image", "inspect", "--format", "{{.Id}}", ref)
    assert done.returncode == 0, done.stderr
    return f"sha256:{done.stdout.strip()}"


def once_asked(asked: list[Sequence[str]]) -> str:
    """NAME's id looked up twice in a row while nothing wrote the storage (other tests may
    write it meanwhile: then the pair is tried again), the second from memory."""
    token = imageids.operator_token_file("podman")
    assert token is not None  # the tests' storage.conf names its graph root and driver
    for _ in range(60):
        asked.clear()
        before = imageids._read_token(token)
        first = imageids.operator_image_id("podman", NAME, "base")
        second = imageids.operator_image_id("podman", NAME, "base")
        if imageids._read_token(token) == before:
            assert second == first and len(asked) == 1
            return first
        time.sleep(0.1)
    pytest.fail("the storage was written during 60 look-ups in a row")


@pytest.mark.usefixtures("base_images")
def test_an_id_is_asked_once_while_the_storage_is_unchanged(
        asked: list[Sequence[str]]) -> None:
    assert images._podman("tag", images.DEBIAN_REF, NAME).returncode == 0
    assert once_asked(asked) == image(images.DEBIAN_REF)
    # a newer image under the same name (a pull, a tag): seen at once
    assert images._podman("tag", images.BUSYBOX_REF, NAME).returncode == 0
    asked.clear()
    assert imageids.operator_image_id("podman", NAME, "base") == image(images.BUSYBOX_REF)
    assert len(asked) == 1
    assert images._podman("rmi", NAME).returncode == 0
    with pytest.raises(EnvironmentUnavailable, match="base: "):
        imageids.operator_image_id("podman", NAME, "base")


@pytest.mark.usefixtures("base_images")
def test_a_storage_placed_wrong_is_never_remembered(
        asked: list[Sequence[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where its configuration would place the token beside an image store that is not
    the one podman answers from (the image is not seen there), every look-up asks podman."""
    elsewhere = tmp_path / "vfs-images" / "images.lock"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"t" * imageids.TOKEN_BYTES)
    monkeypatch.setattr(imageids, "_tokens", {})
    monkeypatch.setattr(imageids, "_known", {})
    monkeypatch.setattr(imageids, "_place", lambda conf: elsewhere)
    for _ in range(2):
        assert imageids.operator_image_id("podman", images.DEBIAN_REF, "base") == image(
            images.DEBIAN_REF)
    assert len(asked) == 2


@pytest.mark.usefixtures("base_images")
def test_an_answer_is_kept_for_later_processes_only_in_a_folder_of_roots_alone(
        asked: list[Sequence[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    assert images._podman("tag", images.DEBIAN_REF, NAME).returncode == 0
    token = imageids.operator_token_file("podman")
    assert token is not None
    for _ in range(60):  # (other tests may write the storage meanwhile: tried again)
        before = imageids._read_token(token)
        ident = once_asked(asked)
        monkeypatch.setattr(imageids, "_known", {})  # a later process: nothing in memory
        asked.clear()
        again = imageids.operator_image_id("podman", NAME, "base")
        imageids.KEPT.chmod(0o757)  # a folder others may write is never read
        monkeypatch.setattr(imageids, "_known", {})
        third = imageids.operator_image_id("podman", NAME, "base")
        imageids.KEPT.chmod(0o700)
        if imageids._read_token(token) == before:
            assert again == third == ident
            assert len(asked) == 1, asked  # the third asked; the second was kept
            assert imageids.peek(token, NAME) == ident
            return
    pytest.fail("the storage was written during 60 tries in a row")
