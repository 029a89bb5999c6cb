"""Shared fixtures: a real PostgreSQL server for the session, and per-test databases."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The suite keeps its bytecode caches (`__pycache__`, ignored by git) where the machine's
# PYTHONDONTWRITEBYTECODE says not to: without them every xdist worker rewrites the
# asserts of every test module again (≈ 4 s of a worker's start) and every `trialledger`
# process the tests start compiles the package again (≈ 0.1 s each, and alembic's
# revisions for every store it creates). Measured in tests/README.md. Set before the
# imports below, so that what they load is cached too.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from tests.pg import PostgresServer  # noqa: E402
from trialledger.adapters.sandbox.local import LocalSandbox  # noqa: E402
from trialledger.core.policy import POLICIES  # noqa: E402


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each kind for a new, empty store: a SQLite file not yet made
    (its first open copies the schema the process keeps, docs/library.md), or a
    PostgreSQL database already holding the head revision's empty schema (tests/pg.py)."""
    if request.param == "sqlite":
        return str(tmp_path / "trials.db")
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.create_store()


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[LocalSandbox]]:
    """Sandboxes outlive their session so a test can look at what the agent left; discarded
    after it as the runner would have (their slots, cgroups and folders freed: a test
    process that kept them all would run out of slots and wait for one forever)."""
    sandboxes: list[LocalSandbox] = []
    discard = LocalSandbox.discard
    monkeypatch.setattr(LocalSandbox, "discard", lambda self: sandboxes.append(self))
    yield sandboxes
    for sandbox in sandboxes:
        discard(sandbox)


@pytest.fixture(autouse=True)
def _policy_registry() -> Iterator[None]:
    """A policy a test registers — directly or through `--policy-file` — is gone after it."""
    before = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(before)


@pytest.fixture(autouse=True)
def _artifacts_in_tmp(tmp_path_factory: pytest.TempPathFactory,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A session run in this process without `sandbox_logs_dir` keeps its files (SPEC
    §15) under a temporary folder, never in the home cache."""
    from trialledger.adapters.session import artifacts

    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setattr(artifacts, "default_cache_dir", lambda: cache)


RUNTIME_ENV = "TRIALLEDGER_TEST_RUNTIME"  # bwrap: range-mode containers start under bwrap


@pytest.fixture(autouse=True)
def _runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite over range mode on another runtime than `setup`'s (docs/SPEC.md §16):
    with TRIALLEDGER_TEST_RUNTIME=bwrap (or crun) every session that has no `--runtime` of
    its own starts its range-mode container under it instead of the OCI runtime `setup`
    found able (runc on these machines)."""
    from trialledger.adapters.sandbox import runc

    if (runtime := os.environ.get(RUNTIME_ENV)) is not None:
        chosen = runc.check_runtime(runtime)
        monkeypatch.setattr(runc, "default_runtime", lambda: chosen)


@pytest.fixture
def reachable_tmp() -> Iterator[Path]:
    """A fresh folder under the temporary folder that other local users (the sandbox
    user) can reach, 0755; pytest's own `tmp_path` is root's alone."""
    folder = Path(tempfile.mkdtemp(prefix="tl-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the real parts it needs (tests/tiers.py)."""
    from tests.tiers import needs

    for item in items:
        for tier in sorted(needs(item)):
            item.add_marker(tier)
