"""SPEC §11: an image's links never lead bwrap's mount points out of the sandbox's root.

bwrap makes each mount point with plain path resolution before it enters the new root, so
an image that ships `/logs -> /oldroot/<host folder>` would have bwrap make folders on the
host (and mount there, out of the sandbox's sight), and `/tests -> /faketests` would have
the verifier run the image's own tests. Each is run through a real session: the real
Codex CLI, a scripted endpoint, real bwrap over a rootfs task built from busybox.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests import images
from tests.runs import make_task, run_task
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.images.environment import Cache
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox.identity import sandbox_user

pytestmark = pytest.mark.anyio
REAL_REWARD = "0.625"  # only the task's own tests write it


@pytest.fixture
def host_folder(reachable_tmp: Path) -> Path:
    """A host folder anyone may write in (so an escaped bwrap could), empty to start."""
    reachable_tmp.chmod(0o777)
    return reachable_tmp


def tree(root: Path) -> list[tuple[str, int, str]]:
    """Every entry under `root`: path, mode, link target (links not followed)."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in sorted([*dirs, *files]):
            path = Path(folder, name)
            found.append((str(path.relative_to(root)), path.lstat().st_mode,
                          os.readlink(path) if path.is_symlink() else ""))
    return sorted(found)


LINKS = {  # an image's link at one of our mount points, and where it leads
    "logs": "/oldroot{host}",  # through bwrap's view of the host: /logs/verifier on the host
    "run": "/oldroot{host}",  # our init's mount point, /run/trialledger, on the host
    "tmp": "/oldroot{host}",
    "dev": "{host}",  # resolved in bwrap's own root
    "tests": "/faketests",  # the image's own tests, which pass
}


def hostile_root(folder: Path, host: Path, links: list[str]) -> Path:
    """busybox with absolute `links` at our mount points, and tests of its own."""
    root = folder / "root"
    shutil.copytree(images.busybox_root(), root, symlinks=True)
    (root / "faketests").mkdir()
    (root / "faketests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    (root / "faketests" / "test.sh").chmod(0o755)
    for name in links:
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).symlink_to(LINKS[name].format(host=host))
    return root


@pytest.mark.parametrize(("links", "verifier_root"), [
    *[([name], "agent") for name in LINKS], (list(LINKS), "agent"), (list(LINKS), "pristine"),
], ids=[*LINKS, "all", "all-pristine-verifier"])
async def test_an_images_links_at_mount_points_lead_nowhere(
        tmp_path: Path, host_folder: Path, links: list[str], verifier_root: str) -> None:
    folder = tmp_path / "task"
    hostile_root(folder, host_folder, links)
    task = make_task(folder, test_sh=f"echo {REAL_REWARD} > /logs/verifier/reward.txt\n",
                     toml='[environment]\nrootfs = "root"\nworkdir = "/work"\n')
    script = folder / "tests" / "test.sh"  # busybox has no bash
    script.write_text(f"#!/bin/sh\necho {REAL_REWARD} > /logs/verifier/reward.txt\n")
    owner = sandbox_user().uid if os.geteuid() == 0 else None
    env = prepare(task.source, Cache(tmp_path / "cache"), owner=owner)
    assert env.root is not None and all((env.root / name).is_symlink() for name in links)
    pristine = tree(env.root)
    look = ("cat /marker; for p in /run /run/trialledger /tmp /dev; do "
            "if [ -L $p ]; then echo LINK $p; elif [ -d $p ]; then echo DIR $p; fi; done")
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(look), message()],
                         environment=env, settings={"verifier_root": verifier_root})
    assert os.listdir(host_folder) == []  # bwrap made nothing on the host
    said = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert images.BUSYBOX_MARKER in said, (  # the agent ran, in the image
        ran.view.decision, [(g.code, g.detail) for g in ran.view.observations.gaps],
        [(e.type, e.data) for e in ran.view.events if e.type in ("agent.stderr", "model.call")])
    for point in ("/run", "/run/trialledger", "/tmp", "/dev"):  # the agent's mount points
        assert f"DIR {point}" in said and f"LINK {point}" not in said, said
    # the verifier's: the task's tests ran (not the image's), their reward reached our logs
    assert ran.view.rewards == {"reward": float(REAL_REWARD)}
    assert tree(env.root) == pristine  # the image itself is untouched: only the layer changed
