"""Dockerfile tasks at Docker's speed (SPEC §16): `job run --agent oracle` over a dataset of
Dockerfile tasks beside a reference that does what Harbor does with Docker on the same
tasks, in one run, the same `-n` on both sides.

    python -m bench.containers [--tasks 12] [-n 2] [--no-apt]

The dataset: `--tasks` Harbor-format tasks (instruction.md, task.toml, environment/
Dockerfile, solution/solve.sh, tests/test.sh) on two Debian base images — the tests'
bookworm minbase (`tests/images.py`) and one with python3 on it — a third of them running
`apt-get install` from Debian's mirror in their Dockerfile. Every Dockerfile starts with
`ENV BENCH_RUN=<nonce>`, so nothing of an earlier run is a cache hit on either side.

- **reference**: root's podman (its own overlay storage, the base images copied in
  beforehand) builds each image (`podman build --isolation chroot`); per trial a fresh
  container (`podman create` + `podman mount`: the image's layers under a writable layer
  of its own, as Docker's overlay2 gives a container), `solution/` copied in, `runc run`
  of `solve.sh` (runc's default configuration: new namespaces, no network), `tests/`
  copied in, `runc run` of `test.sh`, the reward read, the container removed;
- **trialledger**: `trialledger job run NAME DATASET --agent oracle -n N` (the base images
  in its build storage beforehand: a warm-up job over one task per base is not timed).

Printed: **cold** (no task image built, empty cache) and **warm** (images built, a new job
over the same cache) wall times of both sides and their ratios (goals ≤ 1.0× cold, ≤ 1.1×
warm), the warm job again with `-k` trials a task (default 4: a campaign's size, where the
job's fixed cost — Python's start and imports, ≈ 0.6 s — is spread), and the disk each
side's images take (`du`: the growth of trialledger's cache and session image store — SPEC
§16's measure — against the reference storage's growth; the build storage's growth shown
beside). Needs root, `trialledger setup`, the image tools `.ci/run` installs and the tests'
images (`python -m tests.images`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests import images
from trialledger.adapters.sandbox.idrange import DOCKER_CAPS

PYTHON_BASE = "localhost/tl-bench:python"
BUILD_STORAGE = Path("/var/lib/trialledger/build")
IMAGE_STORE = Path("/var/lib/trialledger/images")  # the session image store (SPEC §16)
TRIALLEDGER = [str(Path(sys.executable).parent / "trialledger")]


def _run(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 1800,
         cwd: Path | None = None) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} …: exit {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    return done.stdout


def _operator_env() -> dict[str, str]:
    """The environment of a command reading the tests' image storage (the operator's)."""
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(images.storage_conf())}


def _bases() -> list[str]:
    """The base images, in the tests' storage: Debian minbase, and python3 built on it."""
    debian = images.podman_image(images.DEBIAN_REF)
    env = _operator_env()
    if subprocess.run(["podman", "image", "exists", PYTHON_BASE], env=env,
                      check=False).returncode != 0:
        with tempfile.TemporaryDirectory() as context:
            Path(context, "Dockerfile").write_text(
                f"FROM {debian}\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
                "apt-get install -y -qq --no-install-recommends python3 "
                "&& rm -rf /var/lib/apt/lists/*\n")
            _run(["podman", "build", "--isolation", "chroot", "-t", PYTHON_BASE, context],
                 env=env)
    return [debian, PYTHON_BASE]


