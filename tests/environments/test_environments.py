"""Task environments (docs/SPEC.md §12): real images built offline from Debian packages
(tests/images.py), prepared into a cache, and run with the real Codex CLI under bwrap."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests import images
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from tests.runs import make_task, read_shell, run_task
from trialledger import cli
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.images import environment as environments
from trialledger.adapters.images import unpack
from trialledger.adapters.images.environment import Cache, Environment, EnvironmentUnavailable
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.tasks.task import Task, TaskInvalid

pytestmark = pytest.mark.anyio
DEBIAN_TEST = (f"grep -q {images.DEBIAN_MARKER} /etc/trialledger-marker && "
               "test \"$(cat /committed.txt)\" = 1 && echo 1 > /logs/verifier/reward.txt || "
               "echo 0 > /logs/verifier/reward.txt\n")
GIT_WORK = ("git init -q /repo && cd /repo && git config user.email a@b && "
            "git config user.name a && echo hi > f && git add f && git commit -qm first && "
            "git log --oneline | wc -l > /committed.txt && cat /etc/trialledger-marker")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Cache:
    return Cache(tmp_path_factory.mktemp("cache"))


def owner() -> int | None:
    return sandbox_user().uid if os.geteuid() == 0 else None


def task_with(folder: Path, source: str, *, test_sh: str, toml: str = "") -> Task:
    """A task folder whose environment is `source` (one of the §12 kinds)."""
    folder.mkdir(parents=True)
    env = "[environment]\n"
    if source == "docker_image":
        env += f'docker_image = "{images.podman_image(images.DEBIAN_REF)}"\n'
    elif source == "image_archive":
        images.oci_archive(images.DEBIAN_REF, folder / "image.tar")
        env += 'image_archive = "image.tar"\n'
    elif source == "rootfs_tarball":  # inside the task folder: a link out is refused
        try:
            os.link(images.debian_tarball(), folder / "root.tar")
        except OSError:  # another file system
            shutil.copy(images.debian_tarball(), folder / "root.tar")
        env += 'rootfs = "root.tar"\n'
    elif source == "rootfs_folder":
        shutil.copytree(images.busybox_root(), folder / "root", symlinks=True)
        env += 'rootfs = "root"\n'
    elif source == "dockerfile":
        images.podman_image(images.DEBIAN_REF)
        (folder / "environment").mkdir()
        (folder / "environment" / "Dockerfile").write_text(
            f"FROM {images.DEBIAN_REF}\nRUN echo built-by-the-dockerfile > /built.txt\n"
            "WORKDIR /srv/app\nENV GREETING=hello-from-the-dockerfile\n")
    return make_task(folder, test_sh=test_sh, toml=env + toml)


def tool_output(ran: Any) -> str:
    """What the session's tool calls printed; a session without one fails saying what it did."""
    calls = ran.view.observations.tool_calls
    assert calls and all(call.status == "completed" for call in calls), "\n".join(
        [repr(calls), f"endpoint saw {ran.endpoint.seen}"]
        + [f"{e.type}: {e.data!r}"[:600] for e in ran.view.events
                         if e.type != "item.updated"])
    return "\n".join(call.output for call in calls)


def launched(ran: Any) -> Any:
    return next(e.data for e in ran.view.events if e.type == "agent.launched")


