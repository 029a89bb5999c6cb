"""A separate verifier (docs/SPEC.md §17 "Separate verifier"), as Harbor 0.26 resolves and
runs it: real runc containers over real images built offline (tests/images.py), the
oracle, nop and the real Codex CLI. The verifier's container sees the declared artifacts
and nothing else of the agent's; the agent's container is gone before it starts."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests import images
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from tests.runs import in_process, make_task, read_shell, run_task
from trialledger.adapters.demo import samples
from trialledger.adapters.demo.endpoint import message
from trialledger.adapters.images.environment import Cache, Environment, EnvironmentUnavailable
from trialledger.adapters.images.imagestore import plain_cache
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.session.runner import RunOptions, SessionRunner
from trialledger.adapters.tasks.task import Task, UnsupportedField
from trialledger.adapters.tasks.verifiermode import prepare_task
from trialledger.store import Ledger

pytestmark = pytest.mark.anyio

# The verifier's check: the declared artifact is there, the undeclared files are not.
CHECK = """#!/bin/sh
d=0; u=1
grep -qx declared /work/out.txt 2>/dev/null && d=1
[ -e /work/undeclared.txt ] && u=0
[ -e /tmp/undeclared.txt ] && u=0
echo "{\\"reward\\": $((d * u)), \\"declared\\": $d, \\"undeclared_absent\\": $u}" \\
  > /logs/verifier/reward.json
"""
DECOY = "#!/bin/sh\necho 0.5 > /logs/verifier/reward.txt\n"  # run only if tests/ were uploaded
WRITES = ("echo declared > /work/out.txt; echo hidden > /work/undeclared.txt; "
          "echo hidden > /tmp/undeclared.txt")
SOLVE = f"#!/bin/sh\n{WRITES}\n"
DAEMON = "4242"  # the argument that names the daemon the agent leaves behind
KINDS = ["task_env", "docker_image", "tests_dockerfile"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Cache:
    """A plain cache (range mode), shared by the module's tests."""
    return plain_cache(tmp_path_factory.mktemp("cache"))


def busybox_image(name: str, files: dict[str, str]) -> str:
    """The busybox root as an image (`USER agent`, `WORKDIR /work` the agent's) with
    `files` (path → text; executable, root's) in it; imported once, its tag their digest."""
    digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:12]

    def fill(archive: tarfile.TarFile) -> None:
        for path, text in files.items():
            parts = path.split("/")
            for depth in range(1, len(parts)):
                if (images.busybox_root() / "/".join(parts[:depth])).is_dir():
                    continue  # the root's own (`/work` is the agent's)
                folder = tarfile.TarInfo("./" + "/".join(parts[:depth]))
                folder.type, folder.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(folder)
            data = text.encode()
            info = tarfile.TarInfo(f"./{path}")
            info.size, info.mode = len(data), 0o755
            archive.addfile(info, io.BytesIO(data))

    return images.busybox_image(f"localhost/tl-busybox:{name}-{digest}", fill)


def agent_image() -> str:
    return busybox_image("separate-agent", {})


def separate_task(folder: Path, kind: str, *, solve: str = SOLVE) -> Task:
    """A Harbor-format task over the busybox image whose verifier runs apart, its image as
    `kind` resolves it; `/work/out.txt` is its one declared artifact."""
    toml = f'artifacts = ["/work/out.txt"]\n[environment]\ndocker_image = "{agent_image()}"\n'
    test_sh = CHECK
    if kind == "task_env":
        toml += '[verifier]\nenvironment_mode = "separate"\n'
    elif kind == "docker_image":
        ref = busybox_image("separate-verifier", {"tests/test.sh": CHECK})
        toml += f'[verifier.environment]\ndocker_image = "{ref}"\n'
        test_sh = DECOY
    else:
        toml += '[verifier]\nenvironment_mode = "separate"\n'
        samples.executable(folder / "tests" / "check.sh", CHECK)
        (folder / "tests" / "Dockerfile").write_text(
            f"FROM {agent_image()}\nCOPY check.sh /tests/test.sh\n")
        test_sh = DECOY
    return make_task(folder, test_sh=test_sh, toml=toml, solve_sh=solve,
                     exit_code_reward=False)


