"""Prometheus metrics: what the API sees of its requests, and both daemons' STATUS.

Per request (measured at the HTTP layer, from the request's arrival): outcomes by endpoint, time
to first token, inter-token latency (per token), end-to-end duration, the prefill's handoff
latency (its FINISH timing `handoff_us`), token counts and requests in flight. Per daemon, read
from STATUS_REPLY at each scrape: up, pool blocks (total, used, free, cached, owned, leased),
requests in flight, the prefix cache's counters (queried and hit tokens, evictions) and cached
blocks, and the prefill's link state, round trip and reconnects (`connects` − 1).

Every series carries `pdkv_instance`: the daemon's own name (its `--instance`, sent in
STATUS_REPLY's `instance`) on a daemon's series, the API's `--instance` on the API's. Not
`instance`: Prometheus sets that label to the scrape target (this API's host:port) and, unless
the job has honor_labels, renames an exposed `instance` to `exported_instance`; one API exposes
several daemons, so their names need a label of their own (docs/operations.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.protocol import StatusReply

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DURATION = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
INSTANCE_LABEL = "pdkv_instance"
#: per decode link of the prefill: (metric, help, its value from the prefill's STATUS link entry;
#: None: no sample, as for a decode that has not reported its load on a heartbeat yet)
_PER_DECODE: tuple[tuple[str, str, Callable[[dict], float | None]], ...] = (
    (
        "pdkv_decode_link_up",
        "1 when the prefill's link to this decode is up",
        lambda lk: 1.0 if lk.get("state") == "up" else 0.0,
    ),
    (
        "pdkv_decode_requests",
        "requests the prefill has handed to this decode",
        lambda lk: float(lk.get("requests", 0)),
    ),
    (
        "pdkv_decode_sequences",
        "sequences this decode last reported (PONG), every prefill's",
        lambda lk: _reported(lk, "decode_sequences"),
    ),
    (
        "pdkv_decode_free_blocks",
        "free KV blocks this decode last reported (PONG)",
        lambda lk: _reported(lk, "decode_free_blocks"),
    ),
)


def _reported(link: dict, key: str) -> float | None:
    """A load figure of the decode's last PONG, None before its first (free blocks -1)."""
    return None if link.get("decode_free_blocks", -1) < 0 else float(link.get(key, 0))


_HANDOFF = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class DaemonCollector(Collector):
    """Gauges from the last STATUS_REPLY of each daemon (None: it did not answer), each series
    labelled with the daemon's instance name (the last one it reported; before any, the name the
    API gives it: prefill, prefill@PATH, decode)."""

    def __init__(self) -> None:
        self.statuses: dict[str, StatusReply | None] = {"prefill": None, "decode": None}
        self._names: dict[str, str] = {}

    def instance(self, role: str) -> str:
        """The `pdkv_instance` of the daemon the API calls `role`."""
        st = self.statuses.get(role)
        if st is not None and st.instance:
            self._names[role] = st.instance
        return self._names.get(role, role)

    def collect(self) -> Iterator[Metric]:
        labels = ["role", INSTANCE_LABEL]
        up = GaugeMetricFamily("pdkv_daemon_up", "1 when the daemon answers STATUS", labels=labels)
        blocks = GaugeMetricFamily(
            "pdkv_pool_blocks", "KV pool blocks by state", labels=[*labels, "state"]
        )
        inflight = GaugeMetricFamily(
            "pdkv_daemon_requests_in_flight", "requests the daemon holds", labels=labels
        )
        for role, st in self.statuses.items():
            who = [role, self.instance(role)]
            up.add_metric(who, 0.0 if st is None else 1.0)
            if st is None:
                continue
            pool = dict(st.pool)
            pool["used"] = pool.get("total", 0) - pool.get("free", 0)
            for state, n in pool.items():
                blocks.add_metric([*who, state], n)
            inflight.add_metric(who, st.inflight)
        yield from (up, blocks, inflight)
        yield from self._prefix_cache()
        yield from self._host_tier()
        yield from self._link()

    def _prefix_cache(self) -> Iterator[Metric]:
        """The prefix cache's counters, from STATUS_REPLY's `prefix_cache` of each daemon."""
        counters = {
            "queried_tokens": "prompt tokens looked up in the prefix cache",
            "hit_tokens": "prompt tokens whose KV came from the prefix cache",
            "evictions": "cached blocks evicted to make room",
            "pulled_blocks": "blocks the decode's pulls copied (those its cache lacked)",
        }
        labels = ["role", INSTANCE_LABEL]
        families = {
            key: CounterMetricFamily(f"pdkv_prefix_cache_{key}", text, labels=labels)
            for key, text in counters.items()
        }
        cached = GaugeMetricFamily(
            "pdkv_prefix_cache_blocks", "blocks holding cached KV (free ones only)", labels=labels
        )
        for role, st in self.statuses.items():
            cache = st.prefix_cache if st is not None else {}
            if not cache.get("enabled"):
                continue
            who = [role, self.instance(role)]
            for key, family in families.items():
                family.add_metric(who, cache.get(key, 0))
            cached.add_metric(who, cache.get("cached_blocks", 0))
        yield from (*families.values(), cached)

    def _host_tier(self) -> Iterator[Metric]:
        """The host KV tier's counters (`host_tier_*` in STATUS_REPLY's `prefix_cache`): this
        daemon's reads and writes, and the tier's size and occupancy (shared by the host)."""
        counters = {
            "hits": "blocks read from the host tier whole",
            "misses": "lookups that stopped at a block the host tier lacks",
            "checksum_failures": "host tier reads whose checksum failed (recomputed)",
            "stale": "host tier reads whose slot was rewritten meanwhile (recomputed)",
            "stored": "blocks this daemon wrote into the host tier",
            "bytes_read": "bytes copied from the host tier into the pool",
            "bytes_written": "bytes copied from the pool into the host tier",
            "evictions": "blocks evicted from the host tier (all daemons)",
        }
        gauges = {
            "capacity_bytes": "host tier size in bytes",
            "used": "host tier slots holding a block",
            "slots": "host tier slots",
        }
        labels = ["role", INSTANCE_LABEL]
        families: dict[str, Metric] = {
            key: CounterMetricFamily(f"pdkv_host_tier_{key}", text, labels=labels)
            for key, text in counters.items()
        }
        families |= {
            key: GaugeMetricFamily(f"pdkv_host_tier_{key}", text, labels=labels)
            for key, text in gauges.items()
        }
        for role, st in self.statuses.items():
            cache = st.prefix_cache if st is not None else {}
            if not cache.get("host_tier_enabled"):
                continue
            for key, family in families.items():
                family.add_metric([role, self.instance(role)], cache.get(f"host_tier_{key}", 0))
        yield from families.values()

    def _link(self) -> Iterator[Metric]:
        """The first prefill's links (labelled with its instance) and the decode's link count."""
        prefill, decode = self.statuses["prefill"], self.statuses["decode"]
        links = prefill.links if prefill is not None else []
        link = links[0] if links else None
        mine = [self.instance("prefill")]
        state = GaugeMetricFamily(
            "pdkv_link_up",
            "1 when a link of the prefill to a decode is up",
            labels=[INSTANCE_LABEL],
        )
        state.add_metric(mine, 1.0 if any(lk.get("state") == "up" for lk in links) else 0.0)
        yield state
        if links:
            families = [
                (GaugeMetricFamily(n, h, labels=[INSTANCE_LABEL, "decode"]), value)
                for n, h, value in _PER_DECODE
            ]
            for lk in links:
                name = str(lk.get("decode", lk.get("link", "")))
                for family, value in families:
                    if (v := value(lk)) is not None:
                        family.add_metric([*mine, name], v)
            yield from (family for family, _ in families)
        if link is not None:
            reconnects = CounterMetricFamily(
                "pdkv_link_reconnects",
                "times the prefill re-established its link to decode",
                labels=[INSTANCE_LABEL],
            )
            reconnects.add_metric(mine, max(int(link.get("connects", 0)) - 1, 0))
            rtt = GaugeMetricFamily(
                "pdkv_link_rtt_seconds", "last PING round trip", labels=[INSTANCE_LABEL]
            )
            rtt.add_metric(mine, float(link.get("rtt_us", 0.0)) / 1e6)
            yield from (reconnects, rtt)
        if decode is not None:
            count = GaugeMetricFamily(
                "pdkv_decode_links",
                "prefill links the decode daemon holds",
                labels=[INSTANCE_LABEL],
            )
            count.add_metric([self.instance("decode")], len(decode.links))
            yield count


