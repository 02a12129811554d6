"""The intake resolves a verdict's suspect from the pod cache, and reads the suspect's pod
again from the API server before refusing the report on what the cache says (the REST
client, the intake's own collaborator, is scripted here)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from sdc_agent.protocol import ReporterIdentity, Suspect, VerdictReport
from sdc_operator.caches import Caches
from sdc_operator.errors import ApiError, Refusal
from sdc_operator.incidents import JobRef
from sdc_operator.intake import Intake
from sdc_operator.metrics import Metrics
from sdc_operator.settings import OperatorSettings

JOB = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "train", "job-uid")


def _pod(node: str, phase: str, version: int, owner: str = "job-uid") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ml",
            "name": "train-worker-0",
            "uid": "pod-uid",
            "resourceVersion": str(version),
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": "train",
                    "uid": owner,
                    "controller": True,
                }
            ],
        },
        "spec": {"nodeName": node},
        "status": {"phase": phase},
    }


class _ApiServer:
    def __init__(self, pod: dict[str, Any] | None) -> None:
        self.pod = pod
        self.reads = 0

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        if self.pod is None:
            raise ApiError(404, "not found")
        return self.pod


def _resolve(cached: dict[str, Any] | None, served: dict[str, Any] | None) -> Any:
    api = _ApiServer(served)
    caches = Caches(api, ["ml"])  # type: ignore[arg-type]
    if cached is not None:
        caches.pods.upsert(cached)
    settings = dataclasses.replace(OperatorSettings.from_env({}), require_attestation=False)
    intake = Intake(
        settings,
        caches,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Metrics(),
        None,
        api,  # type: ignore[arg-type]
    )
    report = VerdictReport(
        reporter=ReporterIdentity(0, "node-0", "train-master-0"),
        sent_at=0.0,
        check="replay",
        classification="rank",
        step=15,
        last_clean_step=10,
        localized=True,
        transient=False,
        suspects=(Suspect(3, "node-1", 1, "train-worker-0"),),
        message="rank 3 computed wrong results",
        evidence={},
    )

    async def go() -> Any:
        return await intake._resolve_suspects(report, JOB)

    try:
        return asyncio.run(go()), api.reads
    except Refusal as refusal:
        return refusal, api.reads


@pytest.mark.parametrize(
    ("why", "cached"),
    [
        ("the cache lacks the pod", None),
        ("the cache has it on no node yet", _pod("", "Pending", 5)),
        ("the cache has it not yet running", _pod("node-1", "Pending", 5)),
    ],
)
def test_a_suspect_the_cache_is_behind_on_is_read_again(why: str, cached: Any) -> None:
    resolved, reads = _resolve(cached, _pod("node-1", "Running", 7))
    assert not isinstance(resolved, Refusal), f"{why}: {resolved}"
    assert [(s.pod, s.node) for s in resolved] == [("train-worker-0", "node-1")], why
    assert reads == 1, why


def test_a_suspect_the_api_server_agrees_is_wrong_is_refused() -> None:
    """The re-read shows the same: refused (422, the agent does not retry), and a pod of
    another job is never taken for the suspect's."""
    for served in (_pod("node-1", "Pending", 7), _pod("node-1", "Running", 7, "other"), None):
        refusal, reads = _resolve(None, served)
        assert isinstance(refusal, Refusal) and refusal.status == 422, served
        assert reads == 1


def test_a_suspect_the_cache_resolves_costs_no_read() -> None:
    resolved, reads = _resolve(_pod("node-1", "Running", 5), None)
    assert [s.node for s in resolved] == ["node-1"] and reads == 0


def test_the_in_flight_gauge_reads_both_listeners_count_when_scraped() -> None:
    """The main port's intake and the verdict port's (two threads) share one count of the
    reports in flight; the gauge is read from it when scraped, not set by whichever thread
    set it last."""
    metrics = Metrics()
    settings = OperatorSettings.from_env({})
    main = Intake(settings, None, None, None, None, None, metrics, None, None)  # type: ignore[arg-type]
    verdicts = main.for_verdicts(None, None)  # type: ignore[arg-type]

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("hyperpod_sdc_reports_in_flight")

    assert main.in_flight.enter(10) == 1
    assert verdicts.in_flight.enter(10) == 2
    assert gauge() == 2
    main.in_flight.leave(None)
    assert gauge() == 1
    verdicts.in_flight.leave(None)
    assert gauge() == 0