async def run_scripted(db: Path, task: Task, env: Environment, agent: str,
                       runtime: str | None = None) -> Any:
    """One session of the oracle or nop (on `runtime`, default runc); its view."""
    async with await Ledger.open(str(db)) as ledger:
        runner = SessionRunner(ledger, task, RunOptions(agent=agent, runtime=runtime), env)
        return (await runner.run_session()).view


def verdict(view: Any) -> Any:
    return next(e for e in view.events if e.type.startswith("verification."))


@pytest.mark.parametrize("kind", KINDS)
async def test_oracle_scores_1_and_nop_0_on_each_kind_of_separate_verifier(
        tmp_path: Path, cache: Cache, kind: str) -> None:
    task = separate_task(tmp_path / "task", kind)
    assert task.separate_verifier is not None
    assert task.separate_verifier.bundled is (kind != "task_env")
    env = prepare_task(task, cache, owner=None)
    assert env.plain and env.verifier is not None
    oracle = await run_scripted(tmp_path / "t.db", task, env, "oracle")
    assert oracle.rewards == {"reward": 1.0, "declared": 1.0, "undeclared_absent": 1.0}, \
        verdict(oracle).data
    assert oracle.events[1].data.isolation == "runc"
    nop = await run_scripted(tmp_path / "t.db", task, env, "nop")
    assert nop.rewards == {"reward": 0.0, "declared": 0.0, "undeclared_absent": 1.0}, \
        verdict(nop).data
    # the declared artifact is kept and listed as for a shared verifier (§15)
    assert [f.path for f in verdict(oracle).data.files if f.path.startswith("artifacts/")] \
        == ["artifacts/work/out.txt"]


def test_a_job_over_a_dataset_scores_the_oracle_1_and_nop_0(tmp_path: Path) -> None:
    """`job run` in range mode (a root runner after setup): both images prepared before
    any trial is claimed, each trial's verifier apart, under the trial's lease."""
    data = tmp_path / "data"
    for kind in ("task_env", "docker_image"):
        separate_task(data / kind, kind)
    db = tmp_path / "jobs.db"
    for agent, expected in (("oracle", 1.0), ("nop", 0.0)):
        done = in_process("job", "run", agent, str(data), "--agent", agent, "--db", str(db),
                          "--cache-dir", str(tmp_path / "cache"), "--json")
        assert done.returncode == 0, done.stderr
        trials = [json.loads(line) for line in done.stdout.splitlines()]
        # (several rewards: `reward` is null, `rewards` holds them all)
        rewards = {t["task"]: t["rewards"]["reward"] for t in trials}
        assert rewards == {"task_env": expected, "docker_image": expected}, done.stdout


async def test_range_modes_other_runtime_bwrap_runs_it_too(tmp_path: Path, cache: Cache
                                                          ) -> None:
    task = separate_task(tmp_path / "task", "docker_image")
    env = prepare_task(task, cache, owner=None)
    oracle = await run_scripted(tmp_path / "t.db", task, env, "oracle", runtime="bwrap")
    assert oracle.events[1].data.isolation == "bwrap"
    assert oracle.rewards == {"reward": 1.0, "declared": 1.0, "undeclared_absent": 1.0}, \
        verdict(oracle).data


async def test_a_separate_verifier_cannot_see_an_undeclared_file_the_agent_wrote(
        tmp_path: Path, cache: Cache) -> None:
    """Through a real Codex tool call the agent writes its declared artifact and two files
    it does not declare; the verifier, in its own container, finds the one and not the
    others (its reward says so, key by key)."""
    task = separate_task(tmp_path / "task", "task_env")
    env = prepare_task(task, cache, owner=None)
    ran = await run_task(str(tmp_path / "t.db"), task,
                         [read_shell(f"{WRITES}; ls /work /tmp"), message("done")],
                         environment=env)
    listed = ran.view.observations.tool_calls[0].output
    assert "undeclared.txt" in listed and "out.txt" in listed  # the agent's container had them
    assert ran.view.rewards == {"reward": 1.0, "declared": 1.0, "undeclared_absent": 1.0}, \
        verdict(ran.view).data


