"""SPEC §5–6: seed validation, each rejection with a message a user can act on."""

from __future__ import annotations

import os
from typing import Any

import pytest

from trialledger.core import SeedRejected
from trialledger.core.seed import check_workdir, validate_seed

BASE: dict[str, Any] = {
    "trial_id": "t", "attempt": 1, "runner_id": "r", "task": "demo", "instruction": "hi",
    "agent": {"name": "codex", "version": "0.171.0"}, "model": "m",
}


def seed(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


def grant(name: str = "docs", kind: str = "mcp", required: bool = False,
          token: str = "Bearer tok-0123456789abcdef") -> dict[str, Any]:
    return {"name": name, "kind": kind, "required": required,
            "url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": token}}


def test_defaults_are_filled_and_every_opt_in_is_off() -> None:
    s = validate_seed(seed()).data.settings
    assert (s.timeout_s, s.session_close_timeout_s, s.verifier_timeout_s, s.workdir) == (
        3600, 60, 600, "/app")
    assert not (s.verify_after_agent_error or s.inherit_sandbox_environment
                or s.raise_oom_score_adj or s.model_server_forwards_reasoning_effort)


def test_grant_headers_are_stored_redacted_with_fingerprints_and_kept_as_secrets() -> None:
    valid = validate_seed(seed(grants=[grant()]), api_key="sk-endpoint-key-123")
    (stored,) = valid.data.grants
    assert stored.headers == {"Authorization": "[redacted]"}
    assert stored.header_fingerprints["Authorization"].startswith("sha256:")
    assert len(stored.header_fingerprints["Authorization"]) == len("sha256:") + 12
    assert set(valid.secrets) == {"Bearer tok-0123456789abcdef", "tok-0123456789abcdef",
                                  "sk-endpoint-key-123"}
    assert "tok-0123" not in valid.data.model_dump_json()


def test_a_grant_is_one_model_given_in_clear_and_stored_redacted() -> None:
    from trialledger.core.events import Grant

    valid = validate_seed(seed(grants=[grant()]))
    (given,), (stored,) = valid.grants, valid.data.grants
    assert type(given) is type(stored) is Grant
    assert given.headers == {"Authorization": "Bearer tok-0123456789abcdef"}
    assert given.header_fingerprints == {} and given.stored() == stored
    # Fingerprints are the store's to make: a grant that brings them is refused, as before.
    for grants, configured in (([{**grant(), "header_fingerprints": {}}], []), ([], [stored])):
        with pytest.raises(SeedRejected, match="grant field 'header_fingerprints'"):
            validate_seed(seed(grants=grants), configured_grants=configured)


def test_required_direct_http_grant_is_rejected() -> None:
    with pytest.raises(SeedRejected, match=r"required grant .api..*MCP"):
        validate_seed(seed(grants=[grant("api", kind="direct_http", required=True)]))


def test_required_grant_with_a_bad_name_is_rejected() -> None:
    with pytest.raises(SeedRejected, match=r"required grant .my docs..*letters, digits"):
        validate_seed(seed(grants=[grant("my docs", required=True)]))


def test_duplicate_grant_names_are_rejected() -> None:
    with pytest.raises(SeedRejected, match="unique; repeated: docs"):
        validate_seed(seed(grants=[grant(), grant()]))


def test_optional_unusable_grants_are_left_out_and_reported() -> None:
    valid = validate_seed(seed(grants=[grant("my docs"), grant("api", kind="direct_http"),
                                       grant("ok-1")]))
    assert [g.name for g in valid.data.grants] == ["ok-1"]
    assert [s.gap["code"] for s in valid.skipped] == ["mcp_server_skipped"] * 2
    assert "my docs" in valid.skipped[0].gap["detail"]
    assert "tok-0123456789abcdef" in valid.secrets  # a left-out grant's token is still secret


def test_session_grants_replace_configured_ones_of_the_same_name() -> None:
    configured = [grant("docs", token="old-token-aaaaaaaa"), grant("wiki")]
    valid = validate_seed(seed(grants=[grant("docs", required=True)]),
                          configured_grants=configured)
    assert [(g.name, g.required) for g in valid.data.grants] == [("wiki", False), ("docs", True)]


@pytest.mark.parametrize("settings, message", [
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": -5}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"session_close_timeout_s": 0}, "session_close_timeout_s"),
    ({"mcp_tool_timeout_s": 0}, "mcp_tool_timeout_s"),
    ({"mcp_tool_timeout_s": float("nan")}, "mcp_tool_timeout_s"),
    ({"timeout_s": 10, "mcp_tool_timeout_s": 11}, "must not exceed timeout_s"),
    ({"request_max_retries": 101}, "request_max_retries"),
    ({"stream_max_retries": -1}, "stream_max_retries"),
    ({"reasoning_effort": "high"}, "model_server_forwards_reasoning_effort"),
    ({"reasoning_effort": "extreme", "model_server_forwards_reasoning_effort": True},
     "reasoning_effort"),
    ({"features": {"memories": "yes"}}, "features"),
    ({"verify_after_agent_eror": True}, "verify_after_agent_eror"),
    ({"workdir": "app"}, "absolute"),
    ({"workdir": "/app/../etc"}, "absolute"),
])
def test_bad_settings_are_rejected_naming_the_setting(settings: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(SeedRejected, match=message):
        validate_seed(seed(settings=settings))


def test_accepted_edge_settings() -> None:
    s = validate_seed(seed(settings={
        "timeout_s": 10, "mcp_tool_timeout_s": 10, "reasoning_effort": "high",
        "model_server_forwards_reasoning_effort": True, "features": {"memories": False},
    })).data.settings
    assert s.mcp_tool_timeout_s == 10 and s.features == {"memories": False}


@pytest.mark.parametrize("bad", [{"attempt": 0}, {"trial_id": ""}, {"agent": {"name": "x"}}])
def test_bad_seed_fields_are_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(SeedRejected):
        validate_seed(seed(**bad))


def test_workdir_slash_is_accepted_and_overlaps_are_rejected(tmp_path: Any) -> None:
    roots = [str(tmp_path / "sessions"), str(tmp_path / "runtime")]
    check_workdir("/", private_roots=roots)
    check_workdir(str(tmp_path / "work"), private_roots=roots)
    for bad in (roots[0], str(tmp_path), roots[1] + "/x"):
        with pytest.raises(SeedRejected, match="overlaps"):
            check_workdir(bad, private_roots=roots)


def test_symlinked_overlap_is_rejected_when_paths_are_resolved(tmp_path: Any) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (tmp_path / "link").symlink_to(sessions)
    check_workdir(str(tmp_path / "link"), private_roots=[str(sessions)])  # lexical: disjoint
    with pytest.raises(SeedRejected, match="overlaps"):
        check_workdir(str(tmp_path / "link"), private_roots=[str(sessions)],
                      resolve=os.path.realpath)
