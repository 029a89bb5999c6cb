"""Range mode on an OCI runtime (SPEC §16), its pure part: Docker's pinned seccomp profile
converted as moby does, Docker's defaults, and a container's `config.json` — then one real
container under runc, and `setup`'s probe of which runtime can start one here.

CI installs runc (`.ci/run`) and runs `trialledger setup`: the real tests fail (never skip)
where runc cannot start a container.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import images
from trialledger.adapters.sandbox import oci
from trialledger.adapters.sandbox.bwrap import INIT_INSIDE
from trialledger.adapters.sandbox.cgroup import DEFAULT_PIDS
from trialledger.adapters.sandbox.idrange import (
    DOCKER_CAPS,
    SLOT,
    InnerUser,
    Slot,
    reserved_range,
)
from trialledger.adapters.sandbox.ociruntime import (
    host_kernel,
    host_nofile,
    host_seccomp,
    run_once,
    runtime_problem,
)
from trialledger.adapters.sandbox.runclaunch import container_limits, pid1_argv

PROFILE_SHA256 = "9c1025c88ccaa517b648da571961838744ea2137f176bfe6a48b21294cae9c76"
DOCKER_CAP_MASK = "00000000a80425fb"  # CapEff of root in a default Docker container
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
EPERM, ENOSYS = 1, 38
CURRENT = (6, 1)
# SPEC §15's refusals to a container without CAP_SYS_ADMIN (each stays a test here).
REFUSED = ("unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "fsmount", "fspick",
           "open_tree", "move_mount", "mount_setattr", "keyctl", "add_key", "request_key",
           "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
           "finit_module", "delete_module", "swapon", "swapoff", "reboot", "acct",
           "settimeofday", "clock_settime", "open_by_handle_at", "lookup_dcookie")


def _arg_matches(arg: dict[str, Any], values: Sequence[int]) -> bool:
    value = values[arg["index"]] if arg["index"] < len(values) else 0
    op, want = arg["op"], arg["value"]
    tests = {"SCMP_CMP_EQ": value == want, "SCMP_CMP_NE": value != want,
             "SCMP_CMP_MASKED_EQ": value & want == arg.get("valueTwo", 0)}
    return bool(tests[op])


def verdict(seccomp: dict[str, Any], name: str, *args: int) -> int | None:
    """What the converted filter does to `name(args)`: None allows, else the errno."""
    matched = [rule for rule in seccomp["syscalls"] if name in rule["names"]
               and all(_arg_matches(arg, args) for arg in rule.get("args", ()))]
    if any(rule["action"] == "SCMP_ACT_ALLOW" for rule in matched):
        return None
    for rule in matched:
        return int(rule.get("errnoRet", EPERM))
    assert seccomp["defaultAction"] == "SCMP_ACT_ERRNO"
    return int(seccomp["defaultErrnoRet"])


def converted(*extra_caps: str, arch: str = "x86_64",
              kernel: tuple[int, int] | None = CURRENT) -> dict[str, Any]:
    return oci.docker_seccomp(oci.docker_profile(), [*oci.docker_caps(False), *extra_caps],
                              arch, kernel)


def test_the_pinned_profile_is_mobys_file_as_recorded() -> None:
    digest = hashlib.sha256(oci.PROFILE.read_bytes()).hexdigest()
    assert digest == PROFILE_SHA256
    note = Path(__file__).parents[2] / "adapters" / "sandbox" / "seccomp" / "README.md"
    assert PROFILE_SHA256 in note.read_text()  # its source, release and digest


@pytest.mark.parametrize("name", REFUSED)
def test_docker_default_caps_refuse_what_spec_15_lists(name: str) -> None:
    for allowlist in (False, True):
        seccomp = oci.docker_seccomp(oci.docker_profile(), oci.docker_caps(allowlist))
        assert verdict(seccomp, name) == EPERM, (name, allowlist)


@pytest.mark.parametrize(("call", "args", "caps", "kernel", "expected"), [
    ("clone", (SIGCHLD,), (), CURRENT, None),
    ("clone", (CLONE_NEWUSER | SIGCHLD,), (), CURRENT, EPERM),
    ("clone", (CLONE_NEWNS | SIGCHLD,), (), CURRENT, EPERM),
    ("clone", (CLONE_NEWUSER | SIGCHLD,), ("CAP_SYS_ADMIN",), CURRENT, None),
    ("clone3", (), (), CURRENT, ENOSYS),  # its flags cannot be filtered: glibc falls back
    ("clone3", (), ("CAP_SYS_ADMIN",), CURRENT, None),
    ("mount", (), ("CAP_SYS_ADMIN",), CURRENT, None),
    ("unshare", (), ("CAP_SYS_ADMIN",), CURRENT, None),
    ("pivot_root", (), ("CAP_SYS_ADMIN",), CURRENT, EPERM),  # never, whatever the caps
    ("keyctl", (), ("CAP_SYS_ADMIN",), CURRENT, EPERM),
    ("ptrace", (), (), CURRENT, None),  # allowed since kernel 4.8 (seccomp bypass fixed)
    ("ptrace", (), (), (4, 4), EPERM),
    ("process_vm_readv", (), (), (4, 4), EPERM),
    ("ptrace", (), ("CAP_SYS_PTRACE",), (4, 4), None),
    ("process_vm_readv", (), ("CAP_SYS_PTRACE",), (4, 4), None),
    ("kcmp", (), (), CURRENT, EPERM),
    ("kcmp", (), ("CAP_SYS_PTRACE",), CURRENT, None),
    ("pidfd_getfd", (), ("CAP_SYS_PTRACE",), CURRENT, None),
    ("personality", (0,), (), CURRENT, None),  # PER_LINUX
    ("personality", (0x0008,), (), CURRENT, None),  # PER_LINUX32
    ("personality", (0xFFFFFFFF,), (), CURRENT, None),  # a query
    ("personality", (0x0040000,), (), CURRENT, EPERM),  # ADDR_NO_RANDOMIZE: setarch -R
    ("socket", (2,), (), CURRENT, None),  # AF_INET
    ("socket", (40,), (), CURRENT, EPERM),  # AF_VSOCK
    ("chroot", (), (), CURRENT, None),  # CAP_SYS_CHROOT is one of Docker's
    ("arch_prctl", (), (), CURRENT, None),
    ("open_by_handle_at", (), ("CAP_DAC_READ_SEARCH",), CURRENT, None),
    ("reboot", (), ("CAP_SYS_BOOT",), CURRENT, None),
    ("settimeofday", (), ("CAP_SYS_TIME",), CURRENT, None),
    ("bpf", (), ("CAP_BPF",), CURRENT, None),
    ("perf_event_open", (), ("CAP_PERFMON",), CURRENT, None),
])
def test_the_profile_resolves_as_moby_resolves_it(
        call: str, args: tuple[int, ...], caps: tuple[str, ...],
        kernel: tuple[int, int], expected: int | None) -> None:
    assert verdict(converted(*caps, kernel=kernel), call, *args) == expected


def test_a_capability_drops_the_rules_it_excludes() -> None:
    # libseccomp takes one action per syscall and argument values: an ALLOW beside
    # clone3's ENOSYS or clone's flag filter would be a conflict, not a wider filter.
    for call in ("clone", "clone3"):
        rules = [rule for rule in converted("CAP_SYS_ADMIN")["syscalls"]
                 if call in rule["names"]]
        assert rules == [{"names": rules[0]["names"], "action": "SCMP_ACT_ALLOW"}], rules


def test_an_unknown_kernel_counts_as_a_current_one() -> None:
    assert verdict(converted(kernel=None), "ptrace") is None


def test_the_native_architecture_and_its_sub_architectures_are_filtered() -> None:
    x86 = converted()
    assert x86["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    assert (x86["defaultAction"], x86["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", EPERM)
    arm = converted(arch="aarch64")
    assert arm["architectures"] == ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]
    assert verdict(arm, "arch_prctl") == EPERM and verdict(arm, "set_tls") is None
    assert converted(arch="riscv64")["architectures"] == ["SCMP_ARCH_RISCV64"]
    # s390's clone takes its flags second: only that rule applies there.
    s390 = converted(arch="s390x")
    assert [rule["args"][0]["index"] for rule in s390["syscalls"]
            if "clone" in rule["names"]] == [1]
    assert verdict(s390, "clone", 0, CLONE_NEWUSER | SIGCHLD) == EPERM
    # Only what the OCI runtime reads is left: moby's conditions are resolved away.
    assert set(x86) == {"defaultAction", "defaultErrnoRet", "architectures", "syscalls"}
    assert all(set(rule) <= {"names", "action", "errnoRet", "args"}
               for rule in x86["syscalls"])


@pytest.mark.parametrize(("profile", "arch", "says"), [
    ({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}, "vax", "unknown architecture"),
    ({"architectures": ["SCMP_ARCH_X86_64"], "archMap": [{"architecture": "SCMP_ARCH_X86_64"}],
      "syscalls": []}, "x86_64", "both 'architectures' and 'archMap'"),
    ({"syscalls": [{"name": "read", "names": ["write"], "action": "SCMP_ACT_ALLOW"}]},
     "x86_64", "both 'name' and 'names'"),
    ({"syscalls": [{"names": ["ptrace"], "action": "SCMP_ACT_ALLOW",
                    "includes": {"minKernel": "4"}}]}, "x86_64", "invalid kernel version"),
])
def test_a_profile_moby_would_refuse_is_refused(profile: dict[str, Any], arch: str,
                                                 says: str) -> None:
    with pytest.raises(oci.ProfileRejected, match=says):
        oci.docker_seccomp(profile, oci.docker_caps(False), arch, CURRENT)


def test_dockers_capabilities_less_net_raw_under_allowlist() -> None:
    assert oci.docker_caps(False) == list(DOCKER_CAPS)
    assert len(DOCKER_CAPS) == bin(int(DOCKER_CAP_MASK, 16)).count("1")
    assert oci.docker_caps(True) == [cap for cap in DOCKER_CAPS if cap != "CAP_NET_RAW"]


def test_dockers_nofile_only_where_the_host_hard_limit_allows_it() -> None:
    assert oci.docker_nofile(524_288) == (1024, 524_288)
    assert oci.docker_nofile(1 << 20) == (1024, 524_288)
    assert oci.docker_nofile(20_000) is None  # this machine's: left as inherited


def test_dockers_mounts() -> None:
    mounts = {m["destination"]: m for m in oci.docker_mounts()}
    assert list(mounts) == ["/proc", "/dev", "/dev/pts", "/sys", "/sys/fs/cgroup",
                            "/dev/mqueue", "/dev/shm"]
    assert "ro" in mounts["/sys"]["options"] and "ro" in mounts["/sys/fs/cgroup"]["options"]
    assert mounts["/dev/shm"]["options"][-1] == "size=67108864"
    assert "/proc/kcore" in oci.MASKED_PATHS and "/proc/sys" in oci.READONLY_PATHS


def spec(**changes: Any) -> oci.ContainerSpec:
    fields: dict[str, Any] = {
        "root": "/srv/merged", "args": ("/bin/sh", "-c", "echo $TOKEN"),
        "env": {"PATH": "/usr/bin:/bin", "TOKEN": "s3cret value"},
        "seccomp": converted(), "ids": (1_048_576, SLOT), "cwd": "/app", "uid": 1000,
        "gid": 1000, "additional_gids": (27, 100), "hostname": "task",
        "userns": "/proc/4242/ns/user", "netns": "/proc/4242/ns/net",
        "cgroups_path": "/trialledger/s1",
        "limits": {"pids": 64, "memory_mb": 512, "cpus": 1.5},
        "binds": (oci.Bind("/opt/codex", "/opt/codex", True),
                  oci.Bind("/var/tmp/s1/logs", "/logs/agent", False)),
        "tmpfs": ("/var/tmp/s1/home/skills",),  # after the binds: one may lie in a bind
        "nofile": (1024, 524_288)}
    return oci.ContainerSpec(**{**fields, **changes})


def test_a_config_is_an_oci_1_0_2_document_of_the_spec() -> None:
    config = json.loads(json.dumps(oci.container_config(spec())))
    assert config["ociVersion"] == "1.0.2"
    assert config["root"] == {"path": "/srv/merged", "readonly": False}
    process = config["process"]
    assert process["args"] == ["/bin/sh", "-c", "echo $TOKEN"]
    assert process["env"] == ["PATH=/usr/bin:/bin", "TOKEN=s3cret value"]
    assert process["user"] == {"uid": 1000, "gid": 1000, "additionalGids": [27, 100]}
    assert (process["cwd"], process["noNewPrivileges"], process["terminal"]) == (
        "/app", False, False)
    assert all(process["capabilities"][kind] == list(DOCKER_CAPS)
               for kind in ("bounding", "effective", "permitted"))
    assert process["rlimits"] == [{"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 524_288}]
    linux = config["linux"]
    assert linux["namespaces"] == [
        {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
        {"type": "user", "path": "/proc/4242/ns/user"},
        {"type": "network", "path": "/proc/4242/ns/net"}]
    assert linux["uidMappings"] == linux["gidMappings"] == [
        {"containerID": 0, "hostID": 1_048_576, "size": SLOT}]
    assert linux["cgroupsPath"] == "/trialledger/s1"
    resources = linux["resources"]
    assert resources["pids"] == {"limit": 64}
    assert resources["memory"] == {"limit": 512 << 20, "swap": 512 << 20}
    assert resources["cpu"] == {"quota": 150_000, "period": 100_000}
    devices = resources["devices"]
    assert devices[0] == {"allow": False, "access": "rwm"}  # nothing, then Docker's few
    assert {(d["major"], d["minor"]) for d in devices if d["allow"]} == {
        (1, 3), (1, 5), (1, 8), (1, 9), (5, 0), (5, 1)}
    assert devices[-1] == {"allow": False, "type": "c", "major": 10, "minor": 229,
                           "access": "rwm"}  # never /dev/net/tun
    assert linux["seccomp"] == converted()
    assert linux["maskedPaths"] == list(oci.MASKED_PATHS)
    assert linux["readonlyPaths"] == list(oci.READONLY_PATHS)
    binds = [m for m in config["mounts"] if m["type"] == "bind"]
    assert [(m["source"], m["destination"], "ro" in m["options"]) for m in binds] == [
        ("/opt/codex", "/opt/codex", True), ("/var/tmp/s1/logs", "/logs/agent", False)]
    assert all({"nosuid", "nodev"} <= set(m["options"]) for m in binds)
    assert config["mounts"][-1] == {"destination": "/var/tmp/s1/home/skills", "type": "tmpfs",
                                    "source": "tmpfs", "options": ["nosuid", "nodev", "mode=755"]}
    # The environment's values are only in process.env, never in a command line.
    assert not any("s3cret" in arg for arg in process["args"])


def test_the_hosts_profile_is_converted_once_and_no_config_changes_it() -> None:
    """Every container of a session (and every session) with the same capabilities shares
    one conversion of the profile; a config made from it is a copy, so whatever changes a
    config leaves the next container's profile as moby converts it."""
    caps = oci.docker_caps(False)
    shared = host_seccomp(caps)
    assert host_seccomp(list(caps)) is shared
    expected = oci.docker_seccomp(oci.docker_profile(), caps, os.uname().machine,
                                  host_kernel())
    config = oci.container_config(spec(seccomp=shared))
    config["linux"]["seccomp"]["syscalls"][0]["names"].append("mutated")
    config["linux"]["seccomp"]["syscalls"].clear()
    assert host_seccomp(caps) == expected


