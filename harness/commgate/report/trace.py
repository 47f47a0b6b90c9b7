"""``trace.json``: a report's captures as Chrome trace events, for Perfetto (ui.perfetto.dev) and
chrome://tracing, from the report document alone."""

from __future__ import annotations

from typing import Any

from commgate.report.report import ran


def trace(doc: dict[str, Any]) -> dict[str, Any]:
    """Chrome trace events (Perfetto, chrome://tracing): one process per scenario, one thread per rank;
    every captured call a complete event, every step a span on its own row. Times: each rank's clock from
    its first call, in microseconds, scenarios laid one after another."""
    events: list[dict[str, Any]] = []
    offset = 0.0
    for pid, s in enumerate(ran(doc), 1):
        cap = s.get("capture")
        if not cap:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": s["name"]}})
        end = 0.0
        for r in range(cap["world_size"]):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1000 + r, "args": {"name": f"rank {r} steps"}}
            )
        for c in cap["calls"]:
            if c["duration_ns"] is None:
                continue
            ts, dur = offset + c["start_ns"] / 1e3, c["duration_ns"] / 1e3
            end = max(end, ts + dur)
            args = {k: c[k] for k in ("bytes", "dtype", "group", "peer", "root", "step", "phase", "tensors")}
            events.append(
                {
                    "ph": "X",
                    "name": c["op"],
                    "cat": c["phase"],
                    "pid": pid,
                    "tid": c["rank"],
                    "ts": ts,
                    "dur": dur,
                    "args": args,
                }
            )
        for w in cap.get("step_windows", []):
            ts = offset + w["start_ns"] / 1e3
            dur = (w["end_ns"] - w["start_ns"]) / 1e3
            end = max(end, ts + dur)
            events.append(
                {
                    "ph": "X",
                    "name": f"step {w['step']}",
                    "cat": "step",
                    "pid": pid,
                    "tid": 1000 + w["rank"],
                    "ts": ts,
                    "dur": dur,
                }
            )
        offset = end + 1e5  # 100 ms between scenarios
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "commgate", "created": doc.get("created")},
    }
