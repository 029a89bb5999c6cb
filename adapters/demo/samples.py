"""`trialledger demo`: the real Codex CLI through six sample tasks, offline.

A scripted Responses endpoint plays the model and a real MCP server serves one tool, both
on loopback. The samples: a clean run, a shell tool call, an HTTP 429 (retried as attempt
2), Codex killed while its sandbox lives (probed, then graded), a timeout (graded as
incomplete) and an MCP tool call.
"""

from __future__ import annotations

import contextlib
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.install import install_paths
from trialledger.adapters.demo.endpoint import Reply, ScriptedEndpoint, message, shell, status, tool
from trialledger.adapters.session.runner import RunOptions, SessionResult, SessionRunner
from trialledger.adapters.tasks.task import Task
from trialledger.core.events import SessionSeeded
from trialledger.store import Ledger

QUESTIONS = {
    "Which causes made sessions retry, and how often?": """
        SELECT COALESCE(cause_kind, 'none') AS cause, COUNT(*) AS sessions,
               SUM(CASE WHEN action = 'retry' THEN 1 ELSE 0 END) AS retries
        FROM outcomes GROUP BY COALESCE(cause_kind, 'none') ORDER BY cause""",
    "How many tokens did each task use (NULL = unknown, never 0)?": """
        SELECT s.task, SUM(o.total_tokens) AS tokens, COUNT(o.total_tokens) AS sessions_known
        FROM sessions s JOIN outcomes o ON o.session_id = s.session_id
        GROUP BY s.task ORDER BY s.task""",
    "How many attempts did each trial take, and what did the last one score?": """
        SELECT s.trial_id, COUNT(*) AS attempts, MAX(r.value) AS reward
        FROM sessions s LEFT JOIN rewards r ON r.session_id = s.session_id
        GROUP BY s.trial_id ORDER BY s.trial_id""",
}


def executable(path: Path, text: str) -> Path:
    """Write an executable script."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def killer(folder: Path, codex: str, trigger: str) -> Path:
    """A `--codex-bin` wrapper: runs Codex, and SIGKILLs it (then itself) once a stdout line
    contains `trigger`, so a run ends killed by signal 9 at a known point."""
    return executable(folder / "codex-killer", f"""#!/usr/bin/python3
import os, signal, subprocess, sys
codex = subprocess.Popen([{codex!r}, *sys.argv[1:]], stdout=subprocess.PIPE)
for line in codex.stdout:
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
    if {trigger.encode()!r} in line:
        codex.kill()
        codex.wait()
        os.kill(os.getpid(), signal.SIGKILL)
sys.exit(codex.wait())
""")


EXIT_CODE_REWARD = "\n[metadata.trialledger]\nreward_from_exit_code = true\n"


def write_task(folder: Path, *, instruction: str, test_sh: str | None,
               toml: str | None = None, workspace: Mapping[str, str] | None = None,
               exit_code_reward: bool = True) -> Task:
    """Write a task folder (instruction.md, task.toml, workspace/, tests/test.sh) and load
    it: the demo's and the tests' one task writer. Its verifier's exit code is its reward
    (`exit_code_reward`, opted in through `[metadata.trialledger]`) unless it writes a
    reward file, or the caller says it must, as a Harbor task does."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "instruction.md").write_text(instruction, encoding="utf-8")
    if exit_code_reward:
        toml = (toml or "") + EXIT_CODE_REWARD
    if toml is not None:
        (folder / "task.toml").write_text(toml, encoding="utf-8")
    for name, text in (workspace or {}).items():
        path = folder / "workspace" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if test_sh is not None:
        # No shebang: the verifier runs it with bash where there is one, else sh.
        executable(folder / "tests" / "test.sh", test_sh)
    return Task.load(folder)


@dataclass(frozen=True)
class Sample:
    """One demo task: what the model says, and how the run is set up."""

    name: str
    instruction: str
    test_sh: str
    script: Callable[[str], list[Reply]]  # given the MCP server's URL
    settings: dict[str, Any] = field(default_factory=dict)
    kill_on: str | None = None  # SIGKILL Codex when a stdout line contains this
    grants: bool = False
    toml: str | None = None


SAMPLES = (
    Sample("clean", "Say hi.", "exit 0\n", lambda _: [message("hi there")]),
    Sample("shell-tool", "Write hello into out.txt.", "grep -q hello out.txt\n",
           lambda _: [shell("echo hello > out.txt; cat out.txt"), message("done")]),
    Sample("rate-limited", "Say hi (the endpoint answers 429 once).", "exit 0\n",
           lambda _: [status(429), message("hi after a retry")],
           settings={"request_max_retries": 0, "stream_max_retries": 0}),
    Sample("killed-live", "Run the long build.", "test -f partial.txt\n",
           lambda _: [shell("echo step1 > partial.txt; sleep 30")],
           settings={"verify_after_agent_error": True}, kill_on='"type":"item.started"'),
    Sample("timeout", "Wait for the slow service.", "exit 1\n",
           lambda _: [shell("sleep 60")], toml="[agent]\ntimeout_sec = 3\n"),
    Sample("mcp-tool", "Look up the word overlay.", "exit 0\n",
           lambda _: [tool("lookup", {"query": "overlay"}, namespace="mcp__gym"),
                      message("An overlay is a layered filesystem.")],
           grants=True),
)


@contextlib.contextmanager
def _tool_server() -> Iterator[Any]:
    from trialledger.adapters.demo.tools import ToolServer  # the `mcp` package: pip install .[demo]

    with ToolServer() as server:
        yield server


async def run_demo(ledger: Ledger, *, codex: str, workdir: Path | None = None,
                   progress: Callable[[str], None] = lambda _: None) -> list[SessionResult]:
    """Run every sample; return every session."""
    results: list[SessionResult] = []
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        tools = stack.enter_context(_tool_server())
        for sample in SAMPLES:
            progress(sample.name)
            task = write_task(root / sample.name, instruction=sample.instruction,
                              test_sh=sample.test_sh, toml=sample.toml)
            codex_bin, extra = codex, []
            if sample.kill_on:  # a wrapper runs the npm codex: grant its install tree
                wrapper = killer(root / f"{sample.name}-bin", codex, sample.kill_on)
                codex_bin, extra = str(wrapper), [*install_paths(codex), wrapper.parent]
            grants = [{"name": "gym", "kind": "mcp", "required": True, "url": tools.url,
                       "headers": {"Authorization": "Bearer demo-session-token-42"}}]
            with ScriptedEndpoint(sample.script(tools.url)) as endpoint:
                options = RunOptions(
                    model_base_url=endpoint.url, model="demo-model", codex_bin=codex_bin,
                    overrides=sample.settings, max_attempts=2, readonly_paths=extra,
                    grants=grants if sample.grants else (), runner_id="demo")
                results += await SessionRunner(ledger, task, options).run_trial()
    return results


def outcome_rows(results: Sequence[SessionResult]) -> list[tuple[str, ...]]:
    """The demo's outcomes table: one row per session."""
    rows: list[tuple[str, ...]] = []
    for result in results:
        view = result.view
        d = view.decision
        seed = view.events[0]
        rows.append((
            seed.data.task if isinstance(seed, SessionSeeded) else "?",
            str(result.attempt),
            view.outcome,
            " → ".join(x.rule for x in view.decisions) or "-",
            d.cause.kind if d and d.cause else "-",
            str(view.usage.total_tokens) if view.usage else "unknown",
            ", ".join(f"{k}={v:g}" for k, v in (view.rewards or {}).items()) or "-",
        ))
    return rows
