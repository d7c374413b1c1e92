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
    pp_weight_bytes, pp_kv_bytes, pp_peak_rss_bytes  memory
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from node.membership.gossip import State

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_FAST = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)


class NodeMetrics:
    def __init__(self, snapshot: Callable[[], dict]):
        """`snapshot()` gives the node's figures of the moment (StageNode.health plus gossip counts)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.generated = Counter("pp_generated_tokens", "Tokens generated (stage 0: as fed back to it)", registry=r)
        self.prompt = Counter("pp_prompt_tokens", "Prompt tokens of requests admitted (stage 0)", registry=r)
        self.ended = Counter("pp_requests", "Requests ended at stage 0, by how", ["reason"], registry=r)
        self.ttft = Histogram("pp_time_to_first_token_seconds", "Stage 0: from admission to the first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("pp_time_per_output_token_seconds", "Stage 0: between consecutive tokens of a request",
                              buckets=_LATENCY, registry=r)
        self.step = Histogram("pp_step_compute_seconds", "One batched step on the compute thread", buckets=_LATENCY,
                              registry=r)
        self.hop = Histogram("pp_hop_seconds", "Where a hop's time goes (node/observe/hops.py): per hop and part",
                             ["hop", "part"], buckets=_FAST, registry=r)
        r.register(_Snapshot(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Snapshot:
    """The gauges, read from the node at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def describe(self):
        return []  # not known before the first scrape: no fixed description

    def collect(self):
        s = self._snapshot()
        for name, help_text, value in (
                ("pp_requests_running", "Stage 0: requests holding sequence slots", s.get("running")),
                ("pp_requests_queued", "Stage 0: requests waiting for a slot", s.get("queued")),
                ("pp_slots_in_use", "Sequence slots held on this stage", s.get("slots_in_use")),
                ("pp_weight_bytes", "Bytes of this stage's weights", s.get("weight_bytes")),
                ("pp_kv_bytes", "Bytes of this stage's KV caches", s.get("kv_bytes")),
                ("pp_peak_rss_bytes", "Peak resident memory of the process", s.get("peak_rss_bytes"))):
            if value is not None:
                yield GaugeMetricFamily(name, help_text, value=value)
        members = GaugeMetricFamily("pp_gossip_members", "Members of this node's gossip view, by state",
                                    labels=["state"])
        for state in State:
            members.add_metric([state.value], s.get("members", {}).get(state.value, 0))
        yield members