def tree_digest(root: Path) -> str:
    """Every path, its owner, mode and bytes (links not followed)."""
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted([*dirs, *files]):
            path = os.path.join(folder, name)
            info = os.lstat(path)
            digest.update(f"{os.path.relpath(path, root)} {info.st_uid} {info.st_mode}".encode())
            if os.path.islink(path):
                digest.update(os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    digest.update(handle.read())
    return digest.hexdigest()


@pytest.mark.parametrize("source", ["docker_image", "image_archive", "rootfs_tarball",
                                    "dockerfile"])
async def test_each_source_runs_in_its_image_with_the_images_own_tools(
        tmp_path: Path, cache: Cache, source: str) -> None:
    test_sh = DEBIAN_TEST
    if source == "dockerfile":
        test_sh = "grep -q built-by-the-dockerfile /built.txt && " + test_sh
    task = task_with(tmp_path / "task", source, test_sh=test_sh)
    env = prepare(task.source, cache, owner=owner())
    db = tmp_path / "t.db"
    ran = await run_task(str(db), task, [read_shell(GIT_WORK), message()], environment=env)
    assert images.DEBIAN_MARKER in tool_output(ran)  # the agent ran in the image, with git
    assert ran.view.rewards == {"reward": 1.0}  # the verifier saw its commit and the marker
    assert not Path("/committed.txt").exists() and not Path("/repo").exists()
    kind = "rootfs" if source.startswith("rootfs") else "image"
    ref = {"docker_image": images.DEBIAN_REF, "image_archive": "image.tar",
           "rootfs_tarball": "root.tar", "dockerfile": "Dockerfile"}[source]
    recorded = launched(ran).environment
    assert recorded == {"kind": kind, "ref": ref, "digest": env.digest}
    assert env.digest is not None and env.digest.startswith("sha256:")
    expected_workdir = "/srv/app" if source == "dockerfile" else "/"
    assert launched(ran).workdir == expected_workdir  # the image's WorkingDir, else /
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT environment_ref, environment_digest FROM sessions").fetchone()
    assert row == (ref, env.digest)


async def test_a_rootfs_folder_is_packed_by_content_and_runs(tmp_path: Path, cache: Cache
                                                             ) -> None:
    test_sh = (f"grep -q made /made.txt && grep -q {images.BUSYBOX_MARKER} /marker && "
               "echo 1 > /logs/verifier/reward.txt\n")
    task = task_with(tmp_path / "task", "rootfs_folder", test_sh=test_sh)
    env = prepare(task.source, cache, owner=owner())
    again = prepare(task.source, cache, owner=owner())
    assert again.digest == env.digest and again.root == env.root  # same content, one entry
    ran = await run_task(str(tmp_path / "t.db"), task,
                         [read_shell("echo made > /made.txt; cat /marker"), message()],
                         environment=env)
    assert images.BUSYBOX_MARKER in tool_output(ran)
    assert ran.view.rewards == {"reward": 1.0}  # verified by busybox sh: there is no bash


async def test_a_busybox_only_image_launches_probes_and_verifies(tmp_path: Path, cache: Cache
                                                                ) -> None:
    root = images.busybox_root()
    assert not (root / "bin" / "bash").exists() and not (root / "usr").exists()
    env = unpack.prepare_rootfs(root, "root", cache, owner())
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("echo 0.5 > /logs/verifier/reward.txt\n")
    sandbox = LocalSandbox(session_key="busybox-probe", workdir="/", tests=tests,
                           environment=env)
    try:
        probe = await sandbox.probe(10)
        assert probe.alive, probe.detail  # our init is the probe: no program of the image
        run = await sandbox.verify(10)
        assert (run.return_code, run.timed_out) == (0, False)
        assert (run.logs / "reward.txt").read_text().strip() == "0.5"
    finally:
        sandbox.discard()


@pytest.mark.parametrize("inherit", [False, True])
async def test_the_images_workdir_user_and_env_are_honoured(
        tmp_path: Path, cache: Cache, inherit: bool) -> None:
    folder = tmp_path / "task"
    task = make_task(folder, test_sh="echo 1 > /logs/verifier/reward.txt\n",
                     toml=f'[environment]\ndocker_image = "{images.BUSYBOX_REF}"\n',
                     workspace={"given.txt": "from the workspace"})
    images.podman_image(images.BUSYBOX_REF)
    env = prepare(task.source, cache, owner=owner())
    probe = "pwd; id -u; echo FOO=$FOO; echo HOME=$HOME; cat given.txt"
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(probe), message()],
                         environment=env, settings={"inherit_sandbox_environment": inherit})
    lines = tool_output(ran).splitlines()
    assert lines[:2] == ["/work", "1000"]  # WorkingDir, and USER agent looked up in passwd
    assert ("FOO=from-the-image" in lines) is inherit  # Env reaches Codex only when inherited
    assert ("HOME=/home/agent" in lines) is inherit
    assert "from the workspace" in lines  # workspace/ lands on the image's workdir
    assert ran.view.rewards == {"reward": 1.0}
    assert launched(ran).identity == {"mode": "single", "user": "1000:1000"}
    (emulated,) = [g for g in ran.view.observations.gaps if g.code == "root_emulated"]
    assert "inner 1000:1000" in (emulated.detail or "")  # not a container's root, and said


