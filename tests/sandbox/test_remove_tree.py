"""Removing folders the agent could write (a session's folders, `/logs/verifier`, an
overlay's layers): whole, never following a link out, never crossing into another file
system; small trees in-process, deep or wide ones by `rm`, which does not recurse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trialledger.adapters.sandbox.folders import (
    IN_PROCESS_DEPTH,
    IN_PROCESS_ENTRIES,
    remove_tree,
)

# A tree: each entry a file, a link out of the tree, or a folder of more entries.
TREES = st.recursive(
    st.sampled_from(["file", "link-out", "link-to-file-out"]),
    lambda children: st.dictionaries(st.text("abcdef", min_size=1, max_size=4), children,
                                     max_size=4),
    max_leaves=30)


def build(folder: Path, tree: object, outside: Path) -> None:
    assert isinstance(tree, dict)
    folder.mkdir()
    for name, child in tree.items():
        path = folder / name
        if child == "file":
            path.write_text("x")
        elif child == "link-out":
            path.symlink_to(outside)
        elif child == "link-to-file-out":
            path.symlink_to(outside / "keep")
        else:
            build(path, child, outside)


def outside_folder(root: Path) -> Path:
    outside = root / "outside"
    (outside / "inner").mkdir(parents=True)
    (outside / "keep").write_text("kept")
    (outside / "inner" / "keep").write_text("kept")
    return outside


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(st.text("abcdef", min_size=1, max_size=4), TREES, max_size=5))
def test_a_tree_goes_whole_and_what_its_links_point_at_stays(
        tmp_path_factory: pytest.TempPathFactory, tree: dict[str, object]) -> None:
    root = tmp_path_factory.mktemp("remove")
    outside = outside_folder(root)
    build(root / "tree", tree, outside)
    (root / "top-link").symlink_to(outside)
    remove_tree(root / "tree", root / "top-link")
    assert sorted(os.listdir(root)) == ["outside"]
    assert (outside / "keep").read_text() == (outside / "inner" / "keep").read_text() == "kept"


@pytest.mark.parametrize("shape", ["deep", "very deep", "wide"])
def test_trees_past_the_in_process_bounds_go_whole(tmp_path: Path, shape: str) -> None:
    """Deeper than `IN_PROCESS_DEPTH` (and than Python's recursion limit), or with more
    entries than `IN_PROCESS_ENTRIES`: what the in-process walk leaves, `rm` removes."""
    top = tmp_path / "tree"
    top.mkdir()
    if shape == "wide":
        for index in range(IN_PROCESS_ENTRIES + 100):
            (top / f"f{index}").touch()
    else:
        levels = IN_PROCESS_DEPTH + 8 if shape == "deep" else sys.getrecursionlimit() + 100
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(levels):  # by fd: the path grows past PATH_MAX
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(fd)
    remove_tree(top)
    assert not top.exists()


def test_another_file_system_below_is_left_and_said(tmp_path: Path) -> None:
    """A file system mounted inside (in a mount namespace of the test's own, so the host
    is untouched) is not entered: its file stays and the removal raises."""
    (tmp_path / "tree" / "sub" / "mnt").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "file").write_text("x")
    script = (f"mount -t tmpfs none {tmp_path}/tree/sub/mnt && "
              f"echo kept > {tmp_path}/tree/sub/mnt/keep && "
              f"{sys.executable} -c 'import sys; from trialledger.adapters.sandbox.folders "
              f"import remove_tree\ntry:\n    remove_tree(sys.argv[1])\nexcept OSError as e:\n"
              f"    print(\"refused\", e)' {tmp_path}/tree; cat {tmp_path}/tree/sub/mnt/keep")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "refused" in done.stdout and done.stdout.rstrip().endswith("kept"), done.stdout
    assert not (tmp_path / "tree" / "sub" / "file").exists()
