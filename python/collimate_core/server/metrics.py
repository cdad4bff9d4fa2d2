"""Prometheus metrics of one server (/metrics), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


_LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1, 2, 4, 8)


class _Metrics:
    """Prometheus metrics of one server, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.fork_seconds = Histogram(
            "collimate_fork_seconds", "Engine time to clone a sandbox from a template (kind=clone) or to fork a "
            "live sandbox into a group (kind=fork)", ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.exec_seconds = Histogram("collimate_exec_seconds", "Wall time of execs", buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram(
            "collimate_request_seconds", "HTTP request latency by route", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("collimate_requests", "HTTP requests", ["method", "route", "status"], registry=r)
        self.created = Counter("collimate_sandboxes_created", "Sandboxes created", ["kind"], registry=r)
        self.destroyed = Counter("collimate_sandboxes_destroyed", "Sandboxes destroyed", ["reason"], registry=r)
        self.execs = Counter("collimate_execs", "Execs run", registry=r)
        self.queued = Counter("collimate_capacity_queued", "Requests that waited in the capacity queue", registry=r)
        self.rejected = Counter(
            "collimate_capacity_rejections", "Requests refused for capacity or spend", ["reason"], registry=r)
        self.auth_failures = Counter("collimate_auth_failures", "Requests with a missing or wrong API key", registry=r)
        self.live = Gauge("collimate_live_sandboxes", "Live sandboxes (admission slots in use)", registry=r)
        self.queue_depth = Gauge("collimate_queue_depth", "Requests waiting for capacity", registry=r)
        self.max_sandboxes = Gauge("collimate_max_sandboxes", "The live sandbox limit", registry=r)
