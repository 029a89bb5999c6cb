"""A small dataset in Harbor's format, checked as a benchmark operator checks one (SPEC §15):
`job run NAME DATASET --agent oracle` gives every task Harbor's reward 1, and `--agent nop`
gives 0 where the task says so. The tasks need what real Terminal-Bench tasks need: a
container's root (`apt-get install`, `adduser`, `chown`, `su`), the verifier's `HOME` and
`[verifier] env`, a verifier that moves `/tests` aside, `reward.json`, no network, and
solutions that leave daemons running for the verifier to talk to — a web server, and an
sshd installed from Debian's mirror and logged into over ssh (the container lives for the
whole session, `verifier_isolation = harbor`).

They run over the tests' Debian rootfs in range mode (`.ci/run` runs `trialledger setup`).
`apt-and-users` installs from a one-package local repository; `sshd` installs
openssh-server from deb.debian.org as real tasks do (these machines reach Debian's mirror,
from which the rootfs itself was built).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.runs import in_process
from tests.sandbox.test_range_mode import ROOT_SOLUTION, ROOT_TEST, _debian_into, local_repository

DONE = "#!/bin/bash\nmkdir -p /app && echo done > /app/ok\n"
TASKS: dict[str, dict[str, str]] = {
    "apt-and-users": {"solve": ROOT_SOLUTION, "test": ROOT_TEST},
    "verifier-env": {
        "toml": '[verifier.env]\nEXTRA = "from-the-verifier"\n',
        "solve": '#!/bin/bash\n[ "$HOME" = /root ] && mkdir -p /app && echo done > /app/ok\n',
        "test": '#!/bin/bash\n[ -f /app/ok ] && [ "$HOME" = /root ] && '
                '[ "$EXTRA" = from-the-verifier ] && echo 1 > /logs/verifier/reward.txt '
                '|| echo 0 > /logs/verifier/reward.txt\n'},
    "moves-tests": {
        "solve": DONE,
        "test": '#!/bin/bash\nmv /tests /tests-aside && [ -f /tests-aside/test.sh ] && '
                '[ -f /app/ok ] && echo 1 > /logs/verifier/reward.txt '
                '|| echo 0 > /logs/verifier/reward.txt\n'},
    "reward-json": {
        "solve": DONE,
        "test": '#!/bin/bash\nif [ -f /app/ok ]; then echo \'{"reward": 1}\' > '
                '/logs/verifier/reward.json; else echo \'{"reward": 0}\' > '
                '/logs/verifier/reward.json; fi\n'},
    "daemon": {  # busybox httpd daemonizes (fork, setsid): it leaves the agent's group
        "toml": '[environment]\nnetwork_mode = "no-network"\n',  # loopback of its own
        "solve": "#!/bin/bash\nmkdir -p /srv/www && echo served > /srv/www/index.html\n"
                 "/solution/busybox httpd -p 127.0.0.1:8080 -h /srv/www\n",
        "test": '#!/bin/bash\nexec 3<>/dev/tcp/127.0.0.1/8080 && '
                'printf "GET /index.html HTTP/1.0\\r\\n\\r\\n" >&3 && grep -q served <&3 && '
                'echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'},
    "sshd": {  # as real tasks do: install an sshd from Debian's mirror, leave it running
        "solve": "#!/bin/bash\nset -ex\napt-get update -qq\n"
                 "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                 "--no-install-recommends openssh-server openssh-client\n"
                 "mkdir -p /run/sshd /root/.ssh\n"
                 "ssh-keygen -q -t ed25519 -N '' -f /root/.ssh/id_ed25519\n"
                 "cp /root/.ssh/id_ed25519.pub /root/.ssh/authorized_keys\n"
                 "/usr/sbin/sshd -p 2222 -o ListenAddress=127.0.0.1\n",
        "test": '#!/bin/bash\nout=$(ssh -o BatchMode=yes -o StrictHostKeyChecking=no '
                '-p 2222 root@127.0.0.1 \'echo through-$((40 + 2))\')\n'
                '[ "$out" = through-42 ] && echo 1 > /logs/verifier/reward.txt '
                '|| echo 0 > /logs/verifier/reward.txt\n'},
    "no-network": {
        "toml": '[environment]\nnetwork_mode = "no-network"\n',
        "solve": "#!/bin/bash\n(exec 3<>/dev/tcp/1.1.1.1/80) 2>/dev/null && exit 0\n"
                 "mkdir -p /app && echo offline > /app/ok\n",
        "test": '#!/bin/bash\n[ "$(cat /app/ok)" = offline ] && echo 1 > '
                '/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'},
}


def write_dataset(root: Path) -> Path:
    """Each task as Harbor lays it out: instruction.md, task.toml (its rootfs), solution/,
    tests/test.sh."""
    for name, parts in TASKS.items():
        folder = root / name
        for sub in ("solution", "tests"):
            (folder / sub).mkdir(parents=True)
        _debian_into(folder)
        toml = parts.get("toml", "")
        if "[environment]" in toml:
            toml = toml.replace("[environment]\n", '[environment]\nrootfs = "rootfs.tar"\n')
        else:
            toml = '[environment]\nrootfs = "rootfs.tar"\n' + toml
        (folder / "task.toml").write_text('version = "1.0"\n' + toml)
        (folder / "instruction.md").write_text(f"Solve {name}.\n")
        if name == "apt-and-users":
            local_repository(folder / "solution")
        if name == "daemon":  # the web server the solution starts (the rootfs has none)
            shutil.copy2("/bin/busybox", folder / "solution" / "busybox")
        for path, text in ((folder / "solution" / "solve.sh", parts["solve"]),
                           (folder / "tests" / "test.sh", parts["test"])):
            path.write_text(text)
            path.chmod(0o755)
    return root


def job_rewards(db: Path, name: str) -> dict[str, Any]:
    shown = in_process("job", "show", name, "--db", str(db), "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    return {task["task"]: task["mean"] for task in summary["tasks"]
            if task["task"] is not None}  # the dataset's own row aside


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("dataset"))


@pytest.mark.parametrize(("agent", "reward"), [("oracle", 1.0), ("nop", 0.0)])
def test_the_oracle_scores_1_and_nop_0_on_every_task(dataset: Path, tmp_path: Path,
                                                     agent: str, reward: float) -> None:
    """The oracle (each task's own solution) gets reward 1 everywhere; nop, which does
    nothing, gets 0 wherever the task needs work — here, every task."""
    db = tmp_path / "jobs.db"
    done = in_process("job", "run", f"{agent}-check", str(dataset), "--agent", agent,
                      "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr
    assert job_rewards(db, f"{agent}-check") == {name: reward for name in TASKS}


def test_a_daemon_the_solution_started_serves_the_verifier_and_is_named(
        dataset: Path, tmp_path: Path) -> None:
    """Under `harbor` the web server the oracle left running answers the verifier, and the
    session names it (gap `agent_processes_survived`); under `strict` it died with the
    agent's sandbox and the same solution scores 0."""
    rewards = {}
    for isolation in ("harbor", "strict"):
        db = tmp_path / f"{isolation}.db"
        done = in_process("job", "run", isolation, str(dataset / "daemon"), "--agent",
                          "oracle", "--set", f"verifier_isolation={isolation}",
                          "--db", str(db))
        assert done.returncode == 0, done.stdout + done.stderr
        rewards[isolation] = job_rewards(db, isolation)["daemon"]
        with sqlite3.connect(db) as conn:
            gaps = [json.loads(row[0])["data"] for row in conn.execute(
                "SELECT data FROM events WHERE type = 'gap.recorded'")]
        survived = [g["detail"] for g in gaps if g["code"] == "agent_processes_survived"]
        if isolation == "harbor":
            assert len(survived) == 1 and "busybox" in survived[0], gaps
        else:
            assert survived == [], gaps
    assert rewards == {"harbor": 1.0, "strict": 0.0}
