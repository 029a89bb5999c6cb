"""JSON the agent wrote, read within limits (SPEC §11): the bounded reader's properties, and
each file the agent controls — a reward, a rollout line, a Harbor job folder — poisoned
through real Codex tool calls, or on disk, without crashing the runner."""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.jobs.test_harbor import CLEAN, THREAD, TURN, token_count, trial
from tests.runs import make_task, run_task
from trialledger.adapters.codex.rollout import usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.cli import main
from trialledger.core.boundedjson import MAX_DEPTH, UnsafeJSON, bounded_loads, nesting_depth
from trialledger.store import Ledger

DEEP = "[" * 100_000
HUGE = "1" * 400
fast = settings(max_examples=300, deadline=None)

# --- the reader ------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text())


@functools.cache
def json_values(depth: int) -> st.SearchStrategy[Any]:
    """JSON values nested at most `depth` levels (keys and strings of any text), built
    level by level: nothing drawn is thrown away (a depth filter over `st.recursive`
    rejected most deep draws and was half of the observation tests' time)."""
    if depth == 0:
        return scalars
    inner = json_values(depth - 1)
    return scalars | st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


JSONISH = "[]{}\"\\,:0123456789.eE-+ \nantrufleINfiy"  # what stresses a JSON scanner


@fast
@given(text=st.text() | st.text(alphabet=JSONISH) | st.binary().map(
    lambda b: b.decode("latin-1")))
def test_the_reader_raises_nothing_but_its_own_error(text: str) -> None:
    for given_text in (text, text.encode("utf-8", "surrogatepass"), "[" * 70 + text):
        with contextlib.suppress(UnsafeJSON):
            bounded_loads(given_text, limit=2**20)


@fast
@given(value=json_values(MAX_DEPTH), ascii_only=st.booleans(), indent=st.none() | st.just(1))
def test_the_reader_agrees_with_json_loads_on_shallow_valid_input(
        value: Any, ascii_only: bool, indent: int | None) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert bounded_loads(text, limit=2**22) == json.loads(text)
    assert nesting_depth(text) == _depth(value)  # the scan sees what the parser would


@fast
@given(value=json_values(3), extra=st.integers(1, 200))
def test_deeper_than_the_limit_is_refused_before_parsing(value: Any, extra: int) -> None:
    text = "[" * (MAX_DEPTH - _depth(value) + extra) + json.dumps(value)
    with pytest.raises(UnsafeJSON, match="nested deeper than 64"):
        bounded_loads(text + "]" * 70, limit=2**20)  # closed or not: the depth decides


@pytest.mark.parametrize(("text", "rule"), [
    (DEEP, "nested deeper than 64 levels"),
    ('{"a": "[[[[", "b": ' + "[" * 65 + "]" * 65 + "}", "nested deeper than 64 levels"),
    (HUGE, "an integer beyond 64 bits"), ("9223372036854775808", "an integer beyond 64 bits"),
    ("1" * 5000, "an integer beyond 64 bits"), ('{"reward": 1e400}', "a non-finite number"),
    ("[NaN]", "a non-finite number (NaN)"), ("-Infinity", "a non-finite number (-Infinity)"),
    ('"' + "x" * 100, "not JSON (JSONDecodeError)"),
    (b'{"a": "\xff"}', "not JSON (not UTF-8)"),
    ("[" + "0," * 40 + "0]", "over the 64-byte cap"),
])
def test_each_rule_is_named_never_the_content(text: str | bytes, rule: str) -> None:
    with pytest.raises(UnsafeJSON) as refused:
        bounded_loads(text, limit=64 if rule.startswith("over") else 2**20)
    assert str(refused.value) == refused.value.rule == rule
    assert refused.value.malformed == rule.startswith("not JSON")


def test_a_stdout_line_over_the_limits_is_kept_as_unparsable() -> None:
    for line, rule in ((DEEP, "nested deeper"), ('{"type":"item.completed","item":{"id":"x",'
                                                 '"n":NaN}}', "a non-finite number")):
        record = parse_stream_line(line)
        assert (record.type, record.data) == ("codex.unknown", {"line": line})
        assert record.gap is not None and record.gap["code"] == "codex_unparsable_line"
        assert record.gap["detail"].startswith(rule)


