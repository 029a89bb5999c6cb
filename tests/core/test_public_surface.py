"""SPEC §10: the library's public names are exactly what `trialledger.core`,
`trialledger.store` and `trialledger.adapters` export, and docs/library.md ("The public
names") lists each of them — no more, no fewer; everything else is reached by its module
path."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trialledger.core", "trialledger.store", "trialledger.adapters")


def documented() -> dict[str, list[str]]:
    """Each package's names as the page's tables list them (a row's first cell)."""
    page = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    section = page.split("\n## The public names\n", 1)[1].split("\n## ", 1)[0]
    names: dict[str, list[str]] = {}
    package = None
    for line in section.splitlines():
        if heading := re.fullmatch(r"### `([\w.]+)`", line):
            package = heading[1]
            names[package] = []
        elif (row := re.match(r"\| `(\w+)` \|", line)) and package is not None:
            names[package].append(row[1])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_exports_exactly_the_names_the_page_lists(package: str) -> None:
    listed = documented()[package]
    assert len(listed) == len(set(listed))
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(listed)
    for name in module.__all__:  # each one is there (the store's and adapters' on first use)
        assert getattr(module, name) is not None


def test_nothing_else_of_ours_is_reachable_from_a_package() -> None:
    """An internal name (a parser, the machine, a seed validator, the job queue) is
    imported from its module; a package holds only the listed names and its submodules."""
    for package in PACKAGES:
        module = importlib.import_module(package)
        ours = {name for name, value in vars(module).items()
                if not name.startswith("_") and not isinstance(value, ModuleType)
                and str(getattr(value, "__module__", "")).startswith("trialledger.")}
        assert ours <= set(module.__all__), package
        for internal in ("parse_event", "validate_seed", "Session", "Jobs", "run_session"):
            with pytest.raises(AttributeError):
                getattr(module, internal)