async def test_the_agents_container_is_stopped_before_the_verifier_runs(
        tmp_path: Path, cache: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon the agent leaves running (it outlives the agent: gap
    `agent_processes_survived`) is gone when the verifier starts."""
    task = separate_task(tmp_path / "task", "task_env",
                         solve=f"#!/bin/sh\n{WRITES}\nsetsid sleep {DAEMON} &\n")
    env = prepare_task(task, cache, owner=None)
    seen: list[list[int]] = []
    verify = LocalSandbox.verify

    async def spied(self: LocalSandbox, timeout_s: float, env: Any = None) -> Any:
        seen.append(daemons())
        return await verify(self, timeout_s, env)

    monkeypatch.setattr(LocalSandbox, "verify", spied)
    view = await run_scripted(tmp_path / "t.db", task, env, "oracle")
    survived = [e for e in view.events if e.type == "gap.recorded"
                and e.data.code == "agent_processes_survived"]
    assert survived and "sleep" in survived[0].data.detail
    assert seen == [[]], seen
    assert view.rewards == {"reward": 1.0, "declared": 1.0, "undeclared_absent": 1.0}
    assert daemons() == []


async def test_a_declared_folder_replaces_the_one_the_verifiers_image_has(
        tmp_path: Path, cache: Cache) -> None:
    """The image holds `/work/results/old.txt`; the agent replaces it with `new.txt`; the
    verifier, over a fresh container of the same image, sees the agent's folder whole (the
    image's own folder, which its overlay cannot move aside, is removed first)."""
    ref = busybox_image("separate-results", {"work/results/old.txt": "old\n"})
    task = make_task(tmp_path / "task", exit_code_reward=False, toml=(
        f'artifacts = ["/work/results"]\n[environment]\ndocker_image = "{ref}"\n'
        '[agent]\nuser = "root"\n[verifier]\nenvironment_mode = "separate"\n'),
        solve_sh="#!/bin/sh\nrm /work/results/old.txt && echo new > /work/results/new.txt\n",
        test_sh=("#!/bin/sh\n[ -f /work/results/new.txt ] && [ ! -e /work/results/old.txt ] "
                 "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"))
    env = prepare_task(task, cache, owner=None)
    view = await run_scripted(tmp_path / "t.db", task, env, "oracle")
    assert view.rewards == {"reward": 1.0}, verdict(view).data
    nop = await run_scripted(tmp_path / "t.db", task, env, "nop")
    assert nop.rewards == {"reward": 0.0}, verdict(nop).data  # the image's, kept as it was


# The agent (the image's user) leaves files of every kind of mode; the verifier, running as
# that user too, checks each as Harbor's copy leaves it: root's, the modes kept but for the
# setuid bit and group or other write; the folders root's, 0755, a file's folder 0777.
MODES_SOLVE = """#!/bin/sh
mkdir -p /work/out/sub && echo data > /work/out/data.txt
printf '#!/bin/sh\\necho ran\\n' > /work/out/run.sh && chmod 755 /work/out/run.sh
echo private > /work/out/private.txt && chmod 600 /work/out/private.txt
echo open > /work/out/open.txt && chmod 666 /work/out/open.txt
cp /bin/busybox /work/out/sub/tool && chmod 4755 /work/out/sub/tool
echo note > /work/note.txt
"""
MODES_CHECK = """#!/bin/sh
o=/work/out; r=0; x=0; p=1; s=0; w=0; f=0
[ "$(cat $o/data.txt)" = data ] && [ "$(stat -c %u%a $o/data.txt)" = 0644 ] && r=1
[ "$($o/run.sh)" = ran ] && x=1
cat $o/private.txt > /dev/null 2>&1 && p=0
[ "$(stat -c %a $o/sub/tool)" = 755 ] && s=1
[ "$(stat -c %a $o/open.txt)" = 644 ] && w=1
[ "$(stat -c %u%a $o)" = 0755 ] && [ "$(stat -c %a $o/sub)" = 755 ] && f=1
[ "$(cat /work/note.txt)" = note ] && [ "$(stat -c %a /work)" = 777 ] || f=0
echo "{\\"reward\\": $((r * x * p * s * w * f)), \\"read\\": $r, \\"run\\": $x," \\
  "\\"private\\": $p, \\"setuid_dropped\\": $s, \\"no_other_write\\": $w," \\
  "\\"folders\\": $f}" > /logs/verifier/reward.json
"""


async def test_the_artifacts_reach_the_verifier_with_the_modes_harbors_copy_leaves(
        tmp_path: Path, cache: Cache) -> None:
    """A verifier that is not root reads the agent's plain file and runs its script, as
    under Harbor, and cannot read a file the agent kept to itself (root's, 0600); a setuid
    bit and others' write bit do not come across (Harbor's tar `data` filter)."""
    task = make_task(tmp_path / "task", exit_code_reward=False, toml=(
        'artifacts = ["/work/out", "/work/note.txt"]\n'
        f'[environment]\ndocker_image = "{agent_image()}"\n'
        '[verifier]\nenvironment_mode = "separate"\n'),
        solve_sh=MODES_SOLVE, test_sh=MODES_CHECK)
    env = prepare_task(task, cache, owner=None)
    view = await run_scripted(tmp_path / "t.db", task, env, "oracle")
    assert view.rewards == {"reward": 1.0, "read": 1.0, "run": 1.0, "private": 1.0,
                            "setuid_dropped": 1.0, "no_other_write": 1.0, "folders": 1.0}, \
        verdict(view).data


def daemons() -> list[int]:
    """The host pids of `sleep DAEMON`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if handle.read() == f"sleep\0{DAEMON}\0".encode():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_a_verifier_image_missing_locally_is_refused_naming_it(tmp_path: Path,
                                                                cache: Cache) -> None:
    task = make_task(tmp_path / "task", test_sh=CHECK, exit_code_reward=False, toml=(
        f'[environment]\ndocker_image = "{agent_image()}"\n'
        '[verifier.environment]\ndocker_image = "localhost/tl-nowhere:none"\n'))
    with pytest.raises(EnvironmentUnavailable, match=r"the separate verifier's "
                       r"localhost/tl-nowhere:none: .*not in podman's local storage.*--pull"):
        prepare_task(task, cache, owner=None)


def test_outside_range_mode_a_separate_verifier_is_refused_by_name(tmp_path: Path) -> None:
    """Single-id mode (`--sandbox-uid`), `--isolation process-group` and a host task: one
    line naming the field, nothing stored; in a dataset the task is skipped with it."""
    data = tmp_path / "data"
    separate_task(data / "apart", "task_env")
    make_task(data / "plain", test_sh="exit 0\n")  # a host task, shared: it runs
    db = tmp_path / "t.db"
    single = ("--sandbox-uid", str(sandbox_user().uid))
    for extra in (single, ("--isolation", "process-group")):
        done = in_process("run", str(data / "apart"), "--agent", "nop", "--db", str(db),
                          *extra)
        assert done.returncode == 2, done.stderr
        line, = done.stderr.strip().splitlines()
        assert ("[verifier] environment_mode = 'separate': a separate verifier needs range "
                "mode (a root runner after setup, under bwrap), which this run does not "
                "have") in line, line  # before any image is prepared
        assert not db.exists()
    with pytest.raises(UnsupportedField, match=r"\[verifier\] environment_mode = 'separate'"
                       r": a separate verifier needs range mode, which a host task"):
        make_task(tmp_path / "host", test_sh=CHECK,
                  toml='[verifier]\nenvironment_mode = "separate"\n')
    done = in_process("job", "run", "check", str(data), "--agent", "nop", "--db", str(db),
                      *single)
    assert done.returncode == 0, done.stderr
    skipped = [line for line in done.stderr.splitlines() if "skipped task apart:" in line]
    assert len(skipped) == 1 and "needs range mode" in skipped[0], done.stderr
    assert "plain" in done.stdout


def test_a_single_id_runner_refuses_a_separate_verifier_before_any_session(
        tmp_path: Path) -> None:
    """The library's own check: a runner given a rootless (single-id) environment."""
    task = separate_task(tmp_path / "task", "task_env")
    env = prepare_task(task, Cache(tmp_path / "rootless"), owner=sandbox_user().uid)
    assert not env.plain

    async def go() -> None:
        async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
            SessionRunner(ledger, task, RunOptions(agent="oracle"), env)

    from trialledger.adapters.sandbox.base import SandboxRefused

    with pytest.raises(SandboxRefused, match="needs range mode"):
        anyio.run(go)
