"""Prometheus metrics (/metrics): requests, tokens, latency histograms, queue, pool occupancy."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class VLLMNames:
    """The main metrics vLLM's dashboards read (requests running / waiting, cache usage, tokens,
    finished requests, TTFT / ITL / E2E histograms) under vLLM's names (``vllm:...``, a ``model_name``
    label), copied from ours at each scrape, so such panels and alerts read k3serve too. Not all of
    vLLM's (no ``engine`` label, no queue / prefill / decode phase histograms; our histogram buckets;
    request_success counts samples and aborted requests are not counted)."""

    def __init__(self, metrics: "Metrics", model_name: str):
        self.model_name = model_name
        self.pairs = [(metrics.running, "vllm:num_requests_running", {}),
                      (metrics.waiting, "vllm:num_requests_waiting", {}),
                      (metrics.pool_usage, "vllm:kv_cache_usage_perc", {}),
                      (metrics.prompt_tokens, "vllm:prompt_tokens", {}),
                      (metrics.generation_tokens, "vllm:generation_tokens", {}),
                      (metrics.requests, "vllm:request_success", {"finish_reason": "finished_reason"}),
                      (metrics.ttft, "vllm:time_to_first_token_seconds", {}),
                      (metrics.itl, "vllm:inter_token_latency_seconds", {}),
                      (metrics.e2e, "vllm:e2e_request_latency_seconds", {})]

    def collect(self):
        for ours, name, relabel in self.pairs:
            for family in ours.collect():
                out = Metric(name, family.documentation, family.type)
                for s in family.samples:
                    labels = {relabel.get(k, k): v for k, v in s.labels.items()}
                    out.add_sample(name + s.name[len(family.name):], {**labels, "model_name": self.model_name},
                                   s.value, s.timestamp)
                yield out


class Metrics:
    def __init__(self, model_name: str | None = None):
        """``model_name``: also publish vLLM's names for the metrics its dashboards read (VLLMNames)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("k3serve_requests", "Finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("k3serve_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("k3serve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("k3serve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("k3serve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("k3serve_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("k3serve_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.running = Gauge("k3serve_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("k3serve_num_requests_waiting", "Sequences waiting", registry=r)
        self.pool_bytes = Gauge("k3serve_cache_pool_used_bytes", "Pool bytes in use", ["kind"], registry=r)
        self.request_bytes = Gauge("k3serve_request_cache_bytes", "Pool bytes held by live requests", registry=r)
        self.pool_usage = Gauge("k3serve_cache_pool_usage", "Fraction of the pool in use", registry=r)
        self.preemptions = Gauge("k3serve_preemptions", "Preemptions so far", registry=r)
        self.prefix_hit_rate = Gauge("k3serve_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)", registry=r)
        self.prefix_tokens = Gauge("k3serve_prefix_cache_tokens", "Prompt tokens reused / prefilled", ["kind"],
                                   registry=r)
        self.checkpoints = Gauge("k3serve_prefix_cache_checkpoints", "KDA checkpoints held / evicted", ["kind"],
                                 registry=r)
        self.steps = Gauge("k3serve_engine_steps", "Forward steps so far: eager, or a static step "
                           "(decode_graph / prefill_graph: CUDA-graph replays on a GPU)", ["kind"], registry=r)
        self.scheduled_tokens = Gauge("k3serve_engine_scheduled_tokens", "Tokens computed so far: prompt (or "
                                      "recomputed after a preemption) and decode", ["kind"], registry=r)
        self.prefill_steps = Gauge("k3serve_engine_prefill_steps", "Forward steps that computed prompt tokens",
                                   registry=r)
        if model_name is not None:
            r.register(VLLMNames(self, model_name))

    def render(self, st: dict) -> bytes:
        """``st``: the engine's gauges (engine_process.engine_stats)."""
        self.running.set(st["running"])
        self.waiting.set(st["waiting"])
        self.pool_bytes.labels("kda").set(st["kda_bytes"])
        self.pool_bytes.labels("mla").set(st["mla_bytes"])
        self.pool_usage.set(st["used_bytes"] / st["total_bytes"])
        self.preemptions.set(st["preemptions"])
        for kind, n in st["step_kinds"].items():
            self.steps.labels(kind).set(n)
        tokens = st["scheduled_tokens"]
        for kind in ("prefill", "decode"):
            self.scheduled_tokens.labels(kind).set(tokens[kind])
        self.prefill_steps.set(tokens["prefill_steps"])
        self.request_bytes.set(st["request_bytes"])
        ps = st["prefix"]
        if ps:
            self.prefix_hit_rate.set(ps["hit_rate"])
            self.prefix_tokens.labels("reused").set(ps["tokens_reused"])
            self.prefix_tokens.labels("prefilled").set(ps["tokens_prefilled"])
            self.checkpoints.labels("held").set(ps["checkpoints_held"])
            self.checkpoints.labels("evicted").set(ps["checkpoints_evicted"])
        return generate_latest(self.registry)