def test_pid1_and_the_limits_are_planned_without_the_runtime() -> None:
    """What runclaunch hands runc, made by pure functions: PID 1 (our init) holds the
    lifeline on 3, a lease's switch on 4 only with a lease, a compose service's gate on
    the next, drops to the phase's user
    and groups, and carries no environment; the cgroup gets Docker's default `pids` unless
    the task sets one, and only the limits a container's cgroup holds."""
    user = InnerUser(1000, 1000, (27, 100))
    plain = pid1_argv(["sh", "-c", "true"], user, oom_score_adj=None, deadline_ms=None)
    assert plain == [INIT_INSIDE, "--lifeline-fd", "3", "--user", "1000", "1000", "27,100",
                     "--", "sh", "-c", "true"]
    leased = pid1_argv(["true"], InnerUser(0, 0), oom_score_adj=1000, deadline_ms=1500)
    assert leased == [INIT_INSIDE, "--lifeline-fd", "3", "--oom-score-adj", "1000",
                      "--deadline-fd", "4", "--deadline-ms", "1500", "--user", "0", "0", "-",
                      "--", "true"]
    # a bridged compose service's gate: the descriptor after the others runc passes on
    assert pid1_argv(["true"], InnerUser(0, 0), oom_score_adj=None, deadline_ms=None,
                     gated=True)[:5] == [INIT_INSIDE, "--lifeline-fd", "3", "--gate-fd", "4"]
    assert pid1_argv(["true"], InnerUser(0, 0), oom_score_adj=None, deadline_ms=9,
                     gated=True)[5:9] == ["--deadline-ms", "9", "--gate-fd", "5"]
    assert container_limits({}) == {"pids": float(DEFAULT_PIDS)}
    assert container_limits({"pids": 64, "memory_mb": 512, "cpus": 1.5, "storage_mb": 9}) == {
        "pids": 64, "memory_mb": 512, "cpus": 1.5}


