"""Policy v2 (SPEC §3): R5b `endpoint_unreachable`, which policy a session is decided
under, built-in names, and the endpoint check before the first session."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.runs import codex_path, in_process, make_task, run_task
from tests.scenarios import LogBuilder
from tests.views import decided, seeded
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, hang, message
from trialledger.core import replay
from trialledger.core.errors import PolicyNameTaken
from trialledger.core.policy import Policy, register_policy
from trialledger.store import Ledger

pytestmark = pytest.mark.anyio
# What Codex 0.171.0 prints when its endpoint refuses connections (recorded from a real run).
REFUSED = "Reconnecting... waiting for network (Connection failed: error sending request)"
STARTED = ['{"type":"thread.started","thread_id":"t"}', '{"type":"turn.started"}']


def timed_out_after(lines: list[str], policy: str | None = "v2") -> Any:
    builder = LogBuilder().launched().codex(lines).finish(-15, timed_out=True)
    log = builder.events
    if policy is not None:
        log[0]["data"]["settings"]["policy"] = policy
    return replay(log)


def stream_error(message: str) -> str:
    return json.dumps({"type": "error", "message": message})


def test_a_timeout_while_reconnecting_is_the_endpoints_and_retried() -> None:
    view = timed_out_after([*STARTED, stream_error(REFUSED)])
    d = view.decision
    assert (d.policy, d.rule, d.action, d.http_status) == ("v2", "endpoint_unreachable",
                                                           "retry", 502)
    assert (d.status, d.error, d.reward_valid) == ("incomplete", REFUSED, False)
    assert d.cause.kind == "model_endpoint" and d.cause.message == REFUSED
    assert d.incomplete_reason == "timeout"


def test_v1_grades_the_same_log_as_incomplete() -> None:
    d = timed_out_after([*STARTED, stream_error(REFUSED)], policy="v1").decision
    assert (d.policy, d.rule, d.action) == ("v1", "incomplete", "verify")


def test_the_status_code_is_parsed_from_the_reconnect_message() -> None:
    message = "Reconnecting... 2/5 (unexpected status 503 Service Unavailable: busy)"
    d = timed_out_after([*STARTED, stream_error(message)]).decision
    assert d.rule == "endpoint_unreachable" and d.cause.status_code == 503


def test_an_answer_after_reconnecting_makes_the_timeout_the_agents() -> None:
    answered = '{"type":"item.completed","item":{"id":"i","type":"agent_message","text":"hm"}}'
    d = timed_out_after([*STARTED, stream_error(REFUSED), answered]).decision
    assert (d.rule, d.action) == ("incomplete", "verify")


def test_unknown_lines_after_reconnecting_do_not_hide_it() -> None:
    d = timed_out_after([*STARTED, stream_error(REFUSED), '{"type":"future.thing"}']).decision
    assert d.rule == "endpoint_unreachable"


def test_without_a_timeout_r5b_does_not_apply() -> None:
    builder = LogBuilder().launched().codex([*STARTED, stream_error(REFUSED)]).finish(1)
    builder.events[0]["data"]["settings"]["policy"] = "v2"
    assert decided(replay(builder.events)).rule != "endpoint_unreachable"


def test_which_policy_the_seed_names_it_else_the_recorded_decisions_else_v1() -> None:
    log = LogBuilder().launched().codex([*STARTED, stream_error(REFUSED)]).finish(
        -15, timed_out=True).events
    assert decided(replay(log)).policy == "v1"  # a seed from before seeds named one
    log[0]["data"]["settings"]["policy"] = "v2"
    assert decided(replay(log)).policy == "v2"
    assert decided(replay(log, policy="v1")).policy == "v1"  # the override wins


async def test_the_store_writes_its_default_policy_into_new_seeds(tmp_path: Path) -> None:
    seed = LogBuilder().events[0]["data"]
    async with await Ledger.open(str(tmp_path / "a.db")) as ledger:
        first = await ledger.seed(seed)
        assert seeded(await ledger.view(first.session_id)).settings.policy == "v2"
    async with await Ledger.open(str(tmp_path / "b.db"), policy="v1") as ledger:
        second = await ledger.seed(seed)
        named = await ledger.seed({**seed, "settings": {"policy": "v2"}})
        assert seeded(await ledger.view(second.session_id)).settings.policy == "v1"
        assert seeded(await ledger.view(named.session_id)).settings.policy == "v2"


def test_a_built_in_policy_name_cannot_be_registered_again() -> None:
    for name in ("v1", "v2", "v3"):
        with pytest.raises(PolicyNameTaken):
            register_policy(Policy(name=name))


@pytest.mark.parametrize("policy", ["v2", "v3"])
async def test_real_codex_against_a_refused_endpoint_until_timeout_is_retried(
        tmp_path: Path, policy: str) -> None:
    from trialledger.adapters.session.runner import RunOptions, SessionRunner

    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    async with await Ledger.open(str(tmp_path / "t.db")) as ledger:
        result = await SessionRunner(ledger, task, RunOptions(
            model_base_url="http://127.0.0.1:9/v1", model="m", codex_bin=codex_path(),
            overrides={"timeout_s": 4, "policy": policy}, grace_s=1.0)).run_session()
    d = decided(result.view)
    # Under v3 the claim holds because the proxy itself saw the connection refused.
    assert (d.policy, d.rule, d.action) == (policy, "endpoint_unreachable", "retry")
    calls = [e.data for e in result.view.events if e.type == "model.call"]
    assert calls and all(c.error == "refused" for c in calls)
    assert d.error is not None and d.error.startswith("Reconnecting...")
    assert "verification.recorded" not in [e.type for e in result.view.events]


async def test_a_hanging_model_is_still_an_incomplete_run_under_v2(tmp_path: Path) -> None:
    # The model answered (a stream that then hangs): not R5b's case (v3 will catch it).
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [hang(60)],
                         settings={"timeout_s": 4}, grace_s=1.0)
    assert ran.view.decision.rule != "endpoint_unreachable"


def test_run_refuses_a_closed_endpoint_before_seeding(tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    port = closed.getsockname()[1]
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    try:
        done = in_process(
            "run", str(task.folder),
            "--db", str(tmp_path / "t.db"), "--model-base-url", f"http://127.0.0.1:{port}/v1",
            "--model", "m", "--codex-bin", codex_path())
    finally:
        closed.close()
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "does not answer" in done.stderr
    assert not (tmp_path / "t.db").exists()


def test_run_passes_an_endpoint_that_answers_with_any_status(tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    with ScriptedEndpoint([message()]) as endpoint:  # GET /models is a 501 here
        done = in_process(
            "run", str(task.folder),
            "--db", str(tmp_path / "t.db"), "--model-base-url", endpoint.url,
            "--model", "m", "--codex-bin", codex_path())
    assert done.returncode == 0 and done.stdout.split()[1] == "verify", done.stderr
