"""The task's collect hooks, run as Harbor 0.26 runs them (docs/SPEC.md §17 "Collect
hooks"): `[[verifier.collect]]` commands in order after the agent, before the artifacts are
collected and the verifier runs; each as its user (range mode), under its timeout, its
output kept (bounded, scrubbed); a failure is gap `collect_failed`, never the trial's end.
Real runs of the oracle: a host task, and over the tests' Debian rootfs in range mode and
in single-id mode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.runs import in_process, make_task
from tests.sandbox.test_range_mode import _debian_into
from tests.tasks.test_task_artifacts import Run, gaps, oracle, session, verification
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.session.capture import MAX_KEPT_BYTES, keep_text
from trialledger.adapters.tasks.collect import DEFAULT_TIMEOUT_S, OUTPUT_KEPT, CollectHook
from trialledger.adapters.tasks.task import TaskInvalid, UnsupportedField

TOKEN = "tl-collect-token-Jw4Pq9Xs"

# The hooks snapshot what the agent left (`answer.txt`) into a file only an artifact
# carries out; the verifier reads it. A hook that fails or times out is passed over.
HOST_TOML = """artifacts = ["/app/snapshot.txt"]
[environment.env]
API_TOKEN = "${TL_TEST_COLLECT_TOKEN}"
[[verifier.collect]]
command = "echo one > /app/snapshot.txt; cat /app/answer.txt >> /app/snapshot.txt"
[[verifier.collect]]
command = "echo failing; exit 3"
[[verifier.collect]]
command = "sleep 30"
timeout_sec = 1
[[verifier.collect]]
command = "echo two >> /app/snapshot.txt; echo token=$API_TOKEN"
[[verifier.collect]]
command = "head -c 3000000 /dev/urandom; printf 'the end'"
[[verifier.collect]]
command = "printf %s $API_TOKEN; head -c 262134 /dev/zero | tr '\\\\0' x"
"""
HOST_SOLVE = "#!/bin/sh\necho solved > /app/answer.txt\n"
HOST_TEST = """#!/bin/sh
[ "$(cat /app/snapshot.txt)" = "$(printf 'one\\nsolved\\ntwo')" ] \
  && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
"""


@pytest.fixture(scope="module")
def host_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The oracle on a host task with five hooks: two write the snapshot, one fails, one
    times out, one prints 3 MB of random bytes."""
    tmp = tmp_path_factory.mktemp("host")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TL_TEST_COLLECT_TOKEN", TOKEN)
        task = make_task(tmp / "task", test_sh=HOST_TEST, toml=HOST_TOML, solve_sh=HOST_SOLVE,
                         exit_code_reward=False)
        view = oracle(task.folder, tmp / "t.db", tmp / "kept")
    yield Run(tmp / "t.db", tmp / "kept" / view.session_id, view)


def test_hooks_run_in_order_before_the_artifacts_and_the_verifier(host_run: Run) -> None:
    """The snapshot exists only once the hooks ran, in order: the artifact pass keeps it
    whole and the verifier (reward 1) reads it."""
    event = verification(host_run.view)
    assert event.type == "verification.recorded" and event.data.rewards == {"reward": 1.0}
    kept = host_run.folder / "artifacts/app/snapshot.txt"
    assert kept.read_text() == "one\nsolved\ntwo\n"
    assert "artifacts/app/snapshot.txt" in host_run.listed


def test_each_hooks_output_is_kept_and_listed_scrubbed(host_run: Run) -> None:
    listed = host_run.listed
    outputs = sorted(p for p in listed if p.startswith("collect/"))
    assert outputs == ["collect/2.txt", "collect/4.txt", "collect/5.txt", "collect/6.txt"]
    assert (host_run.folder / "collect/2.txt").read_text() == "failing\n"
    assert (host_run.folder / "collect/4.txt").read_text() == "token=[redacted]\n"
    assert TOKEN not in (host_run.folder / "collect/4.txt").read_text()
    assert listed["collect/2.txt"].size == len("failing\n")


def test_a_failing_and_a_timing_out_hook_are_gaps_and_the_trial_is_still_verified(
        host_run: Run) -> None:
    assert gaps(host_run.view, "collect_failed") == [
        "`echo failing; exit 3`: exit code 3", "`sleep 30`: timeout after 1 s"]
    seqs = [e.seq for e in host_run.view.events if e.type == "gap.recorded"
            and e.data.code == "collect_failed"]
    assert max(seqs) < verification(host_run.view).seq
    assert host_run.view.outcome == "verify"