def test_rollout_lines_over_the_limits_are_counted_by_rule_and_skipped() -> None:
    from collections import Counter

    refused: Counter[str] = Counter()
    events = usage_events([token_count(10, 2), DEEP, DEEP, f'{{"n": {HUGE}}}', '{"type":',
                           token_count(20, 4)], at="2026-11-30T00:00:00Z", refused=refused)
    assert [e["data"]["total"]["total_tokens"] for e in events] == [12, 24]
    assert refused == {"nested deeper than 64 levels": 2, "an integer beyond 64 bits": 1}


# --- through real Codex tool calls ------------------------------------------------------------

def gaps(ran: Any) -> list[tuple[str, str]]:
    return [(e.data.code, e.data.detail or "") for e in ran.view.events
            if e.type == "gap.recorded"]


@pytest.mark.anyio
@pytest.mark.parametrize(("poison", "rule"), [
    ("printf '{\"reward\": %s}' $(head -c 400 /dev/zero | tr '\\0' 1)",
     "an integer beyond 64 bits"),
    ("head -c 60000 /dev/zero | tr '\\0' '['", "nested deeper than 64 levels"),
    ("echo '{\"reward\": NaN}'", "a non-finite number (NaN)"),
    # 1,100,000 `[` are past the 1 MiB reward cap (task_file_max_bytes): refused unparsed
    ("head -c 1100000 /dev/zero | tr '\\0' '['", "1100000 bytes, over the 1048576-byte cap"),
])
async def test_a_poisoned_reward_json_is_a_bad_reward(tmp_path: Path, poison: str,
                                                      rule: str) -> None:
    # The agent writes the verdict file the task's verifier hands on as its reward.
    task = make_task(tmp_path / "task",
                     test_sh='cp verdict.json "$TRIALLEDGER_VERIFIER_DIR/reward.json"\n')
    ran = await run_task(str(tmp_path / "t.db"), task,
                         [shell(f"{poison} > verdict.json; wc -c verdict.json"), message()])
    failed = next(e for e in ran.view.events if e.type == "verification.failed").data
    assert failed.reason == "bad_reward"
    if rule.startswith("1100000 bytes"):  # a reading rule: also gap unsafe_agent_file
        assert failed.detail == f"reward.json: {rule}"
        assert ("unsafe_agent_file", f"reward.json: {rule}") in gaps(ran)
    else:
        assert failed.detail == f"reward.json is not an object of finite numbers ({rule})"
    assert ran.view.state == "closed" and ran.view.rewards is None
    assert ran.view.decision is not None and ran.view.decision.action == "verify"


@pytest.mark.anyio
async def test_a_poisoned_rollout_line_is_a_gap_and_the_session_is_decided(
        tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    # Planted beside Codex's own rollout, as the agent can: 100,000 `[` on one line, twice,
    # and a 400-digit token count (JSON, but past every float).
    attack = ("f=$(find $CODEX_HOME/sessions -name 'rollout-*.jsonl' | head -1); "
              "f=$(dirname $f)/rollout-planted.jsonl; "
              "for i in 1 2; do head -c 100000 /dev/zero | tr '\\0' '['; echo; done > $f; "
              f"echo '{{\"type\":\"event_msg\",\"payload\":{{\"type\":\"token_count\","
              f"\"info\":{{\"total_token_usage\":{{\"input_tokens\":{HUGE}}}}}}}}}' >> $f; "
              "wc -l $f")
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(attack), message()])
    found = [detail for code, detail in gaps(ran) if code == "unsafe_agent_file"]
    assert any("rollout-planted.jsonl" in d and "2 line(s) nested deeper than 64 levels" in d
               for d in found), found
    assert any("rollout-planted.jsonl" in d and "1 line(s) an integer beyond 64 bits" in d
               for d in found), found
    assert not any("[[[" in d for _, d in gaps(ran))  # the rule, never the content
    assert ran.view.state == "closed" and ran.view.outcome == "verify"
    assert ran.view.rewards == {"reward": 1.0}
    assert ran.view.usage is not None and ran.view.usage.total_tokens is not None


