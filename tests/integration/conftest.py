"""Fixtures: one API server per test session, one namespace and operator per test."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sdc_harness.cluster import Cluster, ForkedOperatorProcess, OperatorProcess
from sdc_harness.fake_sagemaker import FakeSageMaker

from .previous_release import Release, extract


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = Cluster(tmp_path_factory.mktemp("apiserver"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release's operator, from the repository's history
    (tests/integration/previous_release.py); the test is skipped where that is missing."""
    found = extract(tmp_path_factory.mktemp("previous-release"))
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture
def sagemaker() -> Iterator[FakeSageMaker]:
    """The loopback SageMaker endpoint; the test fails if the operator sent it a request
    botocore's model refuses."""
    fake = FakeSageMaker()
    yield fake
    fake.stop()
    assert fake.invalid == [], "the operator sent a request the SageMaker model refuses"


@pytest.fixture
def namespace(cluster: Cluster) -> str:
    return cluster.namespace()


@pytest.fixture
def start_operator(
    cluster: Cluster, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., OperatorProcess]]:
    """Starts ``python -m sdc_operator`` with extra settings (``dry_run="true"``, ...);
    every process started is stopped after the test, and its log shown if it failed. The
    operator is forked from the zygote that imported its dependencies once
    (:mod:`sdc_harness.operator_zygote`) unless ``forked=False`` (a test of its memory)."""
    started: list[OperatorProcess] = []

    def start(forked: bool = True, **settings: Any) -> OperatorProcess:
        kind = ForkedOperatorProcess if forked else OperatorProcess
        proc = kind(cluster, namespace, tmp_path / f"operator-{len(started)}.log", **settings)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for proc in started:
            print(f"--- {proc.log_path}\n{proc.log()[-6000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
