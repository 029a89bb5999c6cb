"""Where a Dockerfile task's environment spends its time (SPEC §16): `job run --agent
oracle` in this process, cold then warm, over `bench.containers`' dataset, with each step
of the preparation timed where it is called.

    python -m bench.preparation [--tasks 2] [-n 1]

Printed per job: its wall time and, for each step, the seconds summed over its calls (a
step called inside another is counted in both; with `-n` above 1 the sums pass the wall
time). Needs what `bench.containers` needs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import containers
from tests import images
from trialledger import cli

SPENT: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()

# (module[:class], attribute, label): the steps timed; a missing one is skipped, so the same
# table serves before and after a step is removed.
STEPS: list[tuple[str, str, str]] = [
    ("images.prepare", "prepare", "preparation, whole"),
    ("images.build", "_copy_base_images", "FROM images into the build storage"),
    ("images.build", "resolve_base", "FROM image ids"),
    ("images.build", "_image_id", "image ids (podman inspect)"),
    ("images.imageids", "operator_image_id", "the operator's image ids (kept while unchanged)"),
    ("images.build", "_in_build_storage", "build storage's image ids (kept while unchanged)"),
    ("images.build", "_build", "podman build"),
    ("images.build", "_save", "podman save (oci-archive)"),
    ("images.unpack", "_to_layout", "skopeo archive → layout"),
    ("images.unpack", "_unpack_layout", "umoci unpack"),
    ("images.environment", "without_devices", "device nodes removed"),
    ("images.environment", "_tree_size", "entry size"),
    ("images.imagestore:ImageStore", "export_built", "built image exported by the build user"),
    ("images.imagestore:ImageStore", "take", "copy into the image store (skopeo, root)"),
    ("images.imagestore:ImageStore", "environment", "image store look-up"),
    ("sandbox.local:LocalSandbox", "__init__", "sandbox made"),
]


def _timed(original: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            with _LOCK:
                SPENT[label] += time.perf_counter() - start
                CALLS[label] += 1
    return wrapper


def _instrument() -> None:
    for where, name, label in STEPS:
        module, _, cls = where.partition(":")
        try:
            holder: Any = importlib.import_module(f"trialledger.adapters.{module}")
        except ImportError:
            continue
        holder = getattr(holder, cls, None) if cls else holder
        if holder is not None and hasattr(holder, name):
            setattr(holder, name, _timed(getattr(holder, name), label))


def _job(name: str, data: Path, db: Path, cache: Path, n: int) -> None:
    SPENT.clear()
    CALLS.clear()
    start = time.perf_counter()
    with contextlib.suppress(SystemExit):
        cli.main(["job", "run", name, str(data), "--agent", "oracle", "-n", str(n),
                  "--db", str(db), "--cache-dir", str(cache)])
    print(f"\n== {name}: {time.perf_counter() - start:.1f} s wall")
    for label, seconds in sorted(SPENT.items(), key=lambda item: -item[1]):
        print(f"  {label:52}{seconds:8.1f} s  ({CALLS[label]}×)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("-n", type=int, default=1)
    args = parser.parse_args(argv)
    _instrument()
    bases = containers._bases()
    os.environ["CONTAINERS_STORAGE_CONF"] = str(images.storage_conf())
    with tempfile.TemporaryDirectory(prefix="bench-preparation-") as scratch_name:
        scratch = Path(scratch_name)
        scratch.chmod(0o755)
        data = containers.dataset(scratch / "data", args.tasks, bases, apt=False)
        for name in ("cold", "warm"):
            _job(name, data, scratch / "jobs.db", scratch / "cache", args.n)
        print(f"\n  cache: {containers._du(scratch / 'cache') / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
