"""The suite's tiers (tests/README.md): each test is marked with the real parts it needs,
from what it calls, so `-m "not codex and not images and not browser"` is a loop that
needs none of them and the slow tiers are never left out by a missing mark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _collected(mark: str, *files: str) -> set[str]:
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", mark, *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode in (0, 5), ran.stdout + ran.stderr  # 5: none selected
    return {line for line in ran.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_each_test_is_in_the_tier_of_what_it_calls() -> None:
    codex = _collected("codex", "tests/session/test_runner.py", "tests/core/test_core_purity.py")
    # a run of the real Codex through tests.runs.run_task
    assert ("tests/session/test_runner.py::test_a_shell_tool_call_really_runs_and_is_observed"
            in codex)
    assert not any("test_core_purity" in test for test in codex)
    images = _collected("images", "tests/environments/test_images.py",
                        "tests/core/test_core_purity.py")
    assert ("tests/environments/test_images.py::"
            "test_a_missing_image_is_built_from_its_dockerfile_and_runs" in images)
    assert not any("test_core_purity" in test for test in images)
    browser = _collected("browser", "tests/view/test_view.py")
    assert ("tests/view/test_view.py::test_links_navigate_from_the_jobs_to_a_trial_to_its_session"
            in browser)
    postgres = _collected("postgres", "tests/store/test_store.py")
    assert "tests/store/test_store.py::test_a_rejected_seed_leaves_nothing[postgresql]" in postgres
    assert "tests/store/test_store.py::test_a_rejected_seed_leaves_nothing[sqlite]" not in postgres


def test_the_quick_loop_holds_no_codex_image_or_browser_test() -> None:
    quick = _collected("not codex and not images and not browser",
                       "tests/session/test_runner.py", "tests/environments/test_images.py",
                       "tests/view/test_view.py", "tests/core/test_core_purity.py")
    assert "tests/core/test_core_purity.py::test_core_imports_nothing_outward" in quick
    # test_runner.py's one test that starts no Codex (bwrap is refused first) stays in
    assert {test for test in quick if test.startswith((
        "tests/session/test_runner.py", "tests/environments/test_images.py"))} == {
        "tests/session/test_runner.py::test_sandbox_refuses_slash_without_bwrap"}