def test_a_config_leaves_out_what_the_spec_does_not_ask_for() -> None:
    config = oci.container_config(spec(userns=None, netns=None, cgroups_path=None, limits={},
                                       nofile=None, additional_gids=(),
                                       no_new_privileges=True))
    assert config["linux"]["namespaces"][-2:] == [{"type": "user"}, {"type": "network"}]
    assert "cgroupsPath" not in config["linux"] and "rlimits" not in config["process"]
    assert set(config["linux"]["resources"]) == {"devices"}
    assert "additionalGids" not in config["process"]["user"]
    assert config["process"]["noNewPrivileges"] is True
    unaccounted = oci.container_config(spec(swap_accounted=False))
    assert unaccounted["linux"]["resources"]["memory"] == {"limit": 512 << 20}


@pytest.mark.parametrize(("changes", "says"), [
    ({"env": {"A=B": "x"}}, "environment variable"),
    ({"env": {"A": "x\0y"}}, "environment variable"),
    ({"cwd": "app"}, "not an absolute path"),
    ({"binds": (oci.Bind("rel", "/x", True),)}, "not an absolute path"),
    ({"args": ()}, "needs a command"),
    ({"ids": (1_048_576, 0)}, "id map"),
])
def test_a_config_no_runtime_could_start_is_refused(changes: dict[str, Any],
                                                     says: str) -> None:
    with pytest.raises(oci.ConfigRejected, match=says):
        oci.container_config(spec(**changes))


