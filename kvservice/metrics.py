"""Prometheus metrics: per-tier bytes, entries, hits, misses and layer reads, and the sampled
fidelity per model and policy (`kvservice.fidelity`), read from the store at scrape time, plus
fetch/store traffic and fetch latency measured by the server."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.fidelity import AT_FULL, EXACT, HELD, Choice, Tally
from kvservice.store import ChunkStore


class _StoreCollector:
    def __init__(self, store: ChunkStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        used = GaugeMetricFamily("kvcraft_tier_bytes", "Payload bytes held per tier", labels=["tier"])
        budget = GaugeMetricFamily("kvcraft_tier_budget_bytes", "Byte budget per tier", labels=["tier"])
        entries = GaugeMetricFamily("kvcraft_tier_variants", "Variants with a copy in the tier", labels=["tier"])
        hits = CounterMetricFamily("kvcraft_tier_hits", "Fetched layers served from the tier", labels=["tier"])
        misses = CounterMetricFamily("kvcraft_tier_misses", "Fetched layers the tier did not hold", labels=["tier"])
        reads = CounterMetricFamily("kvcraft_tier_layer_reads", "Layers read from the tier: fetches, promotions, "
                                    "demotions", labels=["tier"])
        for t in s.tiers:
            used.add_metric([t.name], t.bytes_used)
            budget.add_metric([t.name], t.bytes_budget)
            entries.add_metric([t.name], t.variants)
            hits.add_metric([t.name], t.hits)
            misses.add_metric([t.name], t.misses)
            reads.add_metric([t.name], t.layer_reads)
        yield from (used, budget, entries, hits, misses, reads)
        yield CounterMetricFamily("kvcraft_evictions", "Variants deleted for space", value=s.evictions)
        yield CounterMetricFamily("kvcraft_moves", "Variants demoted one tier down", value=s.moves)
        yield GaugeMetricFamily("kvcraft_chunks", "Chunks stored", value=s.chunks)
        yield GaugeMetricFamily("kvcraft_leases", "Leases active", value=s.leases)
        yield GaugeMetricFamily("kvcraft_inflight_store_bytes", "What open Store streams are counted at "
                                "(max_inflight_store_bytes)", value=s.inflight_store_bytes)
        yield GaugeMetricFamily("kvcraft_inflight_stores", "Store streams open now", value=s.inflight_stores)
        if s.cluster is not None:
            yield GaugeMetricFamily("kvcraft_cluster_master_up", "1 while this node's Mooncake master answers; 0 while "
                                    "it does not (Plans use this node's own tiers)", value=float(s.cluster.master_up))
            yield GaugeMetricFamily("kvcraft_cluster_silent_segments", "Other nodes' segments skipped because they "
                                    "stopped answering", value=len(s.cluster.silent_segments))
        yield from _fidelity(self.store.fidelity.tallies())
        yield from _budgets(self.store.fidelity.choices())


def _budgets(choices: list[Choice]) -> Iterator[Metric]:
    budget = GaugeMetricFamily("kvcraft_fidelity_budget", "Recompute budget the fidelity controller gives adaptive "
                               "engines (1: exact reuse only, no budget holds the target)", labels=["model", "policy"])
    held = GaugeMetricFamily("kvcraft_fidelity_held", "1 when that budget's agreement is shown at or above "
                             "fidelity_target (or it is 1: exact reuse, or full prefill), 0 while it is being "
                             "measured or kept (at the sample cap, its observed agreement at or above the target)",
                             labels=["model", "policy"])
    near_tie = GaugeMetricFamily("kvcraft_fidelity_near_tie", "Logits under which a blend's first token's lead "
                                 "sends it to full prefill, learned from the samples (0: none)",
                                 labels=["model", "policy"])
    for c in choices:
        budget.add_metric([c.model_id, c.policy], c.budget)
        held.add_metric([c.model_id, c.policy], 1.0 if c.state in (HELD, EXACT, AT_FULL) else 0.0)
        near_tie.add_metric([c.model_id, c.policy], c.near_tie)
    yield from (budget, held, near_tie)


def _fidelity(tallies: list[Tally]) -> Iterator[Metric]:
    labels = ["model", "policy", "budget"]
    samples = CounterMetricFamily("kvcraft_fidelity_samples", "Shadow prefills compared with served requests",
                                  labels=labels)
    agree = CounterMetricFamily("kvcraft_fidelity_top1_agree", "Samples whose top-1 token agreed with full prefill",
                                labels=labels)
    bounds = GaugeMetricFamily("kvcraft_fidelity_top1_agreement", "Wilson 95% bounds on the top-1 agreement rate",
                               labels=[*labels, "bound"])
    kl = GaugeMetricFamily("kvcraft_fidelity_mean_kl", "Mean KL(full || served) of the next token, nats",
                           labels=labels)
    share = GaugeMetricFamily("kvcraft_fidelity_mean_computed_share", "Mean share of row-layers the sampled "
                              "requests computed", labels=labels)
    answer = CounterMetricFamily("kvcraft_fidelity_answer_tokens", "Answer tokens after the first compared with "
                                 "full prefill under teacher forcing", labels=labels)
    answer_agree = CounterMetricFamily("kvcraft_fidelity_answer_agree", "Answer tokens full prefill, fed the "
                                       "served answer, predicts as served", labels=labels)
    shadow = CounterMetricFamily("kvcraft_fidelity_shadow_blends", "Samples of a budget below the one served, "
                                 "blended by the shadows from the same stored KV", labels=labels)
    for t in tallies:
        key = [t.model_id, t.policy, f"{t.budget:g}"]
        lower, upper = t.interval
        samples.add_metric(key, t.samples)
        agree.add_metric(key, t.top1_agree)
        bounds.add_metric([*key, "lower"], lower)
        bounds.add_metric([*key, "upper"], upper)
        kl.add_metric(key, t.mean_kl)
        share.add_metric(key, t.mean_computed_share)
        answer.add_metric(key, t.answer_tokens)
        answer_agree.add_metric(key, t.answer_agree)
        shadow.add_metric(key, t.shadow_blends)
    yield from (samples, agree, bounds, kl, share, answer, answer_agree, shadow)


class Metrics:
    def __init__(self, store: ChunkStore, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(store))
        self.fetch_bytes = Counter("kvcraft_fetch_bytes", "Payload bytes sent by FetchLayers", registry=self.registry)
        self.store_bytes = Counter("kvcraft_store_bytes", "Payload bytes accepted by Store", registry=self.registry)
        self.fetch_seconds = Histogram("kvcraft_fetch_seconds", "FetchLayers stream duration", registry=self.registry)
        self._http = None
        self.port = 0
        if port:
            try:
                self._http, _ = start_http_server(port, addr=host, registry=self.registry)
            except OSError as e:
                raise OSError(f"cannot serve metrics on {host}:{port} (metrics_port): {e.strerror}") from None
            self.port = self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None
