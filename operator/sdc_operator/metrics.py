"""Prometheus metrics (prefix ``hyperpod_sdc_``), on the intake's ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


class Metrics:
    """One registry per operator (tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reports = Counter(
            "hyperpod_sdc_reports",
            "Reports accepted, by kind and, for verdicts, classification.",
            ["kind", "verdict"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "hyperpod_sdc_refusals",
            "Reports refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.incidents = Counter(
            "hyperpod_sdc_incidents",
            "SDCIncidents created, by check and classification.",
            ["check", "classification"],
            registry=self.registry,
        )
        self.actions = Counter(
            "hyperpod_sdc_actions",
            "Containment actions, by action and result.",
            ["action", "result"],
            registry=self.registry,
        )
        self.quarantined_nodes = Gauge(
            "hyperpod_sdc_quarantined_nodes",
            "Nodes carrying the hyperpod-sdc.dev/suspect label.",
            registry=self.registry,
        )
        self.report_to_contained = Histogram(
            "hyperpod_sdc_report_to_contained_seconds",
            "From the report that completed agreement to the incident contained.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
