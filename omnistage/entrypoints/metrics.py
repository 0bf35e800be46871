"""Prometheus metrics of one server (its own ``CollectorRegistry``, so several apps can share a process).

Gauges (queue depths, KV usage, per-request records, bridge states, cached encoder outputs, weight bytes per
component and KV pool bytes per stage; resident memory of the server and of each stage worker) are
refreshed from the engine client's ``resource_stats()`` at scrape time; counters and histograms are fed by the
server per request and by the engine's ``on_step`` hook per stage step (the hook runs on the engine thread;
prometheus_client is thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from omnistage.runtime_env import resident_bytes

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.running = Gauge("omnistage_num_requests_running", "Requests running in a stage", ["stage"], registry=r)
        self.waiting = Gauge("omnistage_num_requests_waiting", "Requests waiting in a stage", ["stage"], registry=r)
        self.kv_usage = Gauge("omnistage_kv_cache_usage_ratio", "Fraction of KV blocks in use", ["stage"], registry=r)
        self.records = Gauge("omnistage_request_records", "Per-request runner records held by a stage", ["stage"],
                             registry=r)
        self.bridge_entries = Gauge("omnistage_bridge_entries", "Per-request states held by a stage's input bridge",
                                    ["stage"], registry=r)
        self.encoder_entries = Gauge("omnistage_encoder_cache_entries",
                                     "Media encoder outputs a stage holds for prompts not yet prefilled", ["stage"],
                                     registry=r)
        # Prefix caching, cumulative since the engine started (read from the stages at scrape time).
        self.prefix_queries = Gauge("omnistage_prefix_cache_queried_tokens", "Prompt tokens of admitted requests "
                                    "looked up in a stage's prefix cache", ["stage"], registry=r)
        self.prefix_hits = Gauge("omnistage_prefix_cache_hit_tokens", "Prompt tokens served from a stage's prefix "
                                 "cache instead of being prefilled", ["stage"], registry=r)
        self.prefix_blocks = Gauge("omnistage_prefix_cache_blocks", "KV blocks registered in a stage's prefix cache "
                                   "(held or free)", ["stage"], registry=r)
        self.prefix_evictions = Gauge("omnistage_prefix_cache_evictions", "Cached KV blocks a stage reclaimed for "
                                      "other content", ["stage"], registry=r)
        self.pending = Gauge("omnistage_pending_payloads", "Upstream payloads queued in a stage, not yet run",
                             ["stage"], registry=r)
        self.weight_bytes = Gauge("omnistage_stage_weight_bytes", "Bytes of weights a stage holds, per component "
                                  "(as loaded: packed copies included)", ["stage", "component"], registry=r)
        self.kv_bytes = Gauge("omnistage_stage_kv_cache_bytes", "Bytes of a stage's paged KV pool", ["stage"],
                              registry=r)
        self.resident = Gauge("omnistage_process_resident_bytes", "Anonymous resident memory of the server process "
                              "and of each stage worker process", ["process"], registry=r)
        self.in_flight = Gauge("omnistage_requests_in_flight", "Requests tracked by the orchestrator", registry=r)
        self.prompt_tokens = Counter("omnistage_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("omnistage_generation_tokens", "Text tokens generated", registry=r)
        self.audio_seconds = Counter("omnistage_audio_seconds", "Seconds of audio generated", registry=r)
        self.requests = Counter("omnistage_requests", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("omnistage_time_to_first_token_seconds", "Time to first text token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("omnistage_inter_token_latency_seconds", "Time between text tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("omnistage_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("omnistage_time_to_first_audio_seconds", "Time to first audio chunk",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("omnistage_real_time_factor", "Request wall time / seconds of audio produced",
                             buckets=_RTF_BUCKETS, registry=r)
        self.step_time = Histogram("omnistage_stage_step_seconds", "Wall time of one stage step", ["stage"],
                                   buckets=_STEP_BUCKETS, registry=r)
        self.step_tokens = Counter("omnistage_stage_step_tokens", "Tokens (rows) processed by stage steps",
                                   ["stage"], registry=r)
        # Realtime (WebSocket) sessions.
        self.realtime_sessions = Gauge("omnistage_realtime_sessions", "Open realtime sessions", registry=r)
        self.realtime_rejected = Counter("omnistage_realtime_sessions_rejected", "Realtime sessions refused at the "
                                         "session limit", registry=r)
        self.realtime_turns = Counter("omnistage_realtime_turns", "Realtime responses by final status", ["status"],
                                      registry=r)
        self.realtime_speech_to_audio = Histogram(
            "omnistage_realtime_speech_end_to_first_audio_seconds",
            "Time from the end of user speech (server VAD stop) to the first audio delta of the answer",
            buckets=_LATENCY_BUCKETS, registry=r)

    def client_abort(self) -> None:
        """A client that left before its request reached the engine (while still sending its body)."""
        self.requests.labels("abort").inc()

    # ---- engine hook (engine thread) ---------------------------------------------------------------
    def observe_step(self, events: Any) -> None:
        self.step_time.labels(events.stage).observe(events.step_time)
        if events.num_tokens:
            self.step_tokens.labels(events.stage).inc(events.num_tokens)

    # ---- scrape ------------------------------------------------------------------------------------
    def update_resources(self, stats: Mapping[str, Any]) -> None:
        for stage, s in stats.items():
            if not isinstance(s, Mapping):
                continue
            self.running.labels(stage).set(s.get("running", 0))
            self.waiting.labels(stage).set(s.get("waiting", 0))
            if "kv_usage" in s:
                self.kv_usage.labels(stage).set(s["kv_usage"])
            self.records.labels(stage).set(s.get("records", 0))
            self.bridge_entries.labels(stage).set(s.get("bridge_entries", 0))
            if "pending_chunks" in s:
                self.pending.labels(stage).set(s["pending_chunks"])
            if "encoder_entries" in s:
                self.encoder_entries.labels(stage).set(s["encoder_entries"])
            for component, n in s.get("weight_bytes", {}).items():
                self.weight_bytes.labels(stage, component).set(n)
            if "kv_cache_bytes" in s:
                self.kv_bytes.labels(stage).set(s["kv_cache_bytes"])
            worker = s.get("worker")
            if isinstance(worker, Mapping) and "resident_bytes" in worker:
                self.resident.labels(stage).set(worker["resident_bytes"])
            if "prefix_cache_queries" in s:
                self.prefix_queries.labels(stage).set(s["prefix_cache_queries"])
                self.prefix_hits.labels(stage).set(s["prefix_cache_hits"])
                self.prefix_blocks.labels(stage).set(s["prefix_cached_blocks"])
                self.prefix_evictions.labels(stage).set(s["prefix_cache_evictions"])
        self.resident.labels("server").set(resident_bytes())
        self.in_flight.set(stats.get("requests", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping; call ``tokens``/``audio`` as deltas arrive and ``finish`` once."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, start: float | None = None) -> None:
        """``start``: when the request was submitted (``time.monotonic()``; default now)."""
        self.metrics = metrics
        self.start = time.monotonic() if start is None else start
        self.last_token: float | None = None
        self.first_audio: float | None = None
        self.num_tokens = 0
        self.audio_samples = 0
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            # A delta may carry several tokens: spread its gap evenly over them.
            gap = (now - self.last_token) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last_token = now
        self.num_tokens += n
        self.metrics.generation_tokens.inc(n)

    def audio(self, num_samples: int) -> None:
        if num_samples <= 0:
            return
        if self.first_audio is None:
            self.first_audio = time.monotonic()
            self.metrics.ttfa.observe(self.first_audio - self.start)
        self.audio_samples += num_samples

    def finish(self, finish_reason: str | None, sample_rate: int | None) -> None:
        elapsed = time.monotonic() - self.start
        self.metrics.e2e.observe(elapsed)
        self.metrics.requests.labels(finish_reason or "unknown").inc()
        if self.audio_samples and sample_rate:
            seconds = self.audio_samples / sample_rate
            self.metrics.audio_seconds.inc(seconds)
            self.metrics.rtf.observe(elapsed / seconds)
