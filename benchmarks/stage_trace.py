"""Stage overlap and transport cost for the pipeline benchmark.

``StageTrace`` listens to every stage step (``StepEvents.started`` / ``step_time``, taken on the stage's own
host clock: one monotonic clock for every process of a machine) and tells, over a time window, how long each
stage was busy and which fraction of the window two or more stages were busy at once (in-process stages run
one after another, so that fraction is 0 there; stage workers overlap).

``transport_report`` turns the message counters of the remote stages (API side) and of their workers into
the cost of one hand-off: bytes per message and milliseconds spent encoding, decoding and in transit.
"""

from __future__ import annotations

import resource
from collections import defaultdict
from typing import Any


class StageTrace:
    def __init__(self) -> None:
        self.steps: list[tuple[str, float, float]] = []  # (stage, start, end)

    def __call__(self, events: Any) -> None:
        if events.step_time > 0:
            self.steps.append((events.stage, events.started, events.started + events.step_time))

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        """Busy seconds per stage and the fraction of [t0, t1] with >= 1 and >= 2 stages busy."""
        wall = max(t1 - t0, 1e-9)
        busy: dict[str, float] = defaultdict(float)
        edges = []
        for stage, start, end in self.steps:
            start, end = max(start, t0), min(end, t1)
            if end > start:
                busy[stage] += end - start
                edges += [(start, 1), (end, -1)]
        edges.sort()
        any_busy = two_busy = 0.0
        depth, last = 0, t0
        for t, delta in edges:
            if depth >= 1:
                any_busy += t - last
            if depth >= 2:
                two_busy += t - last
            depth, last = depth + delta, t
        return {"wall": wall, "busy": dict(busy), "any": any_busy / wall, "overlap": two_busy / wall}


def cpu_seconds(engine: Any) -> dict[str, float]:
    """CPU time (user + system) used so far by this process and by each stage worker (contention-proof: what
    the work cost, whatever share of the machine it got)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    out = {"api": me.ru_utime + me.ru_stime}
    if engine.workers is not None:
        import psutil

        for name, pid in engine.workers.pids().items():
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
    return out


def snapshot(engine: Any) -> dict[str, dict[str, float]]:
    """Message counters of every remote stage: API side and worker side."""
    out = {}
    for name, stage in engine.workers.stages.items():
        worker = stage.stats()["worker"]
        out[name] = {**{f"api_{k}": v for k, v in stage.transport.items()},
                     **{f"w_{k}": v for k, v in worker.items() if isinstance(v, (int, float))}}
    return out


def transport_report(before: dict, after: dict) -> list[str]:
    """Per stage: worker -> API (one step's events) and API -> worker (one command, e.g. an upstream payload)."""
    lines = [f"{'stage':>9} | {'event msgs':>13} {'B/msg':>8} {'enc ms':>7} {'dec ms':>7} {'transit ms':>10} | "
             f"{'cmd msgs':>8} {'B/msg':>8} {'enc ms':>7} {'dec ms':>7}"]
    for name in after:
        d = {k: after[name][k] - before[name].get(k, 0) for k in after[name]}
        ev = max(d["api_recv_msgs"], 1)
        cmd = max(d["api_sent_msgs"], 1)
        lines.append(
            f"{name:>9} | {d['api_recv_msgs']:>13.0f} {d['api_recv_bytes'] / ev:>8.0f} "
            f"{1e3 * d['w_encode_s'] / max(d['w_sent_msgs'], 1):>7.3f} {1e3 * d['api_decode_s'] / ev:>7.3f} "
            f"{1e3 * d['api_transit_s'] / max(d['api_events'], 1):>10.3f} | "
            f"{d['api_sent_msgs']:>8.0f} {d['api_sent_bytes'] / cmd:>8.0f} {1e3 * d['api_encode_s'] / cmd:>7.3f} "
            f"{1e3 * d['w_decode_s'] / max(d['w_recv_msgs'], 1):>7.3f}")
    return lines