async def test_an_explicit_workdir_wins_over_the_images(tmp_path: Path, cache: Cache) -> None:
    task = make_task(tmp_path / "task", test_sh="test -f /elsewhere/out && echo 1 > "
                     "/logs/verifier/reward.txt\n",
                     toml=f'[environment]\ndocker_image = "{images.BUSYBOX_REF}"\n'
                          f'workdir = "/elsewhere"\n')
    images.podman_image(images.BUSYBOX_REF)
    env = prepare(task.source, cache, owner=owner())
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell("pwd; touch out"), message()],
                         environment=env)
    assert tool_output(ran).splitlines()[0] == "/elsewhere"
    assert ran.view.rewards == {"reward": 1.0}


async def test_the_cache_and_the_host_are_unchanged_by_an_agent_that_writes_everywhere(
        tmp_path: Path, cache: Cache) -> None:
    task = task_with(tmp_path / "task", "rootfs_tarball", test_sh="exit 0\n")
    env = prepare(task.source, cache, owner=owner())
    assert env.root is not None
    before = tree_digest(env.root)
    name = f"pwned-{os.getpid()}"
    attack = (f"for d in / /etc /usr /usr/bin /bin /tmp /root /var /run /srv; do "
              f"echo x > $d/{name} && echo WROTE $d; done; "
              "mv /usr/share/doc /usr/share/gone && echo REMOVED; "
              "chmod 777 /etc/passwd && echo CHMOD")
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(attack), message()],
                         environment=env)
    out = tool_output(ran)
    assert "WROTE /etc" in out and "REMOVED" in out  # inside, it writes as in a container
    assert tree_digest(env.root) == before  # ... and nothing reaches the cache
    for folder in ("/", "/etc", "/usr", "/usr/bin", "/tmp", "/root", "/var", "/srv"):
        assert not os.path.lexists(os.path.join(folder, name)), folder  # nor the host


async def test_two_sessions_of_one_image_see_nothing_of_each_other(
        tmp_path: Path, cache: Cache) -> None:
    task = task_with(tmp_path / "task", "rootfs_folder", test_sh="exit 0\n")
    env = prepare(task.source, cache, owner=owner())
    outputs: dict[int, str] = {}

    async def one(n: int) -> None:
        step = (f"echo {n} > /mine-{n}; mkdir -p /tmp/t; echo {n} > /tmp/t/{n}; sleep 3; "
                f"ls / /tmp/t")
        ran = await run_task(str(tmp_path / f"t{n}.db"), task, [read_shell(step), message()],
                             environment=env)
        outputs[n] = tool_output(ran)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 1)
            tg.start_soon(one, 2)
    assert "mine-1" in outputs[1] and "mine-2" not in outputs[1]
    assert "mine-2" in outputs[2] and "mine-1" not in outputs[2]


async def test_an_image_contains_the_agent_like_the_host_sandbox(
        tmp_path: Path, cache: Cache, kept: list[LocalSandbox]) -> None:
    canary = tmp_path / "host-canary"
    canary.write_text("canary-host-secret-over-an-image")
    canary.chmod(0o600)
    task = task_with(tmp_path / "task", "rootfs_tarball", test_sh="exit 0\n")
    env = prepare(task.source, cache, owner=owner())
    attack = ("grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; "
              "test -w /proc/sys/kernel/core_pattern && echo WRITABLE core_pattern; "
              f"cat {canary} /proc/1/root{canary} 2>/dev/null && echo READ canary; "
              "unshare -U true 2>/dev/null && echo NESTED userns; "
              "mount -t tmpfs none /mnt 2>/dev/null && echo MOUNTED; "
              "mknod /tmp/disk b 8 0 2>/dev/null && echo MKNOD; "
              "touch /owned-by-the-agent; echo done")
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(attack), message()],
                         environment=env)
    out = tool_output(ran)
    assert out.strip().endswith("done"), out
    for said in ("WRITABLE", "READ canary", "canary-host-secret", "NESTED", "MOUNTED", "MKNOD"):
        assert said not in out, out
    assert all(line.split()[1] == "0" * 16 for line in out.splitlines()
               if line.startswith("Cap")), out
    (sandbox,) = kept  # root inside (the image's user) is the sandbox uid on the host:
    planted = os.lstat(sandbox.root / "upper" / "owned-by-the-agent")
    assert planted.st_uid == sandbox_user().uid != 0


