"""The Codex adapters on their own: exec stream lines, rollouts, config.toml."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from trialledger.adapters.codex.config import API_KEY_ENV, codex_config, render
from trialledger.adapters.codex.rollout import rollout_files, usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.core.events import Grant
from trialledger.core.settings import Settings

AT = "2026-11-29T10:00:00Z"
EXAMPLE = Path(__file__).parent / "data" / "codex-0.125-example.jsonl"


def test_every_documented_line_maps_to_its_event() -> None:
    records = [parse_stream_line(line) for line in EXAMPLE.read_text().splitlines()]
    assert [r.type for r in records] == [
        "thread.started", "turn.started", *["item.completed"] * 1,
        "item.started", "item.completed", "item.started", "item.completed", "item.started",
        "item.completed", "item.started", "item.started", "item.completed", "item.completed",
        "item.completed", "turn.completed"]
    assert all(r.gap is None and "type" not in r.data for r in records)


def test_web_search_with_two_id_keys_keeps_the_last() -> None:
    line = ('{"type":"item.started","item":{"id":"item_1","type":"web_search","id":"ws_08df",'
            '"query":"","action":{"type":"other"}}}')
    assert parse_stream_line(line).data["item"]["id"] == "ws_08df"


def test_top_level_error_becomes_stream_error() -> None:
    record = parse_stream_line('{"type":"error","message":"Reconnecting... 1/5 (x)"}')
    assert (record.type, record.data) == ("stream.error", {"message": "Reconnecting... 1/5 (x)"})


def test_unknown_types_and_shapes_are_kept_whole() -> None:
    for line in ('{"type":"item.plan.delta","delta":"x"}', '{"no":"type"}', '[1,2]',
                 '{"type":"turn.failed","error":"a string, not an object"}',
                 '{"type":"item.completed","item":"not an object"}'):
        record = parse_stream_line(line)
        assert (record.type, record.data, record.gap) == ("codex.unknown", {"line": line}, None)


def test_a_line_that_is_not_json_is_kept_with_a_gap() -> None:
    record = parse_stream_line('{"type":"turn.comp')  # a torn last line
    assert record.type == "codex.unknown" and record.data == {"line": '{"type":"turn.comp'}
    assert record.gap is not None and record.gap["code"] == "codex_unparsable_line"
    assert [e["type"] for e in record.events(AT)] == ["codex.unknown", "gap.recorded"]


def _token_count(total: tuple[int, int, int], *, ordinal: int | None = None,
                 cache_write: bool = False) -> str:
    def usage(f: tuple[int, int, int]) -> dict[str, int]:
        u = {"input_tokens": f[0], "cached_input_tokens": 0, "output_tokens": f[1],
             "reasoning_output_tokens": 0, "total_tokens": f[2]}
        if cache_write:
            u["cache_write_input_tokens"] = 0
        return u
    line: dict[str, object] = {"timestamp": "2026-11-29T08:45:41.965Z", "type": "event_msg",
                               "payload": {"type": "token_count", "info": {
                                   "total_token_usage": usage(total),
                                   "last_token_usage": usage(total),
                                   "model_context_window": 258400}, "rate_limits": None}}
    if ordinal is not None:
        line["ordinal"] = ordinal
    return json.dumps(line)


def test_rollout_totals_are_deduplicated_across_both_shapes() -> None:
    lines = [
        '{"timestamp":"x","type":"session_meta","payload":{"id":"t"}}',
        '{"timestamp":"x","type":"event_msg","payload":{"type":"token_count","info":null}}',
        _token_count((12, 10, 22)),
        _token_count((12, 10, 22)),  # repeated when rate-limit headers arrive
        '{"timestamp":"x","ordinal":9,"type":"token_usage_record","payload":{"response_id":"r",'
        '"usage":{"input_tokens":99,"output_tokens":1,"total_tokens":100}}}',
        _token_count((30, 14, 44), ordinal=12, cache_write=True),
        '{"timestamp":"x","type":"event_msg","payload":{"type":"token_cou',  # torn
    ]
    events = usage_events(lines, at=AT)
    assert [e["type"] for e in events] == ["usage.native", "usage.native"]
    assert [e["data"]["total"]["total_tokens"] for e in events] == [22, 44]
    assert "cache_write_input_tokens" not in events[1]["data"]["total"]


def test_a_reset_total_is_a_gap_not_usage() -> None:
    window = json.dumps({"timestamp": "x", "type": "event_msg", "payload": {
        "type": "token_count", "info": {"total_token_usage": {
            "input_tokens": 0, "cached_input_tokens": 0, "output_tokens": 0,
            "reasoning_output_tokens": 0, "total_tokens": 258400}}}})
    events = usage_events([_token_count((100, 20, 120)), window, _token_count((50, 5, 55))],
                          at=AT)
    assert [(e["type"], e["data"].get("code")) for e in events] == [
        ("usage.native", None), ("gap.recorded", "native_usage_reset"),
        ("gap.recorded", "native_usage_reset")]


def test_rollout_files_are_found_under_sessions(tmp_path: Path) -> None:
    day = tmp_path / "sessions" / "2026" / "11" / "29"
    day.mkdir(parents=True)
    (day / "rollout-2026-11-29T08-45-41-abc.jsonl").write_text("")
    (day / "rollout-2026-11-29T09-45-41-abd.jsonl.zst").write_bytes(b"")
    assert [p.name for p in rollout_files(tmp_path)] == [
        "rollout-2026-11-29T08-45-41-abc.jsonl", "rollout-2026-11-29T09-45-41-abd.jsonl.zst"]


def test_config_toml_has_the_provider_grants_and_no_phoning_home() -> None:
    settings = Settings(request_max_retries=2, stream_max_retries=0, mcp_tool_timeout_s=45,
                        reasoning_effort="high", model_server_forwards_reasoning_effort=True,
                        features={"memories": False}, timeout_s=120)
    grants = [Grant(name="gym-tools", kind="mcp", required=True, url="http://127.0.0.1:1/mcp",
                    headers={"Authorization": "Bearer tok"}),
              Grant(name="docs", kind="mcp", url="http://127.0.0.1:2/mcp")]
    text, digest = render(codex_config(model="m", base_url="http://127.0.0.1:3/v1",
                                       settings=settings, grants=grants))
    config = tomllib.loads(text)
    provider = config["model_providers"][config["model_provider"]]
    assert provider == {"name": "trialledger model endpoint", "base_url": "http://127.0.0.1:3/v1",
                        "env_key": API_KEY_ENV, "wire_api": "responses",
                        "stream_idle_timeout_ms": 120_000, "request_max_retries": 2,
                        "stream_max_retries": 0}
    assert (config["approval_policy"], config["sandbox_mode"]) == ("never", "danger-full-access")
    assert config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False}
    assert config["history"] == {"persistence": "none"}
    assert config["shell_environment_policy"] == {"exclude": [API_KEY_ENV]}  # not for tools
    assert config["model_reasoning_effort"] == "high"
    assert config["features"] == {"memories": False}
    assert config["mcp_servers"] == {
        "gym-tools": {"url": "http://127.0.0.1:1/mcp",
                      "http_headers": {"Authorization": "Bearer tok"}, "required": True,
                      "tool_timeout_sec": 45.0},
        "docs": {"url": "http://127.0.0.1:2/mcp", "tool_timeout_sec": 45.0}}
    assert len(digest) == 64


def test_defaults_leave_codex_its_own_features_and_retries() -> None:
    config = tomllib.loads(render(codex_config(model="m", base_url="u", settings=Settings(),
                                               grants=[]))[0])
    assert "features" not in config and "mcp_servers" not in config
    assert "model_reasoning_effort" not in config
    provider = config["model_providers"][config["model_provider"]]
    assert "request_max_retries" not in provider and "stream_max_retries" not in provider
