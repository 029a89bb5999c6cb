"""Session limits with cgroups (SPEC §11, §12).

This machine's cgroup v2 hierarchy has none of the cpu, memory and pids controllers (they
are bound to cgroup v1), and a test must not create cgroups on the host, so what runs here
is what needs no delegated cgroup: the values written, the refusal of anything that is not
a delegated cgroup v2 folder, the init's join (which must hold the sandbox back when it
fails), and the record a session makes when its limits are not enforced.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trialledger.adapters.sandbox import cgroup
from trialledger.adapters.sandbox.hostside import program
from trialledger.adapters.sandbox.identity import SandboxUser, ensure_init


@given(cpus=st.floats(min_value=0.01, max_value=512), memory_mb=st.integers(1, 1 << 20),
       pids=st.integers(1, 1 << 22))
def test_the_written_limits_are_the_requested_ones(cpus: float, memory_mb: int, pids: int
                                                    ) -> None:
    files = cgroup.settings({"cpus": cpus, "memory_mb": memory_mb, "pids": pids})
    quota, period = map(int, files["cpu.max"].split())
    assert abs(quota / period - cpus) <= 0.5 / period + 1e-12
    assert int(files["memory.max"]) == memory_mb * 1024 * 1024
    assert files["memory.swap.max"] == "0"  # swap must not lift the memory limit
    assert files["pids.max"] == str(pids)


def test_only_what_is_requested_is_written() -> None:
    assert cgroup.settings({"pids": 64}) == {"pids.max": "64"}
    assert cgroup.settings({"cpus": 0.001}) == {"cpu.max": "1000 100000"}  # the least quota


def test_no_delegation_and_a_lookalike_folder_are_refused(tmp_path: Path) -> None:
    with pytest.raises(cgroup.LimitsNotEnforced, match="TRIALLEDGER_CGROUP is unset"):
        cgroup.delegated({})
    for name in ("cgroup.subtree_control", "cgroup.controllers", "cgroup.procs"):
        (tmp_path / name).write_text("cpu memory pids\n")
    with pytest.raises(cgroup.LimitsNotEnforced, match="is not a cgroup v2 folder"):
        cgroup.SessionCgroup.create({"cpus": 1}, "s" * 16,
                                    {cgroup.DELEGATED_ENV: str(tmp_path)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cgroup.controllers", "cgroup.procs", "cgroup.subtree_control"]  # nothing made


def test_a_real_cgroup2_mount_is_taken_as_delegated() -> None:
    """Only looked at: nothing is created or enabled by `delegated`."""
    with open("/proc/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[2] == "cgroup2"]
    if not points:  # no cgroup v2 on this kernel: nothing may pass for one
        with pytest.raises(cgroup.LimitsNotEnforced, match="not a cgroup v2 folder"):
            cgroup.delegated({cgroup.DELEGATED_ENV: "/sys/fs/cgroup"})
        return
    assert cgroup.delegated({cgroup.DELEGATED_ENV: points[0]}) == Path(points[0])


def test_the_init_joins_the_cgroup_before_anything_starts(tmp_path: Path) -> None:
    procs, ran = tmp_path / "cgroup.procs", tmp_path / "ran"
    procs.write_text("")
    me = SandboxUser(os.geteuid(), os.getegid())  # no drop: only the join is tested
    stage = me.staged(ensure_init(), cgroups=[procs])
    assert stage[stage.index("--stage") + 1:][:2] == ["--cgroup", str(procs)]
    subprocess.run([*stage, program("touch"), str(ran)], check=True, timeout=10)
    assert procs.read_text() == "0" and ran.exists()  # "0": the writer itself joins
    ran.unlink()
    missing = tmp_path / "none" / "procs"
    done = subprocess.run([*me.staged(ensure_init(), cgroups=[missing]),
                           program("touch"), str(ran)], capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 125 and "join the cgroup" in done.stderr
    assert not ran.exists()  # a sandbox that cannot be held is not started
    done = subprocess.run([*stage, "touch", str(ran)], capture_output=True, text=True,
                          timeout=10)  # never a PATH search on the host side
    assert done.returncode == 125 and "not an absolute path" in done.stderr
    assert not ran.exists()


def test_without_any_pids_controller_the_shared_limit_is_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner with neither a delegated folder nor (root) a v1 hierarchy: nothing is made,
    and the session's record says its process limit is the uid's, shared."""
    monkeypatch.setattr(cgroup, "v1_hierarchies", lambda: {})
    made, why = cgroup.hold({}, "s" * 16, {})
    assert made is None and why is not None and "shared" in why
    made, why = cgroup.hold({"cpus": 1}, "s" * 16, {})
    assert made is None and why is not None and "TRIALLEDGER_CGROUP is unset" in why


def test_v1_files_are_written_in_an_order_the_kernel_takes() -> None:
    files = cgroup.settings_v1({"cpus": 0.5, "memory_mb": 64, "pids": 10})
    assert list(files["cpu"]) == ["cpu.cfs_period_us", "cpu.cfs_quota_us"]
    assert files["cpu"]["cpu.cfs_quota_us"] == "50000"
    assert list(files["memory"]) == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    assert files["pids"] == {"pids.max": "10"}
