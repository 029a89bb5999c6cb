"""Which real parts a test needs, found from what it calls (tests/README.md, "Tiers").

A test is marked `codex`, `images`, `browser` or `postgres` when the test function, a
fixture it uses, or any helper of this package they call (followed through their
bytecode's global names, modules' attributes and nested functions) reaches one of the
places that part is obtained: `tests.runs.codex_path` (the pinned Codex CLI), the
`tests.images` module (the task images built offline), `playwright` (Debian's Chromium),
`tests.pg.PostgresServer` or the `postgres` fixture (a real PostgreSQL). Nothing is
declared by hand, so a new test is in the right tier the day it is written.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest

TIERS = ("codex", "images", "browser", "postgres")
ROOTS = {("tests.runs", "codex_path"): "codex", ("tests.pg", "PostgresServer"): "postgres"}
MODULES = {"tests.images": "images", "playwright": "browser"}


def _module_need(module: types.ModuleType) -> str | None:
    name = module.__name__
    return next((need for root, need in MODULES.items()
                 if name == root or name.startswith(root + ".")), None)


def _ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "tests"


def _code_needs(code: types.CodeType, scope: dict[str, Any], seen: set[int]) -> set[str]:
    found: set[str] = set()
    modules = []
    for name in code.co_names:
        obj = scope.get(name)
        if isinstance(obj, types.ModuleType):
            modules.append(obj)
        found |= _needs(obj, seen)
    for module in modules:  # `images.podman_image`, `runs.codex_path`: its attributes
        if (need := _module_need(module)) is not None:
            found.add(need)
        elif module.__name__.split(".")[0] == "tests":
            for name in code.co_names:
                found |= _needs(getattr(module, name, None), seen)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _code_needs(const, scope, seen)
    return found


@functools.cache
def _function_needs(function: Callable[..., Any]) -> frozenset[str]:
    return frozenset(_needs(function, set()))


def _needs(obj: Any, seen: set[int]) -> set[str]:
    if obj is None or id(obj) in seen:
        return set()
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        return {need} if (need := _module_need(obj)) else set()
    module = getattr(obj, "__module__", None) or ""
    root = ROOTS.get((module, getattr(obj, "__qualname__", "")))
    if root is not None:
        return {root}
    if (need := _module_need(types.ModuleType(module))) is not None:  # `sync_playwright`
        return {need}
    if isinstance(obj, functools.partial):
        return _needs(obj.func, seen)
    if isinstance(obj, type) and _ours(obj):
        return set().union(*(_needs(v, seen) for v in vars(obj).values()))
    if isinstance(obj, staticmethod | classmethod | property):
        return set().union(*(_needs(f, seen) for f in (
            getattr(obj, "__func__", None), getattr(obj, "fget", None))))
    function = getattr(obj, "__wrapped__", obj)
    if isinstance(function, types.FunctionType) and _ours(function):
        return _code_needs(function.__code__, function.__globals__, seen)
    return set()


def _fixture_functions(item: pytest.Item) -> Iterable[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    for definitions in (info.name2fixturedefs.values() if info is not None else ()):
        for definition in definitions:
            yield definition.func


def needs(item: pytest.Item) -> set[str]:
    """The tiers `item` belongs to."""
    found: set[str] = set()
    if isinstance(item, pytest.Function):
        found |= _function_needs(item.function)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("db") == "postgresql" or "postgres" in item.fixturenames:
            found.add("postgres")
    for function in _fixture_functions(item):
        found |= _function_needs(function)
    return found