def _run_cli(tmp_path: Path, task: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    db = tmp_path / "store.db"
    code = cli.main(["run", str(task), "--db", str(db), "--model-base-url",
                     "http://127.0.0.1:9", "--model", "m", "--cache-dir",
                     str(tmp_path / "cache")])
    assert not db.exists()  # refused before the store was opened: nothing seeded
    return code, capsys.readouterr().err


@pytest.mark.parametrize("broken", ["missing_image", "corrupt_archive", "failing_build",
                                    "escaping_path", "option_image"])
def test_an_environment_that_cannot_be_prepared_is_refused_before_seeding(
        tmp_path: Path, broken: str, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "task"
    toml = {"missing_image": 'docker_image = "localhost/no-such-image:1"',
            "corrupt_archive": 'image_archive = "broken.tar"',
            "failing_build": "", "escaping_path": 'rootfs = "../outside"',
            "option_image": 'docker_image = "--version"'}[broken]
    make_task(folder, test_sh="exit 0\n")
    (folder / "task.toml").write_text(f"[environment]\n{toml}\n")
    (folder / "broken.tar").write_bytes(os.urandom(4096))
    if broken == "failing_build":
        (folder / "environment").mkdir()
        (folder / "environment" / "Dockerfile").write_text(
            f"FROM {images.podman_image(images.DEBIAN_REF)}\nRUN exit 3\n")
    code, err = _run_cli(tmp_path, folder, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    said = {"missing_image": "docker_image localhost/no-such-image:1",
            "corrupt_archive": "image_archive broken.tar: neither an OCI archive nor",
            "failing_build": "environment/Dockerfile build",
            "escaping_path": "must be a path inside the task folder",
            # an image name never reads as the engine's option (`podman image inspect
            # --version` printed a version, taken for the image's id)
            "option_image": "'--version' is not an image name"}[broken]
    assert said in err, err


def test_a_task_names_at_most_one_source(tmp_path: Path) -> None:
    with pytest.raises(TaskInvalid, match="at most one environment source"):
        make_task(tmp_path / "t", toml='[environment]\nrootfs = "a"\nimage_archive = "b"\n')


def test_concurrent_preparations_unpack_an_image_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    archive = images.oci_archive(images.BUSYBOX_REF, tmp_path / "busybox.tar")
    cache = Cache(tmp_path / "cache")
    unpacks: list[str] = []
    real = unpack._unpack_layout

    def counted(*args: Any, **kwargs: Any) -> Environment:
        unpacks.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(unpack, "_unpack_layout", counted)
    found: list[Environment] = []
    errors: list[BaseException] = []

    def prepare_one() -> None:
        try:
            found.append(unpack.prepare_archive(archive, "busybox.tar", cache, owner()))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=prepare_one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(found) == 3
    assert len(unpacks) == 1 and len({f.root for f in found}) == 1
    assert found[0].workdir == "/work" and found[0].uid == 1000  # from the image's config
    assert found[0].root is not None
    info = os.lstat(found[0].root / "bin" / "busybox")
    assert info.st_uid == (owner() if owner() is not None else os.geteuid())


def test_the_image_tools_come_from_the_systems_folders_not_the_runners_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """skopeo and umoci, which unpack an image archive, are found in the system's folders
    (docs/SPEC.md §11, the host side): a `skopeo` or `umoci` first on the runner's PATH
    runs for none of them, and the image unpacks as it should."""
    archive = images.oci_archive(images.BUSYBOX_REF, tmp_path / "busybox.tar")
    shims, ran = tmp_path / "bin", tmp_path / "ran"
    shims.mkdir()
    for name in ("skopeo", "umoci", "tar"):
        (shims / name).write_text(f"#!/bin/sh\necho {name} >> {ran}\nexit 1\n")
        (shims / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    found = unpack.prepare_archive(archive, "busybox.tar", Cache(tmp_path / "cache"), owner())
    assert found.root is not None and (found.root / "bin" / "busybox").exists()
    assert not ran.exists(), ran.read_text()


def test_cache_ls_and_prune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = Cache(tmp_path / "cache")
    env = unpack.prepare_rootfs(images.busybox_root(), "root", cache, owner())
    assert env.digest is not None
    assert cli.main(["cache", "ls", "--cache-dir", str(cache.folder), "--json"]) == 0
    listed = capsys.readouterr().out
    assert env.digest in listed and '"kind": "rootfs"' in listed
    # by digest: a prune of everything would empty the machine's image store and build
    # storage under the other tests' jobs (test_builds.py prunes everything, alone)
    assert cli.main(["cache", "prune", "--cache-dir", str(cache.folder), env.digest]) == 0
    assert "removed 1 cache entry" in capsys.readouterr().out
    assert cache.entries() == [] and cache.lookup(env.digest) is None


def test_an_unavailable_engine_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EnvironmentUnavailable, match="no container engine"):
        environments.pick_engine()


@pytest.mark.parametrize("isolation", ["bwrap", "process-group"])
async def test_requested_limits_are_held_by_the_sessions_cgroups(tmp_path: Path,
                                                                 isolation: str) -> None:
    """A root runner with no delegated cgroup v2 folder uses the host's cgroup v1
    hierarchies (these machines mount cpu, memory and pids there)."""
    task = make_task(tmp_path / "task", test_sh="exit 0\n",
                     toml="[environment]\ncpus = 2\nmemory_mb = 512\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(
        "grep /trialledger/ /proc/self/cgroup | cut -d: -f2"),
        message()], isolation=isolation)
    limits = launched(ran).limits
    assert limits == {"requested": {"cpus": 2, "memory_mb": 512, "pids": None},
                      "enforced": True, "reason": None}
    assert not [g for g in ran.view.observations.gaps if g.code == "limits_not_enforced"]
    if isolation == "process-group":  # no cgroup namespace: the host's paths show
        out = ran.view.observations.tool_calls[0].output
        assert sorted(out.split()) == ["cpu", "memory", "pids"], out


# Through real Codex tool calls: 600 MiB asked of a 256 MiB session by a process that
# offers itself to the OOM killer first (else Codex, the biggest, is the one killed), and
# two seconds of a busy loop under a quarter of a CPU (at most half a second of CPU,
# whatever the load).
ALLOCATE = ("echo 1000 > /proc/self/oom_score_adj; "
            "python3 -c 'bytearray(600 << 20); print(\"allocated\")'; echo rc=$?")
SPIN = ("python3 -c 'import os, time\nt = time.time()\nwhile time.time() - t < 2: pass\n"
        "c = os.times()\nprint(\"cpu=%.2f\" % (c.user + c.system))'")


async def test_requested_limits_are_enforced_for_real(tmp_path: Path) -> None:
    """SPEC §12: the task's `memory_mb` and `cpus` hold (cgroup v1 here): a process past
    the memory limit is killed by the kernel, and a busy loop gets the CPU share asked."""
    task = make_task(tmp_path / "task", test_sh="exit 0\n",
                     toml="[environment]\ncpus = 0.25\nmemory_mb = 256\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(ALLOCATE), shell(SPIN),
                                                        message()])
    allocated, spun = (call.output for call in ran.view.observations.tool_calls)
    assert "allocated" not in allocated.splitlines() and "rc=137" in allocated, allocated
    cpu = float(spun.split("cpu=")[1].split()[0])
    assert cpu < 0.8, spun  # 0.5 s allowed (0.25 × 2 s), a period's slack beside it