class Labelled(Collector):
    """Every series of `registry` with `pdkv_instance` = `instance` added (the API's own)."""

    def __init__(self, registry: CollectorRegistry, instance: str) -> None:
        self.registry = registry
        self.instance = instance

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [
                s._replace(labels={INSTANCE_LABEL: self.instance, **s.labels})
                for s in family.samples
            ]
            yield family


class Metrics:
    """Every metric of one API server, in its own registry (tests run several in one process)."""

    def __init__(self, instance: str = "api", shared: Path | None = None) -> None:
        """`shared`: the directory where every worker of one API keeps its series
        (api_server/workers.py); they are then exposed summed over the workers."""
        r = CollectorRegistry()  # the API's own series, labelled with `instance` when exposed
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
            "prefill KV offered (KV_READY, or a late HANDOFF) to RELEASE received",
            buckets=_HANDOFF,
            registry=r,
        )
        self.tool_requests = Counter(
            "pdkv_api_tool_requests",
            "chat requests that offer tools, by tool_choice (none, auto, required, named)",
            ["tool_choice"],
            registry=r,
        )
        self.tokens = Counter("pdkv_api_tokens", "tokens by kind", ["kind"], registry=r)
        self.structured = Counter(
            "pdkv_api_structured_requests",
            "requests whose output is constrained (response_format, guided_*), by kind "
            "(json_object, json_schema, regex, choice, grammar)",
            ["kind"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "pdkv_api_grammar_compile_seconds",
            "compiles of a grammar the API's cache did not hold (schema to token masks)",
            buckets=_LATENCY,
            registry=r,
        )
        self.inflight = Gauge(
            "pdkv_api_requests_in_flight",
            "requests the API is serving",
            registry=r,
            multiprocess_mode="livesum",  # with workers: the live ones' sum
        )
        self.daemons = DaemonCollector()
        self.registry = CollectorRegistry()
        if shared is not None:  # every worker's files, read at each scrape
            r = CollectorRegistry()
            multiprocess.MultiProcessCollector(r, path=str(shared))
        self.registry.register(Labelled(r, instance))
        self.registry.register(self.daemons)

    def finished(self, endpoint: str, outcome: str, seconds: float | None = None) -> None:
        """Count one request's outcome (once per request); `seconds` when it completed."""
        self.requests.labels(endpoint, outcome).inc()
        if seconds is not None:
            self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