def _task(folder: Path, index: int, base: str, nonce: str, apt: bool) -> None:
    """One task: a Dockerfile with a step or two, a solution that writes what the test
    checks, a test that writes reward.txt."""
    (folder / "environment").mkdir(parents=True)
    (folder / "solution").mkdir()
    (folder / "tests").mkdir()
    steps = [f"FROM {base}", f"ENV BENCH_RUN={nonce}", "WORKDIR /app",
             f"RUN echo task-{index} > /app/name && mkdir -p /app/data"]
    check = "cat /app/name"
    if apt:
        steps.append("RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get "
                     "install -y -qq --no-install-recommends jq && rm -rf /var/lib/apt/lists/*")
        check = "jq -r .name /app/out.json"
    elif base == PYTHON_BASE:
        check = "python3 -c 'import json; print(json.load(open(\"/app/out.json\"))[\"name\"])'"
    (folder / "environment" / "Dockerfile").write_text("\n".join(steps) + "\n")
    (folder / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = 120\n')
    (folder / "instruction.md").write_text(f"Write /app/out.json naming task-{index}.\n")
    solve = folder / "solution" / "solve.sh"
    solve.write_text("#!/bin/bash\nset -e\n"
                     "printf '{\"name\": \"%s\"}\\n' \"$(cat /app/name)\" > /app/out.json\n")
    test = folder / "tests" / "test.sh"
    test.write_text(f"#!/bin/bash\nmkdir -p /logs/verifier\n"
                    f"[ \"$({check})\" = task-{index} ] && echo 1 > /logs/verifier/reward.txt "
                    f"|| echo 0 > /logs/verifier/reward.txt\n")
    for script in (solve, test):
        script.chmod(0o755)


def dataset(root: Path, count: int, bases: list[str], *, apt: bool) -> Path:
    """`count` tasks alternating over `bases`, every third installing a package."""
    nonce = secrets.token_hex(6)
    for index in range(count):
        _task(root / f"task-{index:02d}", index, bases[index % len(bases)], nonce,
              apt and index % 3 == 0)
    return root


class Reference:
    """What Harbor does with Docker: build with the engine, a fresh container per trial."""

    def __init__(self, scratch: Path) -> None:
        self.root = scratch / "storage"
        self.runroot = scratch / "run"
        self.bundles = scratch / "bundles"
        self.bundles.mkdir(parents=True)

    def podman(self, *args: str, timeout: float = 1800) -> str:
        return _run(["podman", "--root", str(self.root), "--runroot", str(self.runroot),
                     "--storage-driver", "overlay", *args], timeout=timeout)

    def take_bases(self, bases: list[str]) -> None:
        """Copy the base images in (not timed)."""
        for base in bases:
            with tempfile.TemporaryDirectory() as folder:
                archive = Path(folder) / "base.tar"
                _run(["podman", "save", "-o", str(archive), base], env=_operator_env())
                self.podman("load", "-q", "-i", str(archive))

    def build(self, task: Path) -> str:
        tag = f"localhost/bench-ref:{task.name}"
        self.podman("build", "--isolation", "chroot", "-q", "-t", tag,
                    str(task / "environment"))
        return tag

    def trial(self, task: Path, tag: str, index: int) -> float:
        """One trial in a fresh container; its reward."""
        name = f"bench-ref-{os.getpid()}-{index}"
        self.podman("create", "--name", name, tag, "true")
        try:
            rootfs = Path(self.podman("mount", name).strip())
            shutil.copytree(task / "solution", rootfs / "solution")
            self._runc(rootfs, f"{name}-solve", ["bash", "/solution/solve.sh"], "/app")
            shutil.copytree(task / "tests", rootfs / "tests")
            self._runc(rootfs, f"{name}-test", ["bash", "/tests/test.sh"], "/app")
            return float((rootfs / "logs" / "verifier" / "reward.txt").read_text())
        finally:
            subprocess.run(["podman", "--root", str(self.root), "--runroot", str(self.runroot),
                            "--storage-driver", "overlay", "rm", "-f", name],
                           capture_output=True, check=False, timeout=120)

    def _runc(self, rootfs: Path, ident: str, args: list[str], cwd: str) -> None:
        bundle = self.bundles / ident
        bundle.mkdir()
        _run(["runc", "spec"], cwd=bundle)
        config = json.loads((bundle / "config.json").read_text())
        config["root"] = {"path": str(rootfs), "readonly": False}
        caps = list(DOCKER_CAPS)  # Docker's default set, as `docker run` gives
        config["process"]["capabilities"] = {kind: caps for kind in (
            "bounding", "effective", "permitted")}
        config["process"].update(terminal=False, args=args, cwd=cwd, env=[
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME=/root"])
        (bundle / "config.json").write_text(json.dumps(config))
        try:
            _run(["runc", "run", "--bundle", str(bundle), ident], timeout=600)
        finally:
            shutil.rmtree(bundle, ignore_errors=True)

    def job(self, tasks: list[Path], n: int, *, build: bool, k: int = 1
            ) -> tuple[float, list[float]]:
        """Seconds for `k` trials of every task (each built first when `build`, k = 1),
        and the rewards."""
        assert k == 1 or not build
        start = time.perf_counter()

        def one(pair: tuple[int, Path]) -> float:
            index, task = pair
            tag = self.build(task) if build else f"localhost/bench-ref:{task.name}"
            return self.trial(task, tag, index)

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            rewards = list(pool.map(one, enumerate(tasks * k)))
        return time.perf_counter() - start, rewards


def _du(*paths: Path) -> int:
    """Bytes under `paths` (`du -scbx`: hard links once, never into another file system —
    the image store's views are overlays of its own layers)."""
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return 0
    out = _run(["du", "-scbx", *existing])
    return int(out.strip().splitlines()[-1].split()[0])


def trialledger_job(name: str, data: Path, db: Path, cache: Path, n: int, k: int = 1
                    ) -> tuple[float, list[float]]:
    """Seconds for `job run NAME DATA --agent oracle -n N -k K`, and the tasks' mean
    rewards."""
    start = time.perf_counter()
    _run([*TRIALLEDGER, "job", "run", name, str(data), "--agent", "oracle", "-n", str(n),
          "-k", str(k), "--db", str(db), "--cache-dir", str(cache)], env=_operator_env())
    seconds = time.perf_counter() - start
    shown = json.loads(_run([*TRIALLEDGER, "job", "show", name, "--db", str(db), "--json"]))
    rewards = [float(t["mean"]) for t in shown["tasks"]
               if t["task"] is not None and t["mean"] is not None]
    return seconds, rewards


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--tasks", type=int, default=12)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--no-apt", action="store_true",
                        help="no task installs a package (no mirror needed; for a smoke run)")
    parser.add_argument("-k", type=int, default=4,
                        help="trials per task of the campaign-sized warm job (1: none)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench.containers: needs root (run `trialledger setup` first)")
    bases = _bases()
    with tempfile.TemporaryDirectory(prefix="bench-containers-") as scratch_name:
        scratch = Path(scratch_name)
        scratch.chmod(0o755)
        cache, db = scratch / "cache", scratch / "jobs.db"
        warmup = dataset(scratch / "warmup", len(bases), bases, apt=False)
        trialledger_job("warmup", warmup, db, scratch / "warmup-cache", args.n)
        reference = Reference(scratch / "reference")
        reference.take_bases(bases)
        data = dataset(scratch / "data", args.tasks, bases, apt=not args.no_apt)
        tasks = sorted(p for p in data.iterdir() if p.is_dir())
        parts_before = {"build storage": _du(BUILD_STORAGE), "image store": _du(IMAGE_STORE)}
        ref_before = _du(reference.root)

        ours_cold, ours_cold_rewards = trialledger_job("cold", data, db, cache, args.n)
        ref_cold, ref_cold_rewards = reference.job(tasks, args.n, build=True)
        ours_warm, ours_warm_rewards = trialledger_job("warm", data, db, cache, args.n)
        ref_warm, ref_warm_rewards = reference.job(tasks, args.n, build=False)
        campaign = None  # warm, k trials a task: the job's fixed cost spread as a campaign's
        if args.k > 1:
            campaign = (trialledger_job("campaign", data, db, cache, args.n, args.k),
                        reference.job(tasks, args.n, build=False, k=args.k))

        parts = {"cache": _du(cache), "image store": _du(IMAGE_STORE) - parts_before[
            "image store"], "build storage": _du(BUILD_STORAGE) - parts_before["build storage"]}
        # SPEC §16's measure: the session image store and the cache (what sessions read);
        # the build storage, the builder's working copy as the reference's storage is, shown
        ours_disk = parts["cache"] + parts["image store"]
        ref_disk = _du(reference.root) - ref_before
        for side, rewards in (("trialledger cold", ours_cold_rewards),
                              ("reference cold", ref_cold_rewards),
                              ("trialledger warm", ours_warm_rewards),
                              ("reference warm", ref_warm_rewards),
                              *((("trialledger campaign", campaign[0][1]),
                                 ("reference campaign", campaign[1][1]))
                                if campaign else ())):
            if len(rewards) < len(tasks) or set(rewards) != {1.0}:
                print(f"  note: {side} rewards {rewards} (every task should score 1)")
        print(f"\n  {len(tasks)} Dockerfile tasks on {len(bases)} bases, -n {args.n}, "
              f"apt in {0 if args.no_apt else len(tasks[::3])} of them")
        print(f"  {'':24}{'trialledger':>12}{'reference':>12}")
        print(f"  {'cold, s':24}{ours_cold:12.1f}{ref_cold:12.1f}")
        print(f"  {'warm, s':24}{ours_warm:12.1f}{ref_warm:12.1f}")
        if campaign:
            print(f"  {f'warm, {args.k} trials a task':24}{campaign[0][0]:12.1f}"
                  f"{campaign[1][0]:12.1f}")
        print(f"  {'disk for the images, MB':24}{ours_disk / 1e6:12.1f}{ref_disk / 1e6:12.1f}"
              f"  (image store + cache)")
        for part, grown in parts.items():
            print(f"  {'  of which ' + part:24}{grown / 1e6:12.1f}")
        print(f"ratio cold {ours_cold / ref_cold:.2f}x (goal <= 1.0x)")
        print(f"ratio warm {ours_warm / ref_warm:.2f}x (goal <= 1.1x)")
        if campaign:
            print(f"ratio warm, {args.k} trials a task {campaign[0][0] / campaign[1][0]:.2f}x "
                  f"(the same goal over {args.k * len(tasks)} trials)")
        print(f"ratio disk {ours_disk / max(ref_disk, 1):.2f}x (goal <= 1.1x; image store and "
              f"cache, as SPEC §16 measures)")
        for tag in (f"localhost/bench-ref:{task.name}" for task in tasks):
            subprocess.run(["podman", "--root", str(reference.root), "--runroot",
                            str(reference.runroot), "--storage-driver", "overlay", "rmi",
                            "-f", tag], capture_output=True, check=False)
        subprocess.run(["podman", "--root", str(reference.root), "--runroot",
                        str(reference.runroot), "--storage-driver", "overlay", "system",
                        "reset", "-f"], capture_output=True, check=False)


if __name__ == "__main__":
    main()
