"""Task environments (SPEC §12, §15): sandbox start over a cached image (single-id mode,
and range mode where available) beside the host-root sandbox in the same run, the share
of a start that the per-session bwrap check takes, the first unpack of the Debian test
image, and how long a second process takes to find that image cached.

    python -m bench.images [--starts 100]

Needs the image tools `.ci/run` installs (podman, skopeo, umoci, mmdebstrap) and, as root,
the sandbox user (`trialledger setup`). The Debian image is the tests' own (tests/images.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from tests import images
from trialledger.adapters.images.environment import HOST, Cache, Environment
from trialledger.adapters.images.imagestore import plain_cache
from trialledger.adapters.images.unpack import prepare_archive
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.local import LocalSandbox, bwrap_problem
from trialledger.adapters.sandbox.rangemode import range_problem


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def _start(environment: Environment, workdir: str, index: int,
                 lifetime: str = "strict") -> float:
    """Milliseconds for one start of `true` (our init's probe) in a fresh sandbox: the
    session's folders, the overlay and bwrap included (`harbor`: the session's container
    started, then the probe joined into it, then the container stopped)."""
    start = time.perf_counter()
    sandbox = LocalSandbox(session_key=f"bench-{index:04d}", workdir=workdir,
                           environment=environment, lifetime=lifetime)
    try:
        result = await sandbox.probe(10)
        assert result.alive, result.detail
    finally:
        await sandbox.close()
        sandbox.discard()
    return (time.perf_counter() - start) * 1000


def _check() -> float:
    """Milliseconds of the bwrap check every session now runs before it starts (SPEC
    §11: never cached), as the sandbox user with the shared process limit."""
    start = time.perf_counter()
    assert bwrap_problem(sandbox_user()) is None
    return (time.perf_counter() - start) * 1000


async def _starts(image: Environment, plain: Environment | None, n: int
                  ) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """`n` starts each of the host-root sandbox, of the image's (single-id mode) and of its
    plain entry's (range mode, when `plain`), and `n` bwrap checks, taken in turns so that
    whatever else the machine does weighs on all alike."""
    host, over_image, in_range, container, checks = [], [], [], [], []
    for index in range(n):
        host.append(await _start(HOST, "/app", 4 * index))
        over_image.append(await _start(image, "/", 4 * index + 1))
        if plain is not None:
            in_range.append(await _start(plain, "/", 4 * index + 2))
            container.append(await _start(plain, "/", 4 * index + 3, "harbor"))
        checks.append(_check())
    return host, over_image, in_range, container, checks


def _second_process(archive: Path, cache: Path) -> float:
    """Milliseconds a fresh process takes to find the archive's entry (import excluded)."""
    code = ("import sys, time; from pathlib import Path; "
            "from trialledger.adapters.images.environment import Cache; "
            "from trialledger.adapters.images.unpack import prepare_archive; "
            "t = time.perf_counter(); "
            "prepare_archive(Path(sys.argv[1]), 'image.tar', Cache(Path(sys.argv[2])), None); "
            "print((time.perf_counter() - t) * 1000)")
    done = subprocess.run([sys.executable, "-c", code, str(archive), str(cache)],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def report(starts: int) -> None:
    owner = sandbox_user().uid if os.geteuid() == 0 else None
    os.environ["CONTAINERS_STORAGE_CONF"] = str(images.storage_conf())
    with tempfile.TemporaryDirectory(prefix="bench-images-") as work:
        archive = images.oci_archive(images.DEBIAN_REF, Path(work) / "image.tar")
        cache = Cache(Path(work) / "cache")
        begin = time.perf_counter()
        debian = prepare_archive(archive, "image.tar", cache, owner)
        unpack_s = time.perf_counter() - begin
        size_mb = sum(e.size for e in cache.entries()) / 1e6
        found_ms = [_second_process(archive, cache.folder) for _ in range(5)]
        plain = (prepare_archive(archive, "image.tar", plain_cache(Path(work) / "plain"), None)
                 if range_problem() is None else None)
        host, image, in_range, container, checks = anyio.run(_starts, debian, plain, starts)
    print(f"{'sandbox start (probe)':<34} {'p50 ms':>8} {'p95 ms':>8}")
    print(f"{'host root (workdir /app)':<34} {_p(host, 50):8.1f} {_p(host, 95):8.1f}")
    print(f"{'Debian image overlay (workdir /)':<34} {_p(image, 50):8.1f} {_p(image, 95):8.1f}")
    if in_range:
        print(f"{'the same in range mode':<34} {_p(in_range, 50):8.1f} "
              f"{_p(in_range, 95):8.1f}")
        print(f"{'range, container + joined probe':<34} {_p(container, 50):8.1f} "
              f"{_p(container, 95):8.1f}")
    print(f"first unpack of the Debian image ({size_mb:.0f} MB): {unpack_s:.1f} s")
    print(f"a second process finds it cached: {statistics.median(found_ms):.1f} ms (median of 5)")
    print(f"ratio image_start_p50/host_start_p50 {_p(image, 50) / _p(host, 50):.2f}")
    print(f"ratio image_start_p95/host_start_p95 {_p(image, 95) / _p(host, 95):.2f}")
    if in_range:
        print(f"ratio range_start_p50/host_start_p50 {_p(in_range, 50) / _p(host, 50):.2f} "
              f"(goal <= 1.25)")
        print(f"ratio container_start_p50/host_start_p50 "
              f"{_p(container, 50) / _p(host, 50):.2f} (verifier_isolation = harbor)")
    else:
        print(f"range mode unavailable here: {range_problem()}")
    print(f"ratio bwrap_check_p50/host_start_p50 {_p(checks, 50) / _p(host, 50):.2f} "
          f"(the check alone: {_p(checks, 50):.1f} ms p50; it is part of every start)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=100)
    report(parser.parse_args().starts)


if __name__ == "__main__":
    main()
