"""A node's Prometheus metrics (`GET /metrics`, prometheus_client's text format). Counters and histograms are
moved by the node as things happen; the gauges are read from the node when a scraper asks.

    pp_requests_running, pp_requests_queued          stage 0: requests holding slots / waiting for one
    pp_slots_in_use                                  sequence slots held on this stage
    pp_generated_tokens_total, pp_prompt_tokens_total   stage 0: tokens fed back / prompt tokens admitted
    pp_requests_total{reason}                        stage 0: requests ended: finished, cancelled, failed
    pp_time_to_first_token_seconds                   stage 0: admitted to first token (histogram)
    pp_time_per_output_token_seconds                 stage 0: between a request's tokens (histogram)
    pp_step_compute_seconds                          one batched step on the compute thread (histogram)
    pp_hop_seconds{hop,part}                         where a hop's time goes (node/observe/hops.py), per hop and part
    pp_gossip_members{state}                         members of this node's gossip view by state
    pp_prefix_cache_queries_total, _hits_total       stage 0: prompt tokens looked up in the prefix cache / found
    pp_prefix_cache_blocks                           stage 0: whole blocks the prefix cache holds
    pp_weight_bytes, pp_kv_bytes, pp_peak_rss_bytes  memory
    pp_kv_cache_usage_perc                           KV positions held (requests' and the prefix cache's) over those
                                                     the stage may hold, --kv-cache-memory's (vLLM's: 1 = full)
    pp_kv_cache_positions{state}                     KV positions: total (the budget), used (by requests), cached
                                                     (by prefix-cache entries)
    pp_num_preemptions_total                         stage 0: requests preempted for KV room (vLLM's num_preemptions)
    pp_kernels_info{kernels,device,target,fallback}  1, labelled with what a step computes with: kernels="c" (pp's
                                                     CPU kernels) or "tinygrad", and fallback="1" where pp's could not
                                                     be built (vLLM's *_info style)

Every series carries `model_name`, the name the OpenAI API serves the model by, as vLLM's do: a dashboard
made for vLLM filters on it, and one Prometheus can scrape clusters of several models apart.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from node.membership.gossip import State

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_FAST = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)


class NodeMetrics:
    def __init__(self, snapshot: Callable[[], dict], *, model_name: str):
        """`snapshot()` gives the node's figures of the moment (StageNode.health plus gossip counts)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.generated = Counter("pp_generated_tokens", "Tokens generated (stage 0: as fed back to it)", m,
                                 registry=r).labels(model_name)
        self.prompt = Counter("pp_prompt_tokens", "Prompt tokens of requests admitted (stage 0)", m,
                              registry=r).labels(model_name)
        self.ended = _Named(Counter("pp_requests", "Requests ended at stage 0, by how", [*m, "reason"], registry=r),
                            model_name)
        self.ttft = Histogram("pp_time_to_first_token_seconds", "Stage 0: from admission to the first token", m,
                              buckets=_LATENCY, registry=r).labels(model_name)
        self.tpot = Histogram("pp_time_per_output_token_seconds", "Stage 0: between consecutive tokens of a request",
                              m, buckets=_LATENCY, registry=r).labels(model_name)
        self.step = Histogram("pp_step_compute_seconds", "One batched step on the compute thread", m,
                              buckets=_LATENCY, registry=r).labels(model_name)
        self.hop = _Named(Histogram("pp_hop_seconds", "Where a hop's time goes (node/observe/hops.py): per hop and "
                                    "part", [*m, "hop", "part"], buckets=_FAST, registry=r), model_name)
        r.register(_Snapshot(snapshot, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Named:
    """A metric with more labels than model_name: `labels(...)` takes the others, model_name is set."""

    def __init__(self, metric, model_name: str):
        self._metric, self._model_name = metric, model_name

    def labels(self, *values: str):
        return self._metric.labels(self._model_name, *values)


class _Snapshot:
    """The gauges, read from the node at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str):
        self._snapshot, self._model_name = snapshot, model_name

    def describe(self):
        return []  # not known before the first scrape: no fixed description

    def collect(self):
        s, name_label = self._snapshot(), [self._model_name]
        for name, help_text, value in (
                ("pp_requests_running", "Stage 0: requests holding sequence slots", s.get("running")),
                ("pp_requests_queued", "Stage 0: requests waiting for a slot", s.get("queued")),
                ("pp_slots_in_use", "Sequence slots held on this stage", s.get("slots_in_use")),
                ("pp_weight_bytes", "Bytes of this stage's weights", s.get("weight_bytes")),
                ("pp_kv_bytes", "Bytes of this stage's KV caches", s.get("kv_bytes")),
                ("pp_peak_rss_bytes", "Peak resident memory of the process", s.get("peak_rss_bytes"))):
            if value is not None:
                gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
                gauge.add_metric(name_label, value)
                yield gauge
        yield from self._kv_positions(s.get("kv_positions"), name_label)
        yield from self._kernels(s.get("kernels"), name_label)
        if s.get("preemptions") is not None:
            preemptions = CounterMetricFamily("pp_num_preemptions", "Stage 0: requests preempted for KV room, "
                                              "replayed once it frees", labels=["model_name"])
            preemptions.add_metric(name_label, s["preemptions"])
            yield preemptions
        yield from self._prefix_cache(s.get("prefix_cache"), name_label)
        members = GaugeMetricFamily("pp_gossip_members", "Members of this node's gossip view, by state",
                                    labels=["model_name", "state"])
        for state in State:
            members.add_metric([*name_label, state.value], s.get("members", {}).get(state.value, 0))
        yield members

    @staticmethod
    def _kernels(kernels: dict | None, name_label: list[str]):
        """What the stage's steps compute with, as labels of a gauge that is always 1."""
        if not kernels:
            return
        info = GaugeMetricFamily("pp_kernels_info", "What this stage's steps compute with: pp's CPU kernels (c) or "
                                 "tinygrad's, the device, the CPU target, and whether it is a fallback",
                                 labels=["model_name", "kernels", "device", "target", "fallback"])
        info.add_metric([*name_label, kernels["name"], kernels["device"], kernels["target"] or "",
                         "1" if kernels["fallback"] else "0"], 1)
        yield info

    @staticmethod
    def _kv_positions(figures: dict | None, name_label: list[str]):
        """How full the stage's KV caches are, in positions (on the CPU only positions held take memory)."""
        if not figures or figures.get("used") is None:
            return
        usage = GaugeMetricFamily("pp_kv_cache_usage_perc", "KV positions held, by requests and the prefix cache, "
                                  "over those the stage may hold (1 = full)", labels=["model_name"])
        usage.add_metric(name_label, (figures["used"] + figures["cached"]) / figures["total"])
        yield usage
        positions = GaugeMetricFamily("pp_kv_cache_positions", "KV positions of this stage: total (its budget), used "
                                      "by requests, cached by prefix-cache entries", labels=["model_name", "state"])
        for state in ("total", "used", "cached"):
            positions.add_metric([*name_label, state], figures[state])
        yield positions

    @staticmethod
    def _prefix_cache(figures: dict | None, name_label: list[str]):
        """Stage 0's prefix-cache figures, in tokens as vLLM's prefix_cache_queries / prefix_cache_hits."""
        if not figures:
            return
        for name, help_text, key in (
                ("pp_prefix_cache_queries", "Stage 0: prompt tokens looked up in the prefix cache", "queries"),
                ("pp_prefix_cache_hits", "Stage 0: prompt tokens found in the prefix cache", "hits")):
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            counter.add_metric(name_label, figures[key])
            yield counter
        blocks = GaugeMetricFamily("pp_prefix_cache_blocks", "Stage 0: whole blocks the prefix cache holds",
                                   labels=["model_name"])
        blocks.add_metric(name_label, figures["blocks"])
        yield blocks