# --- import-harbor ----------------------------------------------------------------------------

def _harbor_job(tmp_path: Path) -> tuple[Path, str]:
    job = tmp_path / "jobs" / "j"
    job.mkdir(parents=True)
    (job / "result.json").write_text(json.dumps({"stats": {"n_retries": 0}}))
    hello = trial(job, "hello__Qq11Ww2", exception=None, rewards={"reward": 1.0},
                  codex=[*CLEAN, DEEP], rollout=[token_count(12, 10), DEEP])
    trial(job, "other__Aa1", exception=None, rewards={"reward": 1.0}, codex=[THREAD, TURN])
    return job, hello


async def _view(db: str, session_id: str) -> Any:
    async with await Ledger.open(db) as ledger:
        return await ledger.view(session_id)


def test_import_harbor_reads_deep_lines_as_gaps(capsys: Any, tmp_path: Path) -> None:
    job, hello = _harbor_job(tmp_path)
    db = str(tmp_path / "t.db")
    code = main(["import-harbor", "--db", db, str(job), "--json"])
    captured = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in captured.err, captured.err
    view = anyio.run(_view, db, hello)
    found = [g.detail or "" for g in view.observations.gaps if g.code == "unsafe_agent_file"]
    assert any("rollout-" in d and "nested deeper than 64 levels" in d for d in found), found
    assert view.usage.total_tokens == 22  # the rollout's honest line still counts


@pytest.mark.parametrize("poison", [DEEP, '{"id": ' + HUGE + "}", '{"a": NaN}'])
def test_import_harbor_refuses_a_poisoned_result_in_one_line(
        capsys: Any, tmp_path: Path, poison: str) -> None:
    job, _ = _harbor_job(tmp_path)
    (job / "other__Aa1" / "result.json").write_text(poison)
    db = str(tmp_path / "t.db")
    code = main(["import-harbor", "--db", db, str(job)])
    err = capsys.readouterr().err
    assert code == 2 and "other__Aa1" in err and err.count("\n") == 1, err
    assert "[[[" not in err and HUGE not in err


def test_import_harbor_survives_a_poisoned_job_result(capsys: Any, tmp_path: Path) -> None:
    job, _ = _harbor_job(tmp_path)
    (job / "result.json").write_text(DEEP)  # the job's own: n_retries unreadable, so 0
    code = main(["import-harbor", "--db", str(tmp_path / "t.db"), str(job)])
    assert code in (0, 1), capsys.readouterr().err



surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts_with_surrogates = st.lists(st.text(max_size=3) | surrogates, max_size=4).map("".join)


def _as_read(value: Any, escaped: bool) -> Any:
    """What a reader should make of `value` written as JSON: escaped (`\\ud83d\\ude00`),
    a high and a low surrogate side by side are one character; every other surrogate, and
    every surrogate written as it is, is U+FFFD."""
    if isinstance(value, str):
        if escaped:
            return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in value)
    if isinstance(value, list):
        return [_as_read(v, escaped) for v in value]
    return {_as_read(k, escaped): _as_read(v, escaped) for k, v in value.items()}


@fast
@given(value=st.recursive(texts_with_surrogates, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(texts_with_surrogates, inner, max_size=3),
                          max_leaves=8),
       escaped=st.booleans())
def test_a_lone_surrogate_is_read_as_the_replacement_character(value: Any,
                                                               escaped: bool) -> None:
    """JSON lets `\\ud800` through (and a name read with surrogateescape holds one), but no
    UTF-8 text, and so no event, can hold it: the reader makes each U+FFFD, keys too."""
    read = bounded_loads(json.dumps(value, ensure_ascii=escaped), limit=2**20)
    assert read == _as_read(value, escaped)
    json.dumps(read, ensure_ascii=False).encode("utf-8")  # no lone surrogate is left