async def test_no_requested_limits_are_recorded_as_none(tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [message()])
    assert launched(ran).limits is None
    assert not [g for g in ran.view.observations.gaps if g.code == "limits_not_enforced"]


@pytest.mark.parametrize("root, reward", [("agent", 0.0), ("pristine", 1.0)])
async def test_a_pristine_verifier_sees_the_image_as_it_was_and_the_agents_workdir(
        tmp_path: Path, cache: Cache, root: str, reward: float) -> None:
    folder = tmp_path / "task"
    test_sh = ("test -f /work/result.txt && test ! -e /etc/planted-by-agent && "
               "grep -q agent:x:1000 /etc/passwd && echo 1 > /logs/verifier/reward.txt || "
               "echo 0 > /logs/verifier/reward.txt\n")
    task = make_task(folder, test_sh=test_sh,
                     toml=f'[environment]\ndocker_image = "{images.BUSYBOX_REF}"\n')
    images.podman_image(images.BUSYBOX_REF)
    env = prepare(task.source, cache, owner=owner())
    attack = ("echo done > /work/result.txt; echo x > /etc/planted-by-agent; "
              "echo 'agent:x:0:0::/:/bin/sh' > /etc/passwd; echo wrote")
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(attack), message()],
                         environment=env, settings={"verifier_root": root})
    assert "wrote" in tool_output(ran)
    assert ran.view.rewards == {"reward": reward}, [  # pristine: not the agent's /etc
        e.data for e in ran.view.events if e.type.startswith("verification")]


