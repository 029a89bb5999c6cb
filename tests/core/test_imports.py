"""Modules that import each other (issue 42's "no modules importing each other, lazily or
not"): every import of one trialledger module by another — at the top, inside a function
or under TYPE_CHECKING — read from the source, and the groups of modules that reach each
other through them: there is none, and a new one fails, naming its modules. Beside it,
the rule that a module past 500 lines says why at its top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("adapters", "core", "store")



def modules() -> dict[str, Path]:
    """Every module, by its name under `trialledger.` (a package by its own name)."""
    found = {"cli": ROOT / "cli.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The trialledger modules `path` imports anywhere in it (a `from P import m` of a
    submodule counts as importing `P.m`, not the package `P`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [sub for sub in subs if sub.removeprefix("trialledger.") in known]
            names = names or [node.module]
        else:
            continue
        found |= {name.removeprefix("trialledger.") for name in names
                  if name.startswith("trialledger.")} & known
    return found


def groups(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.add(frozenset(group))
    return found


def test_no_modules_import_each_other() -> None:
    found = modules()
    edges = {name: imports(path, set(found)) - {name} for name, path in found.items()}
    assert not groups(edges), sorted(map(sorted, groups(edges)))


def test_the_check_sees_a_cycle_a_lazy_import_makes() -> None:
    """Two modules of no group: one importing the other inside a function makes a group."""
    found = modules()
    edges = {name: imports(path, set(found)) - {name} for name, path in found.items()}
    assert "core.events" in edges["core.replay"]
    edges["core.events"] = edges["core.events"] | {"core.replay"}
    assert frozenset({"core.events", "core.replay"}) <= next(
        group for group in groups(edges) if "core.replay" in group)


LONG = 500  # lines: past this, a module's docstring says why it is one module


def test_a_module_over_500_lines_says_why_at_its_top() -> None:
    """Issue 42's "no module over ~500 lines without a reason written at its top": its
    docstring says so ("Over 500 lines: …", "Just over 500 lines: …")."""
    unexplained = []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        if source.count("\n") > LONG and "over 500 lines" not in (
                ast.get_docstring(ast.parse(source)) or "").lower():
            unexplained.append(f"{name} ({source.count(chr(10))} lines)")
    assert not unexplained, f"past {LONG} lines without saying why: {unexplained}"