@pytest.fixture
def slot() -> Iterator[Slot]:
    ids = reserved_range()
    assert ids is not None, "CI's `trialledger setup` reserves the sandbox user's range"
    held = Slot.acquire(ids)
    try:
        yield held
    finally:
        held.release()


def test_runc_runs_a_busybox_container_as_docker_would(slot: Slot) -> None:
    # /tmp itself: the slot's root must be able to reach the rootfs (pytest's tmp is 0700).
    bundle = Path(tempfile.mkdtemp(prefix="trialledger-test-oci-"))
    try:
        rootfs = bundle / "rootfs"
        shutil.copytree(images.busybox_root(), rootfs, symlinks=True)
        for path in [bundle, rootfs, *rootfs.rglob("*")]:  # shifted onto the slot
            info = os.lstat(path)
            os.lchown(path, slot.host(info.st_uid), slot.host(info.st_gid))
        caps = oci.docker_caps(allowlist=False)
        script = ("id; cat /proc/self/uid_map; cat /proc/self/status; echo MASKED; "
                  "for p in /proc/kcore /proc/keys /proc/timer_list /proc/acpi /sys/firmware; "
                  "do [ -e $p ] && stat -c '%n %F %t:%T' $p && ls -A $p | head -3; done")
        config = oci.container_config(oci.ContainerSpec(
            root=str(rootfs), args=("/bin/busybox", "sh", "-c", script),
            env={"PATH": "/bin"}, seccomp=host_seccomp(caps), caps=tuple(caps),
            ids=(slot.start, SLOT), nofile=host_nofile(), limits={"pids": 32},
            cgroups_path=f"/trialledger/test-oci-{os.getpid()}"))
        done = run_once("runc", bundle, config, deadline_s=60)
    finally:
        shutil.rmtree(bundle)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("uid=0(root) gid=0(root)"), out
    assert out.splitlines()[1].split() == ["0", str(slot.start), str(SLOT)], out  # not host root
    status = dict(line.split(":\t", 1) for line in out.split("MASKED")[0].splitlines()
                  if ":\t" in line)
    assert status["CapEff"] == status["CapBnd"] == DOCKER_CAP_MASK, out
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("0", "2"), out
    masked = out.split("MASKED")[1]
    # Masked files are /dev/null, masked folders empty. (This machine's kernel has no
    # /proc/kcore: where it has one, it is masked as /proc/keys is.)
    assert "/proc/keys character special file 1:3" in masked, masked
    assert "/sys/firmware directory" in masked and "/proc/acpi directory" in masked, masked
    if Path("/proc/kcore").exists():
        assert "/proc/kcore character special file 1:3" in masked, masked
    # Each line names a path: `ls -A` found nothing in a masked folder.
    assert all(line.startswith("/") for line in masked.strip().splitlines()), masked


