"""A task.toml value of the wrong type (docs/SPEC.md §10): every key the loader reads, given a
value of any TOML type, either loads or is `TaskInvalid` naming the key — never another
exception; `run` refuses it in one line (exit 2), a dataset skips it with its reason."""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.jobs.test_job_inputs import NOP, store_rows, task
from tests.runs import in_process
from tests.tasks.test_mcp_servers import write_task
from trialledger.adapters.tasks.config import FIELDS
from trialledger.adapters.tasks.task import Task, TaskInvalid

# Every key the loader reads: task.toml's own (tasks/config.py FIELDS) and those of the tables and
# arrays it reads further (healthcheck, mcp_servers, artifacts, env tables).
HEALTHCHECK = ("command", "interval_sec", "timeout_sec", "start_period_sec",
               "start_interval_sec", "retries")
MCP = ("name", "url", "url", "transport", "command", "args", "headers")
ARTIFACT = ("source", "destination", "exclude", "service")
COLLECT = ("command", "service", "timeout_sec", "user")
PATHS = [path for path in FIELDS if "*" not in path] + [
    ("task", "name"), ("metadata", "trialledger", "reward_from_exit_code"),
    *(("environment", "healthcheck", key) for key in HEALTHCHECK),
    *(("environment", "env", "A"), ("verifier", "env", "B"), ("solution", "env", "C"))]

# Values a key plausibly holds, so a draw reaches the checks after the first one.
PLAUSIBLE = st.sampled_from(["public", "no-network", "allowlist", "linux", "/app", "4G",
                             "sse", "stdio", "http://127.0.0.1:9/", "root", "shared", "x",
                             "${HOME}", "echo ok", "a\x00b", "http://[::1/", 0, 1, 2, 30,
                             0.5, True, False])
SCALARS = st.one_of(
    PLAUSIBLE, st.text(max_size=6), st.integers(-2**63, 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.datetimes(timezones=st.none() | st.just(datetime.UTC)), st.dates(), st.times())
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "name", "source", "url"]), inner, max_size=3),
    max_leaves=5)


def _entries(keys: tuple[str, ...]) -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.lists(st.dictionaries(st.sampled_from(keys), VALUES, max_size=4), max_size=2)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """A task.toml whose known keys hold values of any TOML type."""
    doc: dict[str, Any] = {}
    for path in draw(st.lists(st.sampled_from(PATHS), max_size=5, unique=True)):
        table = doc
        for key in path[:-1]:
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                break
        else:
            table[path[-1]] = draw(VALUES)
    if draw(st.booleans()):
        environment = doc.setdefault("environment", {})
        if isinstance(environment, dict):
            environment["mcp_servers"] = draw(_entries(MCP))
    if draw(st.booleans()):
        doc["artifacts"] = draw(_entries(ARTIFACT))
    if draw(st.booleans()):
        verifier = doc.setdefault("verifier", {})
        if isinstance(verifier, dict):
            verifier["collect"] = draw(_entries(COLLECT))
    return doc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents())
def test_any_value_of_a_known_key_loads_or_is_task_invalid(doc: dict[str, Any],
                                                           tmp_path_factory: Any) -> None:
    folder = tmp_path_factory.mktemp("task")
    (folder / "instruction.md").write_text("hi")
    (folder / "task.toml").write_text(tomli_w.dumps(doc))
    try:
        Task.load(folder)
    except TaskInvalid as error:
        assert "\n" not in str(error)


@pytest.mark.parametrize("table,key,value,expected", [
    ("agent", "timeout_sec", '"thirty"', "positive number"),
    ("verifier", "timeout_sec", "[1]", "positive number"),
    ("agent", "timeout_sec", "nan", "positive number"),
    ("environment", "workdir", "3", "a string"),
    ("environment", "network_mode", "[]", "one of"),
    ("environment", "allowed_hosts", "{a = 1}", "a list"),
    ("verifier", "env", "3", "a table"),
    ("environment", "mcp_servers", "{a = 1}", "an array of tables"),
    ("verifier", "collect", "{a = 1}", "an array of tables"),
    ("environment", "image_archive", '"a\\u0000b"', "inside the task folder"),
])
def test_run_names_the_key_and_the_type_in_one_line(tmp_path: Path, table: str, key: str,
                                                    value: str, expected: str) -> None:
    write_task(tmp_path / "typed", f"[{table}]\n{key} = {value}\n")
    db = tmp_path / "t.db"
    done = in_process("run", str(tmp_path / "typed"), "--db", str(db), *NOP)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line, = done.stderr.strip().splitlines()
    assert f"[{table}] {key}" in line and expected in line, line
    assert not db.exists()


def test_an_unclosed_ipv6_url_of_an_mcp_server_is_refused_in_one_line(tmp_path: Path) -> None:
    write_task(tmp_path / "typed", '[[environment.mcp_servers]]\nname = "m"\n'
                                   'url = "http://[::1/"\n')
    done = in_process("run", str(tmp_path / "typed"), "--db", str(tmp_path / "t.db"), *NOP)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line, = done.stderr.strip().splitlines()
    assert "'m': url 'http://[::1/' must be an http(s) URL" in line, line


def test_a_datasets_task_of_a_wrong_type_is_skipped_with_the_reason(tmp_path: Path) -> None:
    task(tmp_path / "data" / "graded")
    write_task(tmp_path / "data" / "typed", '[agent]\ntimeout_sec = "thirty"\n')
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "bench", str(tmp_path / "data"), "--db", db, *NOP)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(r"skipped task typed.*\[agent\] timeout_sec.*positive number", done.stderr)
    assert [r["task"] for r in store_rows(db, "SELECT DISTINCT task FROM job_queue")] == [
        "graded"]
