"""Prometheus metrics of one server (its own registry, so two servers in one process never clash).

Names follow vLLM's (`vllm:...` -> `bridge:...`) where vLLM has one. Engine gauges (running and
waiting requests, KV-cache usage, free blocks and slots) are a snapshot the engine loop takes
after every step, so reading `/metrics` never touches the engine.

With several API processes (`bridge serve --api-server-count N`) every process writes its samples to
`PROMETHEUS_MULTIPROC_DIR` (prometheus-client's multiprocess mode, set by the parent before it
starts them) and `/metrics`, answered by whichever process the connection reached, adds them up:
counters and histograms summed, the request gauges (live, arriving) summed over live processes, the
engine's snapshot gauges the most recent value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class EngineSnapshot:
    """Engine counters after a step (read by /metrics and the tests)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_free_slots: int = 0
    num_total_slots: int = 0
    encoder_calls: int = 0
    encoded_items: int = 0
    passthrough_uploads: int = 0
    kernel_compiles: int = 0
    kernel_compile_seconds: float = 0.0


class ServeMetrics:
    """Every metric the server exports, in one registry."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        snap = {"registry": r, "multiprocess_mode": "mostrecent"}  # the engine's gauges: one snapshot for all
        self.http_requests = Counter("bridge:http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.request_success = Counter("bridge:request_success", "Finished generation requests by reason",
                                       ["finished_reason"], registry=r)
        self.aborted = Counter("bridge:request_aborted", "Requests aborted (client gone, shutdown)",
                               registry=r)
        self.prompt_tokens = Counter("bridge:prompt_tokens", "Prompt tokens (rows for prompt embeds)",
                                     registry=r)
        self.generation_tokens = Counter("bridge:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("bridge:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("bridge:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("bridge:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_seconds = Histogram("bridge:prompt_embeds_decode_seconds",
                                        "Time to decode one prompt_embeds payload (base64 + torch.load)",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.bodies_parsed = Counter("bridge:request_bodies_parsed",
                                     "JSON request bodies by where they were parsed (pool: an ingest worker)",
                                     ["where"], registry=r)
        # Where a request's time goes before the engine has it (issue: report HTTP vs decode vs queue)
        self.body_seconds = Histogram("bridge:request_body_receive_seconds",
                                      "Request start to its whole body received (HTTP)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.parse_seconds = Histogram("bridge:request_parse_seconds",
                                       "Body received to prompts ready (JSON, validation, payload decode)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.admission_seconds = Histogram("bridge:request_admission_seconds",
                                           "Prompts ready to added to the engine (waits for its tick)",
                                           buckets=_LATENCY_BUCKETS, registry=r)
        self.tick_admit_seconds = Histogram("bridge:engine_tick_admit_seconds",
                                            "Per engine tick: validating and adding the new submissions",
                                            buckets=_LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("bridge:engine_step_seconds",
                                      "Per engine tick: one engine step or decode window",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.kernel_compiles = Gauge("bridge:kernel_compiles",
                                     "Triton kernel builds in the server process, start-up included",
                                     **snap)
        self.kernel_compile_seconds = Gauge("bridge:kernel_compile_seconds",
                                            "Seconds spent building them", **snap)
        self.running = Gauge("bridge:num_requests_running", "Requests in the running batch", **snap)
        self.waiting = Gauge("bridge:num_requests_waiting", "Requests waiting to be scheduled", **snap)
        self.kv_usage = Gauge("bridge:kv_cache_usage_perc", "Fraction of KV blocks in use", **snap)
        self.free_blocks = Gauge("bridge:kv_free_blocks", "Free KV blocks", **snap)
        self.total_blocks = Gauge("bridge:kv_total_blocks", "KV blocks in the pool", **snap)
        self.free_slots = Gauge("bridge:free_slots", "Free request slots", **snap)
        self.total_slots = Gauge("bridge:total_slots", "Request slots (max_num_seqs)", **snap)
        self.live = Gauge("bridge:num_requests_live", "Requests accepted and not yet finished", registry=r,
                          multiprocess_mode="livesum")
        self.arriving = Gauge("bridge:num_requests_arriving",
                              "POST requests received or being parsed, not yet submitted to the engine",
                              registry=r, multiprocess_mode="livesum")
        self.mm_items = Counter("bridge:encoder_cache_queries", "Media items in accepted requests",
                                registry=r)
        self.mm_hits = Counter("bridge:encoder_cache_hits",
                               "Media items served from the encoder cache (already encoded or in flight)",
                               registry=r)
        self.encoded_items = Gauge("bridge:encoder_encoded_items", "Items the encoders ran on so far",
                                   **snap)
        self.encoder_calls = Gauge("bridge:encoder_calls", "Batched encoder calls so far", **snap)

    def set_snapshot(self, s: EngineSnapshot, live: int) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.free_blocks.set(s.num_free_blocks)
        self.total_blocks.set(s.num_total_blocks)
        used = s.num_total_blocks - s.num_free_blocks
        self.kv_usage.set(used / s.num_total_blocks if s.num_total_blocks else 0.0)
        self.free_slots.set(s.num_free_slots)
        self.total_slots.set(s.num_total_slots)
        self.encoded_items.set(s.encoded_items)
        self.encoder_calls.set(s.encoder_calls)
        self.live.set(live)
        self.kernel_compiles.set(s.kernel_compiles)
        self.kernel_compile_seconds.set(s.kernel_compile_seconds)

    def render(self) -> bytes:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:  # several API processes: everyone's samples, added up
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=directory)
            return generate_latest(registry)
        return generate_latest(self.registry)
