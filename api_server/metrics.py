"""Prometheus metrics: what the API sees of its requests, and both daemons' STATUS.

Per request (measured at the HTTP layer, from the request's arrival): outcomes by endpoint, time
to first token, inter-token latency (per token), end-to-end duration, the prefill's handoff
latency (its FINISH timing `handoff_us`), token counts and requests in flight. Per daemon, read
from STATUS_REPLY at each scrape: up, pool blocks (total, used, free, cached, owned, leased),
requests in flight, the prefix cache's counters (queried and hit tokens, evictions) and cached
blocks, and the prefill's link state, round trip and reconnects (`connects` − 1).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.protocol import StatusReply

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DURATION = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_HANDOFF = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class DaemonCollector(Collector):
    """Gauges from the last STATUS_REPLY of each daemon (None: it did not answer)."""

    def __init__(self) -> None:
        self.statuses: dict[str, StatusReply | None] = {"prefill": None, "decode": None}

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "pdkv_daemon_up", "1 when the daemon answers STATUS", labels=["role"]
        )
        blocks = GaugeMetricFamily(
            "pdkv_pool_blocks", "KV pool blocks by state", labels=["role", "state"]
        )
        inflight = GaugeMetricFamily(
            "pdkv_daemon_requests_in_flight", "requests the daemon holds", labels=["role"]
        )
        for role, st in self.statuses.items():
            up.add_metric([role], 0.0 if st is None else 1.0)
            if st is None:
                continue
            pool = dict(st.pool)
            pool["used"] = pool.get("total", 0) - pool.get("free", 0)
            for state, n in pool.items():
                blocks.add_metric([role, state], n)
            inflight.add_metric([role], st.inflight)
        yield from (up, blocks, inflight)
        yield from self._prefix_cache()
        yield from self._link()

    def _prefix_cache(self) -> Iterator[Metric]:
        """The prefix cache's counters, from STATUS_REPLY's `prefix_cache` of each daemon."""
        counters = {
            "queried_tokens": "prompt tokens looked up in the prefix cache",
            "hit_tokens": "prompt tokens whose KV came from the prefix cache",
            "evictions": "cached blocks evicted to make room",
            "pulled_blocks": "blocks the decode's pulls copied (those its cache lacked)",
        }
        families = {
            key: CounterMetricFamily(f"pdkv_prefix_cache_{key}", text, labels=["role"])
            for key, text in counters.items()
        }
        cached = GaugeMetricFamily(
            "pdkv_prefix_cache_blocks", "blocks holding cached KV (free ones only)", labels=["role"]
        )
        for role, st in self.statuses.items():
            cache = st.prefix_cache if st is not None else {}
            if not cache.get("enabled"):
                continue
            for key, family in families.items():
                family.add_metric([role], cache.get(key, 0))
            cached.add_metric([role], cache.get("cached_blocks", 0))
        yield from (*families.values(), cached)

    def _link(self) -> Iterator[Metric]:
        prefill, decode = self.statuses["prefill"], self.statuses["decode"]
        links = prefill.links if prefill is not None else []
        link = links[0] if links else None
        state = GaugeMetricFamily("pdkv_link_up", "1 when a link of the prefill to a decode is up")
        state.add_metric([], 1.0 if any(lk.get("state") == "up" for lk in links) else 0.0)
        yield state
        if links:
            each = GaugeMetricFamily(
                "pdkv_decode_link_up",
                "1 when the prefill's link to this decode is up",
                labels=["decode"],
            )
            handed = GaugeMetricFamily(
                "pdkv_decode_requests",
                "requests the prefill has handed to this decode",
                labels=["decode"],
            )
            for lk in links:
                name = str(lk.get("decode", lk.get("link", "")))
                each.add_metric([name], 1.0 if lk.get("state") == "up" else 0.0)
                handed.add_metric([name], float(lk.get("requests", 0)))
            yield from (each, handed)
        if link is not None:
            reconnects = CounterMetricFamily(
                "pdkv_link_reconnects", "times the prefill re-established its link to decode"
            )
            reconnects.add_metric([], max(int(link.get("connects", 0)) - 1, 0))
            rtt = GaugeMetricFamily("pdkv_link_rtt_seconds", "last PING round trip")
            rtt.add_metric([], float(link.get("rtt_us", 0.0)) / 1e6)
            yield from (reconnects, rtt)
        if decode is not None:
            links = GaugeMetricFamily("pdkv_decode_links", "prefill links the decode daemon holds")
            links.add_metric([], len(decode.links))
            yield links


class Metrics:
    """Every metric of one API server, in its own registry (tests run several in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdkv_api_requests",
            "HTTP generation requests by endpoint and outcome (ok, bad_request, unauthorized, "
            "no_capacity, unavailable, timeout, client_disconnect, error)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdkv_api_time_to_first_token_seconds",
            "request arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "pdkv_api_inter_token_latency_seconds",
            "time between tokens",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "pdkv_api_request_duration_seconds",
            "request arrival to its last byte",
            buckets=_DURATION,
            registry=r,
        )
        self.handoff = Histogram(
            "pdkv_handoff_seconds",
            "prefill HANDOFF sent to RELEASE received",
            buckets=_HANDOFF,
            registry=r,
        )
        self.tokens = Counter("pdkv_api_tokens", "tokens by kind", ["kind"], registry=r)
        self.inflight = Gauge(
            "pdkv_api_requests_in_flight", "requests the API is serving", registry=r
        )
        self.daemons = DaemonCollector()
        r.register(self.daemons)

    def finished(self, endpoint: str, outcome: str, seconds: float | None = None) -> None:
        """Count one request's outcome (once per request); `seconds` when it completed."""
        self.requests.labels(endpoint, outcome).inc()
        if seconds is not None:
            self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