def test_a_hostile_hooks_output_is_kept_bounded(host_run: Run) -> None:
    """3 MB of random bytes: at most the last `OUTPUT_KEPT` bytes are kept as they were
    (less, with secrets, what a cut secret could span), after a line saying how many
    earlier ones were not."""
    data = (host_run.folder / "collect/5.txt").read_bytes()
    first, _, rest = data.partition(b"\n")
    assert first == f"[{3_000_000 + len('the end') - len(rest)} earlier bytes not kept]".encode()
    assert OUTPUT_KEPT - 1024 < len(rest) <= OUTPUT_KEPT and rest.endswith(b"the end")


def test_a_secret_the_cut_goes_through_is_not_kept_in_part(host_run: Run) -> None:
    """The token, then enough bytes that the kept end starts inside it: what a scrub
    cannot recognise (its last characters alone) is left out with the cut."""
    data = (host_run.folder / "collect/6.txt").read_bytes()
    first, _, rest = data.partition(b"\n")
    assert b"Jw4Pq9Xs" not in data and set(rest) == {ord("x")}
    assert first == f"[{len(TOKEN) + 262134 - len(rest)} earlier bytes not kept]".encode()


def test_kept_text_stays_within_the_cap_however_much_scrubbing_lengthens_it(
        tmp_path: Path) -> None:
    """16 MiB of an 8-character secret, each `[redacted]` two bytes longer: the kept file
    (a hook's output, oracle.txt) is cut to the cap again, its end kept and its first line
    counting the bytes left out — a file past 16 MiB would never be given back (its size
    alone refuses it)."""
    output = b"abcd1234\n" * (MAX_KEPT_BYTES // 9)
    entry = keep_text(tmp_path, "agent/oracle.txt", output, 0, ["abcd1234"])
    assert entry is not None and entry["size"] <= MAX_KEPT_BYTES
    first, _, rest = (tmp_path / "agent/oracle.txt").read_bytes().partition(b"\n")
    assert first.startswith(b"[") and first.endswith(b" earlier bytes not kept]")
    assert rest.endswith(b"[redacted]\n[redacted]\n") and b"abcd1234" not in rest
    # what fits is not cut: no first line, every byte kept
    small = keep_text(tmp_path, "small.txt", b"abcd1234 x\n", 0, ["abcd1234"])
    assert small is not None and (tmp_path / "small.txt").read_bytes() == b"[redacted] x\n"


# Over the Debian rootfs: a hook as `nobody` writes its uid into the snapshot, which the
# verifier (root) reads; another without a user runs as the image's (root).
IMAGE_TOML = """artifacts = ["/srv/snap"]
[environment]
rootfs = "rootfs.tar"
[[verifier.collect]]
command = "mkdir -p /srv/snap && chmod 777 /srv/snap && cp /srv/answer /srv/snap/ && id -u"
[[verifier.collect]]
command = "id -u > /srv/snap/uid; id -u"
user = "nobody"
"""
IMAGE_TEST = """#!/bin/bash
[ "$(cat /srv/snap/answer)" = solved ] && [ "$(cat /srv/snap/uid)" = 65534 ] \
  && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
"""


def image_task(folder: Path) -> Path:
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    _debian_into(folder)
    (folder / "task.toml").write_text(IMAGE_TOML)
    (folder / "instruction.md").write_text("Answer.\n")
    for path, text in ((folder / "solution/solve.sh", "#!/bin/bash\necho solved > /srv/answer\n"),
                       (folder / "tests/test.sh", IMAGE_TEST)):
        path.write_text(text)
        path.chmod(0o755)
    return folder


def test_a_hook_runs_as_its_user_in_range_mode(tmp_path: Path) -> None:
    view = oracle(image_task(tmp_path / "task"), tmp_path / "t.db", tmp_path / "kept")
    (launched,) = [e for e in view.events if e.type == "agent.launched"]
    assert launched.data.identity["mode"] == "range"
    event = verification(view)
    assert event.data.rewards == {"reward": 1.0}, event.data
    folder = tmp_path / "kept" / view.session_id
    assert (folder / "collect/1.txt").read_text() == "0\n"
    assert (folder / "collect/2.txt").read_text() == "65534\n"
    assert (folder / "artifacts/srv/snap/uid").read_text() == "65534\n"
    assert gaps(view, "collect_failed") == []


def test_in_single_id_mode_a_hooks_user_is_warned_not_honoured(tmp_path: Path) -> None:
    task = image_task(tmp_path / "task")
    done = in_process("run", str(task), "--agent", "oracle", "--db", str(tmp_path / "t.db"),
                      "--set", f"sandbox_logs_dir={tmp_path / 'kept'}",
                      "--sandbox-uid", str(sandbox_user().uid))
    assert done.returncode == 0, done.stderr  # verified (reward 0: not nobody's uid)
    assert ("trialledger: warning: [[verifier.collect]] user is not honoured in single-id "
            "mode: every phase runs as the image's user (1 task)") in done.stderr
    view = session(tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 0.0}
    assert (tmp_path / "kept" / view.session_id / "collect/2.txt").read_text() == "0\n"


def test_a_user_the_image_does_not_have_is_a_gap(tmp_path: Path) -> None:
    task = image_task(tmp_path / "task")
    (task / "task.toml").write_text(IMAGE_TOML.replace('"nobody"', '"nosuchuser"'))
    view = oracle(task, tmp_path / "t.db", tmp_path / "kept")
    (gap,) = gaps(view, "collect_failed")
    assert gap.startswith("`id -u > /srv/snap/uid; id -u`: it could not start: user "
                          "'nosuchuser'"), gap
    assert verification(view).data.rewards == {"reward": 0.0}  # verified all the same


def test_hooks_are_read_as_harbors_model_reads_them(tmp_path: Path) -> None:
    def load(toml: str) -> Any:
        return make_task(tmp_path / f"t{len(list(tmp_path.iterdir()))}", test_sh="exit 0\n",
                         toml=toml)

    task = load("[[verifier.collect]]\ncommand = 'a'\n[[verifier.collect]]\ncommand = 'b'\n"
                "service = ' main '\ntimeout_sec = 5\nuser = 1000\n")
    assert task.collect == (CollectHook("a", DEFAULT_TIMEOUT_S, None),
                            CollectHook("b", 5.0, "1000"))
    assert task.ignored_fields == {}
    assert load("[verifier]\ncollect = []\n").collect == ()
    with pytest.raises(UnsupportedField, match=r"\[\[verifier.collect\]\] 1 service = 'db'"):
        load("[[verifier.collect]]\ncommand = 'a'\nservice = 'db'\n")


BAD = [
    ("[[verifier.collect]]\ntimeout_sec = 5\n", "[[verifier.collect]] 1 command = None"),
    ("[[verifier.collect]]\ncommand = ['ls']\n", "[[verifier.collect]] 1 command = ['ls']"),
    ("[[verifier.collect]]\ncommand = 'a'\ntimeout_sec = 0\n",
     "[[verifier.collect]] 1 timeout_sec = 0: expected a positive number"),
    ("[[verifier.collect]]\ncommand = 'a'\ntimeout_sec = 'long'\n",
     "[[verifier.collect]] 1 timeout_sec = 'long'"),
    ("[[verifier.collect]]\ncommand = 'a'\nuser = true\n", "[[verifier.collect]] 1 user = True"),
    ("[[verifier.collect]]\ncommand = 'a'\nservice = '-x'\n",
     "[[verifier.collect]] 1 service = '-x'"),
    ("[verifier]\ncollect = 'true'\n", "[verifier] collect = 'true'"),
    ("[verifier]\ncollect = ['true']\n", "[[verifier.collect]] 1 = 'true'"),
    ('[[verifier.collect]]\ncommand = "a\\u0000b"\n', "[[verifier.collect]] 1 command: a NUL"),
]


@pytest.mark.parametrize(("toml", "named"), BAD, ids=[n for _, n in BAD])
def test_a_bad_hook_is_a_one_line_refusal(tmp_path: Path, toml: str, named: str) -> None:
    with pytest.raises(TaskInvalid) as refused:
        make_task(tmp_path / "task", test_sh="exit 0\n", toml=toml)
    assert not isinstance(refused.value, UnsupportedField)
    done = in_process("run", str(tmp_path / "task"), "--agent", "nop",
                      "--db", str(tmp_path / "t.db"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "t.db").exists()
