"""Policy versions an installed package declares in the entry point group
`trialledger.policies` (docs/SPEC.md §3): registered in every process that opens a store or
replays, so a session seeded under one is read under it anywhere the package is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clean.jsonl"
MODULE = '''from trialledger.core.policy import V2, Policy

NO_PROBE = Policy(name="acme-no-probe",
                  rules=tuple(rule for rule in V2.rules if rule.name != "probe"))
'''


def installed(site: Path, module: str = MODULE, value: str = "acme_policies:NO_PROBE"
              ) -> dict[str, str]:
    """A distribution `acme-policies` in `site` declaring one policy; the environment of a
    process that has it installed."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "acme_policies.py").write_text(module)
    info = site / "acme_policies-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-policies\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[trialledger.policies]\nacme-no-probe = {value}\n")
    return {**os.environ, "PYTHONPATH": str(site)}


def trialledger(*argv: str, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trialledger.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_replay_uses_an_installed_policy_and_refuses_it_where_it_is_not(
        tmp_path: Path) -> None:
    env = installed(tmp_path / "site")
    done = trialledger("replay", "--log", str(EXAMPLE), "--policy", "acme-no-probe", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decision"]["policy"] == "acme-no-probe"
    missing = trialledger("replay", "--log", str(EXAMPLE), "--policy", "acme-no-probe")
    assert missing.returncode == 2 and "unknown policy 'acme-no-probe'" in missing.stderr


def test_a_session_seeded_under_an_installed_policy_is_read_by_every_process(
        tmp_path: Path) -> None:
    env = installed(tmp_path / "site")
    events = [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]
    events[0]["data"]["settings"]["policy"] = "acme-no-probe"
    log = tmp_path / "acme.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    db = str(tmp_path / "t.db")
    imported = trialledger("import", "--db", db, str(log), env=env)
    assert imported.returncode == 0, imported.stderr
    shown = trialledger("show", "--db", db, imported.stdout.strip()[:8], "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["decision"]["policy"] == "acme-no-probe"
    diffed = trialledger("replay", "--db", db, "--all", "--diff", "--policy", "acme-no-probe",
                         "--jobs", "2", env=env)  # its worker processes load it too
    assert diffed.returncode == 0, diffed.stderr


def test_a_broken_entry_point_is_one_line_naming_it(tmp_path: Path) -> None:
    for module, value, said in [
            ("raise RuntimeError('no licence')\n", "acme_policies:NO_PROBE",
             "raised RuntimeError: no licence"),
            ("NO_PROBE = 42\n", "acme_policies:NO_PROBE", "is a int, not a Policy"),
            (MODULE, "acme_policies:NO_PROBE_TYPO", "raised AttributeError")]:
        env = installed(tmp_path / f"site-{len(said)}", module, value)
        done = trialledger("ls", "--db", str(tmp_path / "t.db"), env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "policy entry point acme-no-probe" in lines[0] and said in lines[0], lines


def test_an_unknown_policy_raised_in_a_worker_reaches_the_parent_whole() -> None:
    """A re-derivation worker that meets a policy it does not know raises UnknownPolicy;
    the pool pickles it back to the parent, which prints its one line (it broke the pool,
    a traceback, when its pickling lost an argument)."""
    import pickle

    from trialledger.core.errors import UnknownPolicy

    raised = UnknownPolicy("acme", ["v1", "v3", "v2"])
    back = pickle.loads(pickle.dumps(raised))
    assert type(back) is UnknownPolicy and str(back) == str(raised) and back.name == "acme"
