"""The job summary as Harbor computes it (docs/SPEC.md §13): the pure figures in
`core.summary` against brute force, and the views `job_tasks`, `job_passk`,
`job_reward_means`, `job_retries` and `job_trials` on SQLite and PostgreSQL over imported
sessions, each held to `core.summary`; `Jobs.summary` as their rows, read as one snapshot;
then `job show` and `job diff`."""

from __future__ import annotations

import itertools
import json
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event, text

from tests.scenarios import CLEAN, HTTP_429, THREAD, TURN, LogBuilder, run
from trialledger.core import summary
from trialledger.store import Ledger
from trialledger.store.jobs import TASK_COLUMNS, TRIAL_COLUMNS, Jobs, trial_id

CONFIG = {"model": "m", "settings": {}, "grants": [], "max_attempts": 3}
Verdict = dict[str, float] | None  # a scored trial's rewards, or None: unscored


# -- the pure figures ---------------------------------------------------------------------

@given(st.integers(1, 9).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_chance_that_k_of_n_trials_hold_a_pass(nck: tuple[int, int, int]
                                                                 ) -> None:
    n, c, k = nck
    trials = [1] * c + [0] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    brute = sum(any(trials[i] for i in draw) for draw in draws) / len(draws)
    assert summary.pass_at_k_for_task(n, c, k) == pytest.approx(brute)


@given(st.dictionaries(st.sampled_from("abcd"),
                       st.lists(st.sampled_from([None, 0.0, 1.0]), min_size=1, max_size=9),
                       min_size=1))
def test_pass_at_k_over_tasks_is_the_mean_of_each_tasks_brute_force(
        tasks: dict[str, list[float | None]]) -> None:
    verdicts = {t: [None if r is None else {"reward": r} for r in rs] for t, rs in tasks.items()}
    fewest = min(len(rs) for rs in tasks.values())
    got = summary.pass_at_k(verdicts)
    assert sorted(got) == summary.k_values(fewest)
    for k, value in got.items():
        per_task = []
        for rs in tasks.values():
            draws = list(itertools.combinations(rs, k))
            per_task.append(sum(any(r == 1.0 for r in d) for d in draws) / len(draws))
        assert value == pytest.approx(sum(per_task) / len(per_task))


@pytest.mark.parametrize(("max_k", "ks"), [
    (1, []), (2, [2]), (4, [2, 4]), (5, [2, 4, 5]), (8, [2, 4, 5, 8]),
    (16, [2, 4, 5, 8, 10, 15, 16]), (20, [2, 4, 5, 8, 10, 15, 16, 20]),
])
def test_the_k_set_is_harbors(max_k: int, ks: list[int]) -> None:
    assert summary.k_values(max_k) == ks


@given(st.lists(st.one_of(st.none(), st.floats(0, 1).map(lambda v: {"reward": v}),
                          st.just({})), min_size=1))
def test_mean_counts_unscored_as_zero_and_mean_scored_leaves_them_out(
        trials: list[dict[str, float] | None]) -> None:
    values = [0.0 if t is None else t.get("reward", 0.0) for t in trials]
    assert summary.means(trials)["mean"] == pytest.approx(sum(values) / len(values))
    scored = [t.get("reward", 0.0) for t in trials if t is not None]
    expected = sum(scored) / len(scored) if scored else None
    assert summary.mean_scored(trials) == (pytest.approx(expected) if scored else None)


@pytest.mark.parametrize(("trials", "mean", "passk"), [
    ([{"reward": 1.0}, None], {"mean": 0.5}, {2: 1.0}),  # unscored counts 0, fails
    ([{}, {"reward": 1.0}], {"mean": 0.5}, {}),  # {}: reward 0, and no pass@k
    ([{"a": 1.0, "b": 0.5}, {"a": 0.0}], {"a": 0.5, "b": 0.25}, {}),  # several names
    ([{"reward": 0.5}, {"reward": 1.0}], {"mean": 0.75}, {}),  # not binary
    ([], {}, {}),
])
def test_each_rule_of_the_means_and_pass_at_k(trials: list[Verdict], mean: dict[str, float],
                                              passk: dict[int, float]) -> None:
    assert summary.means(trials) == pytest.approx(mean)
    assert summary.pass_at_k({"t": trials}) == pytest.approx(passk)


# -- the views ------------------------------------------------------------------------------

async def _import(ledger: Ledger, job: str, task: str, index: int, verdict: Verdict, *,
                  attempt: int = 1, retry_of: str | None = None) -> str:
    """One session of a trial: scored with `verdict`'s rewards, or closed unverified."""
    log = run(CLEAN, 0)
    log.events[0]["data"].update(trial_id=trial_id(job, task, index), task=task,
                                 attempt=attempt, retry_of=retry_of)
    if verdict is not None:
        log.add("verification.recorded", {"rewards": verdict, "detail": None})
    log.add("session.closed", {"reason": "normal"})
    return await ledger.import_log(log.events)


async def _retry_then(ledger: Ledger, job: str, task: str, index: int, verdict: Verdict) -> None:
    """A 429 decided `retry`, a cancelled attempt (uncounted), then the final session."""
    log = run(HTTP_429, 1)
    log.events[0]["data"].update(trial_id=trial_id(job, task, index), task=task)
    log.add("session.closed", {"reason": "normal"})
    first = await ledger.import_log(log.events)
    cancelled = LogBuilder().launched().codex([THREAD, TURN])
    cancelled.events[0]["data"].update(trial_id=trial_id(job, task, index), task=task,
                                       attempt=2, retry_of=first)
    cancelled.add("session.closed", {"reason": "cancelled"})
    second = await ledger.import_log(cancelled.events)
    await _import(ledger, job, task, index, verdict, attempt=3, retry_of=second)


async def _job(ledger: Ledger, name: str, k: int,
               tasks: dict[str, tuple[str, list[Verdict | str]]]) -> Jobs:
    """A job whose trials are imported: task → (dataset, each trial's verdict; "open"
    leaves the trial queued with no session)."""
    jobs = Jobs(ledger)
    await jobs.define(name, {**CONFIG, "k": k}, [(t, f"/tasks/{t}") for t in tasks],
                      datasets={t: ds for t, (ds, _) in tasks.items()})
    for task, (_, verdicts) in tasks.items():
        for index, verdict in enumerate(verdicts):
            if verdict == "open":
                continue
            assert not isinstance(verdict, str)
            await _import(ledger, name, task, index, verdict)
    async with ledger._engines.writer.begin() as conn:
        for task, (_, verdicts) in tasks.items():
            for index, verdict in enumerate(verdicts):
                if verdict != "open":
                    await conn.execute(text("UPDATE job_queue SET state = 'done' "
                                            "WHERE trial_id = :t"),
                                       {"t": trial_id(name, task, index)})
    return jobs


def _by_figure(rows: list[dict[str, Any]]) -> dict[tuple[str | None, str | None], Any]:
    return {(r["dataset"], r["task"]): r for r in rows}


async def _each_view(jobs: Jobs, name: str) -> dict[str, Any]:
    """What `Jobs.summary` holds, each part read alone from its view (`SELECT *`)."""
    return {"tasks": await jobs.tasks(name), "passk": await jobs.passk(name),
            "reward_means": await jobs.reward_means(name), "retries": await jobs.retries(name),
            "trials": await jobs.trials(name), "open_trials": await jobs.open_trials(name),
            "environment_failed": await jobs.failures(name),
            "no_solution": await jobs.failures(name, "no_solution"),
            "skipped": await jobs.skipped(name)}


R1, R0 = {"reward": 1.0}, {"reward": 0.0}
MIXED: dict[str, tuple[str, list[Verdict | str]]] = {
    "a": ("set-1", [R1, R0, None, R1]),  # one unscored: counts 0, fails
    "b": ("set-1", [R0, R0, R0, R0]),
    "c": ("set-2", [R1, {}, R1, "open"]),  # {} is a 0; one trial still open
}


@pytest.mark.anyio
async def test_the_figures_are_harbors_on_both_databases(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        jobs = await _job(ledger, "mixed", 4, MIXED)
        tasks = _by_figure(await jobs.tasks("mixed"))
        passk = await jobs.passk("mixed")
        trials = await jobs.trials("mixed")
        got = await jobs.summary("mixed")
        alone = await _each_view(jobs, "mixed")
    assert {name: got[name] for name in alone} == alone  # the summary is the views' rows
    assert set(TASK_COLUMNS) == set(next(iter(tasks.values())))
    assert {*TRIAL_COLUMNS, "rewards", "steps"} == set(trials[0])  # steps: None, one-step
    finished = {t: [v for v in vs if v != "open"] for t, (_, vs) in MIXED.items()}
    figures = {("set-1", "a"): ["a"], ("set-1", "b"): ["b"], ("set-2", "c"): ["c"],
               ("set-1", None): ["a", "b"], ("set-2", None): ["c"],
               (None, None): ["a", "b", "c"]}
    assert set(tasks) == set(figures)
    for key, covered in figures.items():
        verdicts: list[Verdict] = [v for t in covered for v in finished[t]]  # type: ignore[misc]
        row = tasks[key]
        assert row["trials"] == sum(len(MIXED[t][1]) for t in covered)
        assert row["open"] == (1 if "c" in covered else 0)
        assert row["scored"] == sum(v is not None for v in verdicts)
        assert row["unscored"] == sum(v is None for v in verdicts)
        assert row["passed"] == sum(v is not None and v.get("reward", 0) >= 1 for v in verdicts)
        assert row["mean"] == pytest.approx(summary.means(verdicts)["mean"])
        assert row["mean_scored"] == pytest.approx(summary.mean_scored(verdicts))
        assert row["mean_reward"] == row["mean_scored"]  # deprecated, kept
        expected = summary.pass_at_k({t: finished[t] for t in covered})  # type: ignore[misc]
        if "c" in covered:  # c's {} is no binary reward: no pass@k where c is covered
            assert expected == {}
        mine = {p["k"]: p["pass_at_k"] for p in passk
                if (p["dataset"], p["task"]) == key}
        assert mine == pytest.approx(expected), key
        assert row["pass_at_k"] == (pytest.approx(expected[4]) if 4 in expected else None)
        assert row["retries"] == 0 and row["interrupted"] == 0
    assert tasks[("set-1", "a")]["pass_at_k"] == pytest.approx(1 - math.comb(2, 4) / 1)
    assert got["partial"] is True
    assert [(t["task"], t["state"]) for t in got["open_trials"]] == [("c", "queued")]
    rewards = {(t["task"], t["k_index"]): t["reward"] for t in trials}
    assert rewards[("c", 1)] == 0.0 and rewards[("a", 2)] is None
    assert {(t["task"], t["k_index"]): t["passed"] for t in trials}[("a", 0)] == 1


def _held_to_core(rows: list[dict[str, Any]], passk: list[dict[str, Any]], k: int,
                  figures: dict[tuple[str | None, str | None], dict[str, list[Verdict]]]
                  ) -> None:
    """`job_tasks` and `job_passk` rows of every figure with several reward names equal
    `core.summary.by_name` over the trials it covers (figure → its tasks' finished trials)."""
    for key, covered in figures.items():
        everything = [v for trials in covered.values() for v in trials]
        if not summary.several(everything):
            continue
        mine = [r for r in rows if (r["dataset"], r["task"]) == key]
        expected = summary.by_name(covered)
        assert [r["name"] for r in mine] == list(expected), key  # `reward` first
        for r in mine:
            want = expected[r["name"]]
            assert (r["mean"], r["mean_scored"], r["mean_reward"]) == pytest.approx(
                (want["mean"], want["mean_scored"], want["mean_scored"])), (key, r["name"])
            assert r["passed"] == want["passed"], (key, r["name"])
            got = {p["k"]: p["pass_at_k"] for p in passk
                   if (p["dataset"], p["task"], p["name"]) == (*key, r["name"])}
            assert got == pytest.approx(want["pass_at_k"]), (key, r["name"])
            assert r["pass_at_k"] == (pytest.approx(want["pass_at_k"][k])
                                      if k in want["pass_at_k"] else None)
            assert r["scored"] == sum(v is not None for v in everything)


NAMED: dict[str, tuple[str, list[Verdict | str]]] = {
    "t": ("set-1", [{"reward": 1.0, "coverage": 0.5}, {"reward": 0.0}, None, {}]),
    "u": ("set-1", [R1, R0, R1, "open"]),  # one name alone; several with t
    "v": ("set-2", [{"coverage": 1.0}, {"reward": 1.0, "coverage": 0.0}, R0, R1]),
}


@pytest.mark.anyio
async def test_several_reward_names_give_every_figure_per_name(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        jobs = await _job(ledger, "names", 4, NAMED)
        rows = await jobs.tasks("names")
        passk = await jobs.passk("names")
        trials = await jobs.trials("names")
        got = await jobs.summary("names")
        alone = await _each_view(jobs, "names")
    assert {name: got[name] for name in alone} == alone and got["reward_means"]
    finished = {t: [v for v in vs if v != "open"] for t, (_, vs) in NAMED.items()}
    figures = {("set-1", "t"): ["t"], ("set-1", "u"): ["u"], ("set-2", "v"): ["v"],
               ("set-1", None): ["t", "u"], ("set-2", None): ["v"],
               (None, None): ["t", "u", "v"]}
    _held_to_core(rows, passk, 4, {key: {t: finished[t] for t in covered}  # type: ignore[misc]
                                   for key, covered in figures.items()})
    by_figure: dict[tuple[str | None, str | None], list[str | None]] = {}
    for r in rows:
        by_figure.setdefault((r["dataset"], r["task"]), []).append(r["name"])
    assert by_figure[("set-1", "u")] == ["reward"]  # one name: one row, as before
    assert by_figure[(None, None)] == ["reward", "coverage"]
    total = rows[-2:]  # the job's total, a row per name, `reward` first
    at = {name: [p["k"] for p in passk if (p["dataset"], p["task"], p["name"]) ==
                 (None, None, name)] for name in ("reward", "coverage")}
    assert total[0]["passed"] == 5 and at["reward"] == [2]  # all 0 or 1; u has 3 finished
    assert total[1]["passed"] is None and at["coverage"] == []  # 0.5: not binary
    assert total[0]["trials"] == total[1]["trials"] == 12  # the figure's counts, repeated
    t_trials = {t["k_index"]: t for t in trials if t["task"] == "t"}
    assert t_trials[0]["rewards"] == {"reward": 1.0, "coverage": 0.5}
    assert list(t_trials[0]["rewards"]) == ["reward", "coverage"]
    assert t_trials[0]["reward"] is None and t_trials[0]["passed"] is None  # several
    assert t_trials[2]["rewards"] is None and t_trials[3]["rewards"] == {}


trial_verdicts = st.lists(st.one_of(
    st.none(), st.dictionaries(st.sampled_from(["reward", "coverage", "speed"]),
                               st.sampled_from([0.0, 1.0, 0.25]), max_size=3)),
    min_size=1, max_size=5)


@given(st.dictionaries(st.sampled_from("abc"), trial_verdicts, min_size=1))
def test_each_names_figures_are_the_trials_values_of_that_name(
        tasks: dict[str, list[Verdict]]) -> None:
    everything = [v for trials in tasks.values() for v in trials]
    scored = [v for v in everything if v is not None]
    got = summary.by_name(tasks)
    assert list(got) == summary.ordered(summary.names(everything))
    assert list(got)[:1] == (["reward"] if "reward" in got else list(got)[:1])
    for name, figure in got.items():
        values = [v.get(name, 0.0) for v in scored]  # without the name: 0
        assert figure["mean"] == pytest.approx(sum(values) / len(everything))
        assert figure["mean_scored"] == pytest.approx(sum(values) / len(scored))
        binary = set(values) <= {0.0, 1.0}
        assert figure["passed"] == (values.count(1.0) if binary else None)
        alone = {t: [None if v is None else {"reward": v.get(name, 0.0)} for v in trials]
                 for t, trials in tasks.items()}
        assert figure["pass_at_k"] == (pytest.approx(summary.pass_at_k(alone)) if binary
                                       else {})
    # One name alone is the one-name summary.
    if len(got) == 1 and all(v is None or len(v) == 1 for v in everything):
        (figure,) = got.values()
        assert figure["mean"] == pytest.approx(summary.means(everything)["mean"])


def test_the_views_per_name_figures_are_core_summarys(tmp_path: Path) -> None:
    """Each drawn job in one store, read through one open `Ledger` (a job of its own name
    per draw: the views are read per job), so each view is planned once, not per draw."""
    dataset = {"a": "d", "b": "d", "c": "e"}  # two datasets when c is drawn
    with anyio.from_thread.start_blocking_portal() as portal:
        ledger = portal.call(Ledger.open, str(tmp_path / "t.db"))
        try:
            @settings(max_examples=15, deadline=None)
            @given(st.dictionaries(st.sampled_from("abc"), trial_verdicts, min_size=1))
            def held(tasks: dict[str, list[Verdict]]) -> None:
                name = uuid.uuid4().hex
                k = max(len(v) for v in tasks.values())

                async def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                          dict[str, Any]]:
                    verdicts: dict[str, list[Verdict | str]] = {
                        t: [*vs, *["open"] * (k - len(vs))] for t, vs in tasks.items()}
                    jobs = await _job(ledger, name, k, {t: (dataset[t], vs)
                                                        for t, vs in verdicts.items()})
                    return await jobs.tasks(name), await jobs.passk(name), await jobs.summary(name)

                rows, passk, whole = portal.call(read)
                figures: dict[tuple[str | None, str | None], dict[str, list[Verdict]]] = {
                    (dataset[t], t): {t: vs} for t, vs in tasks.items()}
                if len({dataset[t] for t in tasks}) > 1:
                    for figure in ("d", "e"):
                        figures[(figure, None)] = {t: vs for t, vs in tasks.items()
                                                   if dataset[t] == figure}
                figures[(None, None)] = dict(tasks)
                _held_to_core(rows, passk, k, figures)
                # `job show`'s pass@k, computed from the trials (core.summary.passk_rows), is
                # the view's
                assert [{**p, "pass_at_k": pytest.approx(p["pass_at_k"])} for p in passk
                        ] == whole["passk"]

            held()
        finally:
            portal.call(ledger.aclose)


async def _settle(db: str, job: str, task: str, index: int) -> None:
    """What a worker does at a trial's end, through a store of its own: its session, then
    the queue's `done`."""
    async with await Ledger.open(db) as ledger:
        await _import(ledger, job, task, index, R1)
        async with ledger._engines.writer.begin() as conn:
            await conn.execute(text("UPDATE job_queue SET state = 'done' WHERE trial_id = :t"),
                               {"t": trial_id(job, task, index)})


@pytest.mark.anyio
async def test_the_summary_is_one_snapshot_while_a_worker_settles_a_trial(db: str) -> None:
    """`job show` on a running job: a trial settled between the summary's first reads and
    its read of the trials is in none of it (the figures, `partial`, the open trials and
    the trials' rows agree); the next summary has it in all."""
    async with await Ledger.open(db) as ledger:
        jobs = await _job(ledger, "live", 2, {"t": ("adhoc", [R1, "open"])})
        settling = trial_id("live", "t", 1)
        settled: list[str] = []

        def settle_before_the_trials(_conn: Any, _cursor: Any, statement: str,
                                     *_: Any) -> None:
            if "FROM job_trials" in statement and not settled:
                settled.append(statement)  # (another thread: this one is inside a read)
                with ThreadPoolExecutor(1) as pool:
                    pool.submit(anyio.run, _settle, db, "live", "t", 1).result(timeout=60)

        engines = ledger._engines
        readers = [e for e in (engines.reader.sync_engine, engines.sync_reader) if e]
        for engine in readers:
            event.listen(engine, "before_cursor_execute", settle_before_the_trials)
        try:
            during = await jobs.summary("live")
        finally:
            for engine in readers:
                event.remove(engine, "before_cursor_execute", settle_before_the_trials)
        after = await jobs.summary("live")
    assert settled
    overall = _by_figure(during["tasks"])[(None, None)]
    assert during["partial"] and (overall["open"], overall["scored"]) == (1, 1)
    assert [t["trial_id"] for t in during["open_trials"]] == [settling]
    assert {t["trial_id"]: t["state"] for t in during["trials"]}[settling] == "queued"
    overall = _by_figure(after["tasks"])[(None, None)]
    assert not after["partial"] and (overall["open"], overall["scored"]) == (0, 2)
    assert after["open_trials"] == []
    assert {t["trial_id"]: t["state"] for t in after["trials"]}[settling] == "done"


@pytest.mark.anyio
async def test_retries_are_counted_by_cause_and_cancels_apart(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        await jobs.define("r", {**CONFIG, "k": 1}, [("t", "/tasks/t")])
        await _retry_then(ledger, "r", "t", 0, R1)
        async with ledger._engines.writer.begin() as conn:
            await conn.execute(text("UPDATE job_queue SET state = 'done'"))
        row = _by_figure(await jobs.tasks("r"))[("adhoc", "t")]
        retries = await jobs.retries("r")
        trial = (await jobs.trials("r"))[0]
        got = await jobs.summary("r")
        alone = await _each_view(jobs, "r")
    assert {name: got[name] for name in alone} == alone
    assert (row["retries"], row["interrupted"], row["scored"], row["mean"]) == (1, 1, 1, 1.0)
    assert retries == [{"job": "r", "task": "t", "cause_kind": "model_endpoint", "sessions": 1}]
    assert (trial["attempts"], trial["interrupted"]) == (3, 1)
    # The cancelled session has no decision and no proxy record: its usage is unknown.
    assert row["unknown_usage"] == 1 and row["total_tokens"] is not None


# -- the command line -----------------------------------------------------------------------

def _store(path: Path) -> str:
    import anyio

    db = str(path / "trials.db")

    async def build() -> None:
        async with await Ledger.open(db) as ledger:
            await _job(ledger, "base", 2, {"x": ("d", [R1, R0]), "y": ("d", [R0, R0]),
                                           "gone": ("d", [R1, R1])})
            await _job(ledger, "new", 2, {"x": ("d", [R1, R1]), "y": ("d", [R1, None]),
                                          "added": ("d", [R0, "open"])})
    anyio.run(build)
    return db


def test_job_diff_puts_two_jobs_side_by_side(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from trialledger import cli

    db = _store(tmp_path)
    assert cli.main(["job", "diff", "base", "new", "--db", db, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    figures = {f["figure"]: f for f in result["figures"]}
    assert set(figures) == {"x", "y", "gone", "added", "(all)"}
    assert figures["gone"]["only"] == "a" and figures["added"]["only"] == "b"
    assert figures["x"]["mean"] == {"a": 0.5, "b": 1.0, "diff": 0.5}
    assert figures["y"]["passed"] == {"a": 0, "b": 1, "diff": 1}
    assert figures["x"]["pass_at_k"] == {"k": 2, "a": 1.0, "b": 1.0, "diff": 0.0}
    assert figures["x"]["total_tokens"]["diff"] == 0
    assert result["partial"] is True
    assert cli.main(["job", "diff", "base", "new", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "A only" in out and "B only" in out and "+0.500" in out and "partial" in out


def test_job_show_says_partial_and_who_holds_what_and_never_tokens_0_when_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trialledger import cli

    db = _store(tmp_path)
    assert cli.main(["job", "show", "new", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "partial: 1 trial(s) still open" in out and "added #1" in out and "queued" in out
    assert "(all)" in out
    assert cli.main(["job", "show", "new", "--db", db, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["partial"] is True and shown["open_trials"][0]["task"] == "added"


def test_tokens_are_never_shown_as_0_when_unknown() -> None:
    from trialledger.adapters.console.jobs import tokens

    assert tokens({"total_tokens": None, "unknown_usage": 2}) == "unknown (2)"
    assert tokens({"total_tokens": 40, "unknown_usage": 1}) == "40 + 1 unknown"
    assert tokens({"total_tokens": 40, "unknown_usage": 0}) == "40"


@pytest.mark.anyio
async def test_job_tasks_over_its_figures_view_is_the_view_it_replaced(db: str) -> None:
    """Migration 0019 made `job_tasks` its figures (`job_task_figures`) plus pass@k and
    cost: every row, column and value is what revision 0018's view gives on the same data
    (its text run as a query), with several reward names, datasets and open trials."""
    import importlib

    before = importlib.import_module("trialledger.migrations.versions.0017_trial_reward_names")
    fill = importlib.import_module("trialledger.migrations.versions.0019_task_figures")
    async with await Ledger.open(db) as ledger:
        await _job(ledger, "mixed", 4, MIXED)
        await _job(ledger, "names", 4, NAMED)
        async with ledger._engines.reader.connect() as conn:
            dialect = conn.dialect.name
            old = before.JOB_TASKS.format(wall=fill.WORK.WALL[dialect],
                                          float=fill.SUMMARY.FLOAT[dialect])
            old = old.split("CREATE VIEW job_tasks AS\n", 1)[1]
            order = "WHERE job IN ('mixed', 'names') ORDER BY job, dataset, task, name"
            result = await conn.execute(text(f"SELECT * FROM job_tasks {order}"))
            keys, now = list(result.keys()), result.all()
            then = (await conn.execute(text(f"SELECT * FROM ({old}) t {order}"))).all()
    assert keys == list(TASK_COLUMNS)
    assert len(now) > 12 and any(row[3] == "coverage" for row in now)  # names: a row each
    assert [tuple(row) for row in now] == [tuple(row) for row in then]
