"""What a killed run left behind on this machine, removed once its owner is provably gone
(docs/SPEC.md §11 "Leftovers").

A session's cgroups are named after its session folder (`<folder>-<8 hex>`), whose lock
its runner holds from before the cgroups exist until after they are removed: a cgroup
whose recorded folder's lock is free belongs to nobody (swept before the folders are).
A build's cgroup and its working containers carry its private folder's name, and that
folder a lock its runner holds while the build lives (adapters/images/buildbox.py,
`build_alive`). A view of the session image store is mounted while a session holds it
(a shared file lock, adapters/images/imagestore.py): one nobody holds is unmounted. Nothing is
ever chosen by user id, and nothing of a live runner is touched.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trialledger.adapters.images.buildbox import end_dead_builds
from trialledger.adapters.images.builder import build_user
from trialledger.adapters.images.environment import EnvironmentUnavailable
from trialledger.adapters.sandbox.cgroup import BUILD_PREFIX, remove_cgroup, runner_parents
from trialledger.adapters.sandbox.folders import (
    FOLDER_PREFIX,
    LOCK,
    STALE_S,
    folder_registry,
    lock_held,
)


def owner_gone(folder_name: str) -> bool:
    """Whether the session folder `folder_name` is recorded here and no runner holds its
    lock. A cgroup of a folder no longer recorded is left alone: whose it is cannot be
    known (a runner of an older version names its cgroups otherwise), so sessions' cgroups
    are swept before their folders are."""
    try:
        recorded = Path(os.fsdecode((folder_registry() / folder_name).read_bytes()))
    except OSError:
        return False
    return recorded.name == folder_name and lock_held(recorded / LOCK) is not True


def sweep_session_cgroups() -> int:
    """Remove the session cgroups of runners that are gone (killing what is left in them);
    how many folders were removed."""
    removed = 0
    for parent in runner_parents():
        try:
            children = [c for c in parent.iterdir() if c.is_dir() and not c.is_symlink()]
        except OSError:
            continue
        for child in children:
            name = child.name
            if not name.startswith(FOLDER_PREFIX) or name.startswith(BUILD_PREFIX):
                continue
            try:
                if time.time() - child.stat().st_mtime < STALE_S:
                    continue  # (an older runner named them otherwise; give it time)
            except OSError:
                continue
            if not owner_gone(name.rsplit("-", 1)[0]):
                continue
            removed += remove_cgroup(child)
    return removed


def sweep_image_views() -> int:
    """Unmount the session image store's views no live session holds (a killed runner's
    sessions held them: their holds went with it): how many."""
    from trialledger.adapters.images.imagestore import ImageStore

    return ImageStore().unmount_unheld_views()


def sweep_builds() -> int:
    """End what killed builds left (cgroups, folders; their working containers with the
    next build): how many builds. Nothing when there is no build user here."""
    try:
        builder = build_user()
    except EnvironmentUnavailable:
        return 0
    return end_dead_builds(builder)
