"""A step's separate verifier (docs/SPEC.md §17, "Multi-step tasks"), resolved as Harbor
0.26 resolves it — checked against Harbor's own `resolve_step_verifier_mode` and
`resolve_verifier_environment_definition` over every combination of the task's and the
step's `environment_mode`, `[verifier.environment]` table and tests/Dockerfile."""

from __future__ import annotations

import importlib
import itertools
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.harbor_models import _python_312_typing, fetch
from trialledger.adapters.demo import samples
from trialledger.adapters.tasks.task import Task, TaskInvalid

MODES = (None, "shared", "separate")
TABLES = {None: "", "empty": "", "image": "docker_image = 'localhost/{who}-grader:1'\n",
          "settings": "workdir = '/{who}-grade'\n"}


def harbor() -> dict[str, ModuleType]:
    folder = str(fetch())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    with _python_312_typing():
        return {name: importlib.import_module(f"harbor.models.task.{name}")
                for name in ("config", "paths", "verifier_mode")}


def verifier_toml(mode: str | None, table: str | None, who: str, header: str) -> str:
    text = f"[{header}]\n" + (f"environment_mode = '{mode}'\n" if mode else "")
    if table is not None:
        text += f"[{header}.environment]\n" + TABLES[table].format(who=who)
    return text


def a_task(folder: Path, task: tuple[str | None, str | None, bool],
           step: tuple[str | None, str | None, bool]) -> Path:
    (folder / "steps" / "one").mkdir(parents=True)
    (folder / "steps" / "one" / "instruction.md").write_text("go\n")
    samples.executable(folder / "tests" / "test.sh", "#!/bin/sh\n")
    for dockerfile, tests in ((task[2], folder / "tests"),
                              (step[2], folder / "steps" / "one" / "tests")):
        if dockerfile:
            tests.mkdir(parents=True, exist_ok=True)
            (tests / "Dockerfile").write_text("FROM scratch\n")
    (folder / "task.toml").write_text(
        "[environment]\ndocker_image = 'localhost/task:1'\nworkdir = '/app'\n"
        + verifier_toml(task[0], task[1], "task", "verifier")
        + "[[steps]]\nname = 'one'\n" + verifier_toml(step[0], step[1], "step", "steps.verifier"))
    return folder


SIDES = list(itertools.product(MODES, TABLES, (False, True)))


@pytest.mark.parametrize("task_side", SIDES, ids=str)
def test_a_steps_verifier_is_resolved_as_harbors(tmp_path: Path,
                                                 task_side: tuple[Any, ...]) -> None:
    h = harbor()
    for number, step_side in enumerate(SIDES):
        folder = a_task(tmp_path / str(number), task_side, step_side)
        meta = tomllib.loads((folder / "task.toml").read_text())
        try:
            config = h["config"].TaskConfig.model_validate(meta)
        except ValueError:  # `shared` beside an environment table: Harbor's model refuses
            with pytest.raises(TaskInvalid, match="'shared' is incompatible"):
                Task.load(folder)
            continue
        (step,) = Task.load(folder).steps
        mode = h["verifier_mode"].resolve_step_verifier_mode(config, config.steps[0])
        ours = step.separate_verifier
        assert (ours is not None) == (mode.value == "separate"), (task_side, step_side)
        if ours is None:
            continue
        theirs = h["verifier_mode"].resolve_verifier_environment_definition(
            config, h["paths"].TaskPaths(folder), config.steps[0], validate_inputs=False)
        said = (task_side, step_side)
        assert ours.bundled == theirs.bundled_tests, said
        assert ours.workdir == theirs.config.workdir, said
        if ours.source is None:  # the task's own image, the tests uploaded
            assert theirs.config.docker_image == "localhost/task:1", said
        elif ours.source.kind == "docker_image":
            assert ours.source.value == theirs.config.docker_image, said
        else:  # built from the tests folder Harbor picks
            assert theirs.config.docker_image is None, said
            assert ours.source.path == theirs.directory, said


def test_a_step_verifier_on_a_host_task_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "task"
    (folder / "steps" / "one").mkdir(parents=True)
    (folder / "steps" / "one" / "instruction.md").write_text("go\n")
    samples.executable(folder / "tests" / "test.sh", "#!/bin/sh\n")
    (folder / "task.toml").write_text("[[steps]]\nname = 'one'\n[steps.verifier]\n"
                                      "environment_mode = 'separate'\n")
    with pytest.raises(TaskInvalid) as refused:
        Task.load(folder)
    assert str(refused.value).endswith(
        "[[steps]] 'one' verifier.environment_mode = 'separate': a separate verifier needs "
        "range mode, which a host task (no [environment] image or rootfs) does not have")
