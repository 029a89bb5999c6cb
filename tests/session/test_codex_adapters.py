"""The Codex adapters on their own: exec stream lines, rollouts, config.toml."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import zstandard

from trialledger.adapters.codex.config import API_KEY_ENV, codex_config, render
from trialledger.adapters.codex.rollout import rollout_files, usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.adapters.sandbox.agentfiles import AgentTree
from trialledger.adapters.session import capture
from trialledger.core.events import Grant
from trialledger.core.settings import Settings

AT = "2026-11-29T10:00:00Z"
EXAMPLE = Path(__file__).parents[1] / "data" / "codex-0.125-example.jsonl"


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


# --- compressed rollouts: decompressed, scrubbed, bounded (docs/SPEC.md §8) -----------------

SECRET = "sk-zst-Secret-4f9Kq2Lm8Np"
DAY = "sessions/2026/11/29"


def _pieces(secret: str) -> list[bytes]:
    return [secret[i:i + 8].encode() for i in range(len(secret) - 7)]


def _rollout_lines() -> bytes:
    said = json.dumps({"timestamp": AT, "type": "response_item", "payload": {
        "type": "function_call_output", "output": f"key={SECRET}\n"}})
    return f"{_token_count((100, 20, 120))}\n{said}\n".encode()


def _codex_home(tmp_path: Path, files: dict[str, bytes]) -> AgentTree:
    for name, data in files.items():
        (tmp_path / "home" / DAY).mkdir(parents=True, exist_ok=True)
        (tmp_path / "home" / DAY / name).write_bytes(data)
    return AgentTree(tmp_path / "home")


def _at_rest(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())


def test_a_compressed_rollout_is_archived_decompressed_and_scrubbed(tmp_path: Path) -> None:
    # two frames, as a writer that flushes per batch leaves them
    compressed = b"".join(zstandard.ZstdCompressor().compress(part)
                          for part in (_rollout_lines(), b'{"type": "later"}\n'))
    assert SECRET.encode() not in compressed  # what a raw copy would keep, unscrubbable
    tree = _codex_home(tmp_path, {"rollout-2026-11-29T08-45-41-abc.jsonl.zst": compressed})
    result = capture.copy_archive(tree, tmp_path / "archive", [SECRET])
    assert (result.files, result.refused) == (1, [])
    [kept] = [p for p in (tmp_path / "archive").rglob("*") if p.is_file()]
    assert kept.relative_to(tmp_path / "archive").as_posix() == (
        f"{DAY}/rollout-2026-11-29T08-45-41-abc.jsonl")
    assert kept.stat().st_mode & 0o777 == 0o600
    text = kept.read_text()
    assert "key=[redacted]" in text and text.endswith('{"type": "later"}')
    assert not [piece for piece in _pieces(SECRET) if piece in _at_rest(tmp_path / "archive")]
    # and its usage is read as a plain rollout's
    natives = [e for e in capture.usage_events(tree, at=AT) if e["type"] == "usage.native"]
    assert [n["data"]["total"]["total_tokens"] for n in natives] == [120]


@pytest.mark.parametrize("damage", ["garbage", "a bad frame after a good one", "checksum"])
def test_a_damaged_compressed_rollout_is_left_out_with_a_gap(tmp_path: Path,
                                                              damage: str) -> None:
    good = zstandard.ZstdCompressor(write_checksum=True).compress(_rollout_lines())
    flipped = bytearray(good)
    flipped[-6] ^= 0xFF  # in the last block: what came before decodes first
    data = {"garbage": b"not zstd: " + SECRET.encode(),
            "a bad frame after a good one": good + b"\x28\xb5\x2f\xfd" + b"\xff" * 64,
            "checksum": bytes(flipped)}[damage]
    tree = _codex_home(tmp_path, {"rollout-damaged.jsonl.zst": data,
                                  "rollout-plain.jsonl": _rollout_lines()})
    result = capture.copy_archive(tree, tmp_path / "archive", [SECRET])
    assert [e.gap()["code"] for e in result.refused] == ["archive_unscrubbed"]
    detail = result.refused[0].gap()["detail"]
    assert detail.startswith(f"{DAY}/rollout-damaged.jsonl.zst: not a zstd stream that can "
                             f"be decoded") and detail.endswith("left out of the archive")
    kept = sorted(p.name for p in (tmp_path / "archive").rglob("*") if p.is_file())
    assert kept == ["rollout-plain.jsonl"] and result.files == 1
    assert not [piece for piece in _pieces(SECRET) if piece in _at_rest(tmp_path / "archive")]


def test_a_compressed_rollout_bomb_stops_at_the_rollout_cap(tmp_path: Path) -> None:
    bomb = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(1024 * 1024)
    data = b"".join(bomb.compress(zeros) for _ in range(257)) + bomb.flush()
    assert len(data) < 1024 * 1024  # 257 MiB of zeros (one long line), in a few KiB
    tree = _codex_home(tmp_path, {"rollout-bomb.jsonl.zst": data})
    result = capture.copy_archive(tree, tmp_path / "archive", [SECRET])
    assert [(e.gap()["code"], e.rule) for e in result.refused] == [
        ("unsafe_agent_file", "decompresses to over the 268435456-byte cap")]
    assert result.files == 0 and not [p for p in (tmp_path / "archive").rglob("*")
                                      if p.is_file()]
