"""What a killed run leaves on the machine is removed by the next run or `recover`, and
only what belongs to a runner that is provably gone (docs/SPEC.md §11 "Leftovers"): a
session's cgroups, a build's cgroup, processes and folder, and its working containers.
Runners are SIGKILLed for real; real cgroups, podman and buildah."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import images
from tests.environments.test_builds import (
    builder,
    containers,
    dockerfile_task,
    running,
    still_running,
)
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from tests.runs import in_process
from trialledger.adapters.images import build
from trialledger.adapters.images.buildbox import build_alive, working_containers
from trialledger.adapters.images.builder import Builder
from trialledger.adapters.images.environment import Cache
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox import leftovers
from trialledger.adapters.sandbox.cgroup import build_cgroups
from trialledger.adapters.sandbox.local import LocalSandbox

__all__ = ["builder"]  # (a fixture of test_builds.py, used here)
DEADLINE_S = 120.0


def test_a_killed_runners_session_cgroups_go_and_a_live_ones_stay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live = LocalSandbox(session_key="live-one", workdir="/app")
    crash = (f"import tempfile, os, signal, json; tempfile.tempdir = {str(tmp_path)!r}\n"
             "from trialledger.adapters.sandbox.local import LocalSandbox\n"
             "s = LocalSandbox(session_key='crashed', workdir='/app')\n"
             "print(json.dumps([str(p) for p in s.cgroup.paths]), flush=True)\n"
             "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True,
                          timeout=60, check=False)
    left = [Path(p) for p in json.loads(done.stdout)]
    try:
        assert left and all(p.is_dir() for p in left)  # what the killed runner left
        assert live.cgroup is not None and all(p.is_dir() for p in live.cgroup.paths)
        monkeypatch.setattr(leftovers, "STALE_S", 0.0)  # (no waiting for them to age)
        assert leftovers.sweep_session_cgroups() >= len(left)
        assert not any(p.exists() for p in left)
        assert all(p.is_dir() for p in live.cgroup.paths)  # its runner holds its folder
    finally:
        live.discard()


@pytest.mark.alone  # another process's first build would sweep the killed build first
def test_a_build_killed_with_its_runner_is_ended_by_the_next_recover(
        tmp_path: Path, builder: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"{4000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"  # sleep's argument
    base = images.podman_image(images.BUSYBOX_REF)
    dockerfile_task(tmp_path / "task", f"FROM {base}\nRUN sleep {marker}\n")
    runner = (f"from pathlib import Path\n"
              f"from trialledger.adapters.images.environment import Cache, Source\n"
              f"from trialledger.adapters.images.prepare import prepare\n"
              f"prepare(Source('dockerfile', 'Dockerfile', Path({str(tmp_path / 'task')!r}), "
              f"600), Cache(Path({str(tmp_path / 'cache')!r})), owner=None)\n")
    process = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not running(f"sleep {marker}") and time.monotonic() < deadline:
            assert process.poll() is None, "the build ended before its RUN step ran"
            time.sleep(0.1)
        assert running(f"sleep {marker}"), "the RUN step never started"
    finally:
        process.send_signal(signal.SIGKILL)  # the runner dies; its build does not, alone
        process.wait(timeout=10)
    time.sleep(1)
    assert running(f"sleep {marker}"), "nothing was left to clean up"
    dead = [c for c in build_cgroups()  # (builds of other images may run meanwhile)
            if c.members() and not build_alive(builder, c.name)]
    killed = {f for f in os.listdir(builder.scratch)  # (another test may be building)
              if f.startswith("trialledger-build-") and not build_alive(builder, f)}
    assert killed
    done = in_process("recover", "--all", "--db", str(tmp_path / "t.db"))
    assert done.returncode == 0, done.stderr
    assert "killed builds' leftovers removed" in done.stdout
    assert still_running(f"sleep {marker}", within_s=10) == []
    assert not any(path.exists() for c in dead for path in c.paths)
    assert not killed & set(os.listdir(builder.scratch))
    # its working container goes with the next build (the first of a new process); only
    # the killed build's own are watched (other builds may run on the machine meanwhile)
    monkeypatch.setattr(build, "_swept", [])
    made = set(working_containers(builder, killed.__contains__))
    assert made and made <= containers(builder), "the killed build left no working container"
    prepare(dockerfile_task(tmp_path / "next", f"FROM {base}\nRUN true\n"),
            Cache(tmp_path / "cache"), owner=None)
    assert not made & containers(builder)