def test_setup_finds_that_runc_starts_a_container_here() -> None:
    assert runtime_problem("runc") is None
    assert "unknown OCI runtime" in (runtime_problem("docker") or "")


def test_setup_records_the_first_runtime_that_starts_a_container_and_runs_use_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`setup` checks runc, then crun, and records the first able one as range mode's
    runtime; a run naming a runtime it found unable is refused in one line (exit 2)."""
    from tests.runs import make_task
    from trialledger import cli
    from trialledger.adapters.sandbox import ociruntime
    from trialledger.adapters.sandbox.runc import default_runtime

    monkeypatch.setattr(ociruntime, "records_dir", lambda: tmp_path / "records")
    # Never recorded (a `setup` from before the choice): the first not recorded unable.
    assert ociruntime.chosen_runtime() == ("runc", None)
    found = ociruntime.choose_runtime(None)
    assert list(found) == ["runc", "crun"] and found["runc"] is None, found
    # crun 1.8 refuses these machines' hybrid cgroups (where it is installed at all).
    said = found["crun"]
    assert said is not None and said.startswith("crun "), said
    assert ociruntime.chosen_runtime() == ("runc", None) and default_runtime() == "runc"
    task = make_task(tmp_path / "task", test_sh="exit 0\n", solve_sh="#!/bin/sh\n")
    code = cli.main(["run", str(task.folder), "--agent", "oracle", "--db",
                     str(tmp_path / "t.db"), "--runtime", "crun"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--runtime crun: {said}" in err, err
    # Asked for crun alone, setup records that no runtime can start a container here.
    assert ociruntime.choose_runtime("crun") == {"crun": said}
    assert ociruntime.chosen_runtime() == (None, said) and default_runtime() is None
