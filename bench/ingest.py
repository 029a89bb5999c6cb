"""Streaming ingest of a Codex exec log and rollout, in its own process (for its peak RSS).

    python -m bench.ingest EXEC_LOG ROLLOUT   → prints {"seconds", "events", "max_rss_mb"}
"""

from __future__ import annotations

import json
import sys
import time

from trialledger.adapters.codex.rollout import iter_usage_events
from trialledger.adapters.codex.stream import parse_stream_line
from trialledger.core.parsing import parse_event


def main(exec_log: str, rollout: str) -> None:
    start = time.perf_counter()
    events = 0
    with open(exec_log, encoding="utf-8") as lines:
        for line in lines:  # the runner's path: line → event → validated model
            for event in parse_stream_line(line.rstrip("\n")).events("2026-11-29T08:00:00Z"):
                parse_event(event)
                events += 1
    with open(rollout, encoding="utf-8") as lines:
        for event in iter_usage_events(lines, at="2026-11-29T08:00:00Z"):
            parse_event(event)
            events += 1
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "events": events, "max_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident memory since exec (VmHWM; ru_maxrss would include the
    memory of the parent this process was forked from)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main(*sys.argv[1:3])
