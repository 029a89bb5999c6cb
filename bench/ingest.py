"""Streaming ingest of a Codex exec log and rollout, in its own process (for its peak RSS).

    python -m bench.ingest EXEC_LOG ROLLOUT   → prints {"seconds", "events", "max_rss_mb"}
"""

from __future__ import annotations

import json
import resource
import sys
import time

from adapters.codex.rollout import iter_usage_events
from adapters.codex.stream import parse_stream_line
from core import parse_event


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
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "events": events, "max_rss_mb": rss}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