async def test_a_linked_workdir_never_binds_the_host_to_a_pristine_verifier(
        tmp_path: Path, cache: Cache) -> None:
    host = tmp_path / "host-folder"
    host.mkdir()
    (host / "host-canary-file").write_text("host secret")
    host.chmod(0o755)
    task = make_task(tmp_path / "task", test_sh=(
        "ls -a /work > /logs/verifier/seen.txt; grep -q host-canary /logs/verifier/seen.txt "
        "&& echo 0 > /logs/verifier/reward.txt || echo 1 > /logs/verifier/reward.txt\n"),
        toml=f'[environment]\ndocker_image = "{images.BUSYBOX_REF}"\n')
    images.podman_image(images.BUSYBOX_REF)
    env = prepare(task.source, cache, owner=owner())
    attack = f"cd /; mv /work /work-old && ln -s {host} /work && echo swapped"
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(attack), message()],
                         environment=env, settings={"verifier_root": "pristine"})
    assert "swapped" in tool_output(ran)
    assert ran.view.rewards == {"reward": 1.0}, [
        e.data for e in ran.view.events if e.type.startswith("verification")]


PODMAN_DOCKER = Path("/usr/bin/docker")  # Debian's podman-docker: the Docker CLI, on podman


async def test_the_docker_engine_path_prepares_and_runs(
        tmp_path: Path, cache: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine docker`: `docker image inspect` and `docker save` (a docker-archive, not
    an OCI one) — run by Debian's podman-docker, the Docker CLI over podman (no Docker
    daemon runs on these machines), first on our PATH; the busybox image, with its
    WorkingDir and User, runs as it does through podman."""
    assert PODMAN_DOCKER.is_file() and "podman" in PODMAN_DOCKER.read_text(errors="replace"), (
        "this test needs Debian's podman-docker (.ci/run installs it)")
    task = make_task(tmp_path / "task", test_sh=f"grep -q {images.BUSYBOX_MARKER} /marker && "
                     "echo 1 > /logs/verifier/reward.txt\n",
                     toml=f'[environment]\ndocker_image = "{images.BUSYBOX_REF}"\n')
    images.podman_image(images.BUSYBOX_REF)
    through_podman = prepare(task.source, cache, owner=owner(), engine="podman")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "docker").symlink_to(PODMAN_DOCKER)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    env = prepare(task.source, Cache(tmp_path / "cache"), owner=owner(), engine="docker")
    assert env.digest == through_podman.digest  # the same image, by either engine
    assert env.root != through_podman.root  # unpacked afresh from `docker save`
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell("pwd; id -u"), message()],
                         environment=env)
    assert tool_output(ran).splitlines()[:2] == ["/work", "1000"]
    assert ran.view.rewards == {"reward": 1.0}
