"""Two jobs compared figure by figure (docs/SPEC.md §13, `job diff`): what `trialledger job
diff` prints and the view's side-by-side page both show."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trialledger.core.summary import compare, figure_key


def _diff_rows(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A job's figures, tokens None when some usage is unknown, and pass@k by k."""
    return [dict(t, total_tokens=None if t["unknown_usage"] else t["total_tokens"],
                 passk={p["k"]: p["pass_at_k"] for p in summary["passk"]
                        if p["task"] == t["task"] and p["dataset"] == t["dataset"]
                        and p.get("name") == t.get("name")})
            for t in summary["tasks"]]


def _with_common_k(rows: list[dict[str, Any]], a: list[dict[str, Any]],
                   b: list[dict[str, Any]]) -> None:
    """Each row's pass@k at the largest k both jobs' figure has."""
    left = {figure_key(r): r["passk"] for r in a}
    right = {figure_key(r): r["passk"] for r in b}
    for row in rows:
        key = str(row["figure"])
        common = sorted(set(left.get(key, {})) & set(right.get(key, {})))
        k = common[-1] if common else None
        va = left[key][k] if k is not None else None
        vb = right[key][k] if k is not None else None
        row["pass_at_k"] = {"k": k, "a": va, "b": vb,
                            "diff": None if va is None or vb is None else vb - va}


def job_diff(a: str, summary_a: Mapping[str, Any], b: str, summary_b: Mapping[str, Any]
             ) -> dict[str, Any]:
    """`job diff A B --json`: each figure's mean, passed, pass@k and tokens on both sides
    with B − A; figures of one side only say so in `only`."""
    rows_a, rows_b = _diff_rows(summary_a), _diff_rows(summary_b)
    rows: list[dict[str, Any]] = compare(rows_a, rows_b, ("mean", "passed", "total_tokens"))
    _with_common_k(rows, rows_a, rows_b)
    return {"a": a, "b": b, "partial": bool(summary_a["partial"] or summary_b["partial"]),
            "figures": rows}
