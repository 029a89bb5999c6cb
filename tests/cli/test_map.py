"""docs/map.md, the map from each rule of docs/SPEC.md to its code and its tests, cannot
rot silently: every path it names exists, every `path:Name` is defined in that file,
every `tests/…::test_name` is a test function there, and every section, subsection,
bold-headed rule and policy rule of the SPEC has a row (all read with `ast`: nothing is
imported)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "map.md"
SPEC = ROOT / "docs" / "SPEC.md"

# `path`, `path:Name` or `path:Class.method` (code); `tests/x.py::test_name[id]` (tests)
REF = re.compile(r"^(?P<path>[\w./-]+?)(?::(?P<name>[A-Za-z_][\w.]*)"
                 r"|::(?P<test>[A-Za-z_]\w*)(?:\[[^\]]*\])?)?$")
SECTION = re.compile(r"^§(\d+(?:\.\d+)?)\b")
NOT_BUILT = "not yet built"
NO_TEST = "no test"


def rows(text: str) -> list[tuple[int, str, str, str, str]]:
    """(line number, the map's `## N.` heading number, rule, code, tests) per table row."""
    found: list[tuple[int, str, str, str, str]] = []
    heading = ""
    for number, line in enumerate(text.splitlines(), 1):
        if match := re.match(r"^## (\d+)\.", line):
            heading = match.group(1)
        if not line.startswith("|") or line.startswith(("| rule ", "|---")):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        assert len(cells) == 3, f"docs/map.md:{number}: {len(cells)} cells, not 3: {line}"
        rule, code, tests = cells
        found.append((number, heading, rule, code, tests))
    return found


def refs(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@cache
def defined(path: Path) -> frozenset[str]:
    """Top-level names of a Python file, and `Class.member` of its top-level classes."""
    names: set[str] = set()

    def targets(node: ast.stmt) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        names.update(targets(node))
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{member}" for inner in node.body
                         for member in targets(inner))
    return frozenset(names)


@cache
def defined_tests(path: Path) -> frozenset[str]:
    return frozenset(node.name for node in ast.parse(path.read_text(encoding="utf-8")).body
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.name.startswith("test_"))


def faults(text: str) -> list[str]:
    """Every entry of the map that names nothing real, as `docs/map.md:LINE: why`."""
    found: list[str] = []
    for number, heading, rule, code, tests in rows(text):
        where = f"docs/map.md:{number}"
        section = SECTION.match(rule)
        if section is None:
            found.append(f"{where}: the rule does not start with its §number: {rule}")
        elif section.group(1).split(".")[0] != heading:
            found.append(f"{where}: §{section.group(1)} under the map's heading {heading}")
        if not refs(code) and NOT_BUILT not in code:
            found.append(f"{where}: no module, and not said to be {NOT_BUILT!r}")
        if not refs(tests) and NO_TEST not in tests:
            found.append(f"{where}: no test, and not said to have {NO_TEST!r}")
        for column, cell in (("code", code), ("tests", tests)):
            for ref in refs(cell):
                match = REF.match(ref)
                if match is None or (column == "code") != (match.group("test") is None):
                    found.append(f"{where}: `{ref}` is not a {column} reference")
                    continue
                path = ROOT / match.group("path")
                if not path.is_file():
                    found.append(f"{where}: {match.group('path')} does not exist")
                elif (name := match.group("name")) and name not in defined(path):
                    found.append(f"{where}: {name} is not defined in {match.group('path')}")
                elif (test := match.group("test")) and test not in defined_tests(path):
                    found.append(f"{where}: {test} is not a test of {match.group('path')}")
    return found


def spec_rules(spec: str) -> list[tuple[str, str]]:
    """(section number, what must have a row): every `## N.` and `### N.M` heading, each
    bold-headed rule (as the awk line of docs/map.md lists them) and each policy rule id
    (R0, R1, … R10) of the rule tables."""
    wanted: list[tuple[str, str]] = []
    section = ""
    for line in spec.splitlines():
        if match := re.match(r"^## (\d+)\. (.*)", line):
            section = match.group(1)
            wanted.append((section, f"§{section}"))
        elif match := re.match(r"^### (\d+\.\d+) ", line):
            wanted.append((section, f"§{match.group(1)}"))
        elif match := re.match(r"^(?:- )?\*\*([^*]+)\*\*", line):
            wanted.append((section, match.group(1).rstrip(".")))
        if match := re.match(r"^\| (R\d+[a-z]?) `", line):
            wanted.append((section, match.group(1)))
        if match := re.match(r"^\*\*Rule (R\d+[a-z]?) ", line):
            wanted.append((section, match.group(1)))
    return wanted


def missing_rows(spec: str, text: str) -> list[str]:
    by_section: dict[str, list[str]] = {}
    for _number, heading, rule, _code, _tests in rows(text):
        by_section.setdefault(heading, []).append(rule)
    missing = []
    for section, wanted in spec_rules(spec):
        cells = by_section.get(section, [])
        if wanted.startswith("§"):
            hit = any((match := SECTION.match(c)) is not None and f"§{match.group(1)}" == wanted
                      for c in cells)
        elif re.fullmatch(r"R\d+[a-z]?", wanted):
            hit = any(re.search(rf"(?<![\w]){wanted}(?![\w])", c) for c in cells)
        else:
            hit = any(wanted in c for c in cells)
        if not hit:
            missing.append(f"§{section}: {wanted}")
    return missing


def test_every_path_name_and_test_the_map_names_is_real() -> None:
    assert faults(MAP.read_text(encoding="utf-8")) == []


def test_every_section_and_rule_of_the_spec_has_a_row() -> None:
    assert missing_rows(SPEC.read_text(encoding="utf-8"), MAP.read_text(encoding="utf-8")) == []


def test_the_check_sees_a_renamed_path_name_or_test_and_a_missing_section() -> None:
    text = MAP.read_text(encoding="utf-8")
    renamed = {"`core/machine.py:Session.apply`": "`core/machines.py:Session.apply`",
               "`core/redact.py:scrub`": "`core/redact.py:scrubbed`",
               "`tests/core/test_machine.py::test_every_table_entry_is_live`":
                   "`tests/core/test_machine.py::test_every_entry_is_live`",
               "`tests/core/test_redact.py::test_json_escaped_both_ways`":
                   "`tests/core/test_redact.py:test_json_escaped_both_ways`"}
    broken = text
    for old, new in renamed.items():
        assert old in broken
        broken = broken.replace(old, new, 1)
    found = sorted(fault.split(": ", 1)[1] for fault in faults(broken))
    assert found == sorted(["core/machines.py does not exist",
                     "test_every_entry_is_live is not a test of tests/core/test_machine.py",
                     "scrubbed is not defined in core/redact.py",
                     "`tests/core/test_redact.py:test_json_escaped_both_ways` is not a tests "
                     "reference"])
    spec = SPEC.read_text(encoding="utf-8") + "\n## 99. A section nobody mapped\n**A rule.** x\n"
    assert missing_rows(spec, text) == ["§99: §99", "§99: A rule"]
