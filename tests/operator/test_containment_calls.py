"""The calls in turn from agreement to containment (docs/operator.md, "Exactly once"):
the job's stop and the node's quarantine have their intents recorded in one status write
before either is taken, are taken in their order, and have their results recorded in one
write with the incident's containment: 4 calls, where one action at a time made 7
(intent, effect, result per action, then ``Contained``), each waiting for the one before.
The records
are the same either way; what a crash or a conflict between them leaves is verified as
before (tests/integration/test_restart.py, test_exactly_once.py)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from sdc_operator import incidents
from sdc_operator.engine import IncidentEngine
from sdc_operator.errors import ApiError
from sdc_operator.incidents import Rules
from sdc_operator.metrics import Metrics
from sdc_operator.settings import OperatorSettings

from .test_containment_events import Group, job
from .test_incidents import fold

KEY = ("ml", "llama-15-1")
JOB = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob"}


def agreed() -> dict[str, Any]:
    """Two nodes agree that node ``b`` computed wrong: stop the job, quarantine ``b``."""
    return {
        "apiVersion": "hyperpod-sdc.dev/v1alpha1",
        "kind": "SDCIncident",
        "metadata": {"namespace": "ml", "name": KEY[1], "uid": "inc-1", "resourceVersion": "1"},
        "spec": {"job": {**JOB, "name": "llama", "uid": "job-1"}},
        "status": fold(fold({}, "a"), "c"),
    }


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": "", "name": name, "resourceVersion": "1"}, "spec": {}}


def merged(into: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386), as the API server applies it."""
    out = copy.deepcopy(into)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Cache(Group):
    def values(self) -> list[dict[str, Any]]:
        return list(self.items.values())

    def forget(self, item: dict[str, Any]) -> None:
        self.items.pop((item["metadata"]["namespace"], item["metadata"]["name"]), None)


class Caches:
    def __init__(self) -> None:
        self.incidents = Cache(agreed())
        self.jobs = {(JOB["apiVersion"], JOB["kind"]): Cache(job())}
        self.nodes = Cache(*(node(n) for n in "abc"))

    def job(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.jobs[(api_version, kind)].get(namespace, name)


class Containment:
    """The API server as the containment's pool sees it: each call takes a few turns of
    the loop; a call that starts while none is in flight begins a new turn."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.turns = 0
        self.in_flight = 0
        self.contained = lambda: None
        """Called once ``Contained`` is written: the test ends there (the job's restart,
        which follows, is not containment's)."""

    async def _call(self, what: str) -> None:
        if self.in_flight == 0:
            self.turns += 1
        self.in_flight += 1
        self.calls.append(what)
        for _ in range(3):
            await asyncio.sleep(0)
        self.in_flight -= 1

    async def replace_incident_status(self, body: dict[str, Any]) -> dict[str, Any]:
        status = body["status"]
        pending = sum(a.get("result") == incidents.PENDING for a in status.get("actions") or [])
        await self._call(f"status {status.get('phase')}, {pending} pending")
        written = copy.deepcopy(body)
        version = int(written["metadata"]["resourceVersion"]) + 1
        written["metadata"]["resourceVersion"] = str(version)
        if status.get("phase") == "Contained":
            self.contained()
        return written

    async def patch_object(self, api_version: str, plural: str, namespace: str, name: str,
                           patch: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        await self._call(f"patch {plural}")
        return merged(job(), patch)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        await self._call("patch node")
        return merged(node(name), patch)


class Records:
    """The records' pool: the Events, posted beside the containment (not counted)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def emit_event(self, obj: dict[str, Any], reason: str, message: str, **_: Any) -> None:
        self.events.append(reason)


def leading_engine(containment: Containment, records: Records, fake: Any) -> IncidentEngine:
    """The leader's engine over these fakes, with the default rules."""
    api: Any = (containment, records)
    engine = IncidentEngine(OperatorSettings(), Metrics(), fake, records=api[1], containment=api[0])
    engine.leader = True
    engine.rules_for = lambda namespace: Rules()  # type: ignore[method-assign]
    engine.refresh_quarantined = lambda: None  # type: ignore[method-assign]
    return engine


def contain(together: bool) -> tuple[Containment, Records, dict[str, Any]]:
    async def go() -> tuple[Containment, Records, dict[str, Any]]:
        containment, records = Containment(), Records()
        fake: Any = Caches()
        engine = leading_engine(containment, records, fake)
        containment.contained = lambda: setattr(engine, "leader", False)
        await engine.reconcile(*KEY)
        for task in list(engine._background):
            await task
        incident = fake.incidents.get(*KEY)
        return containment, records, incident

    if together:
        return asyncio.run(go())
    with pytest.MonkeyPatch.context() as patch:  # one action at a time, as before
        patch.setattr(incidents, "actions_together", lambda incident, rules, first: [first])
        return asyncio.run(go())


def test_the_stop_and_the_quarantine_are_recorded_and_taken_together() -> None:
    before, said_before, was = contain(together=False)
    after, said, now = contain(together=True)
    print(f"\nbefore: {len(before.calls)} calls in {before.turns} turns: {before.calls}")
    print(f"after: {len(after.calls)} calls in {after.turns} turns: {after.calls}")
    assert before.calls == [
        "status Detected, 1 pending",  # the stop's intent
        "patch pytorchjobs",
        "status Detected, 0 pending",  # its result
        "status Detected, 1 pending",  # the quarantine's intent
        "patch node",
        "status Detected, 0 pending",
        "status Contained, 0 pending",
    ]
    assert before.turns == 7
    # both intents before either action; both results with the containment
    assert after.calls == [
        "status Detected, 2 pending",
        "patch pytorchjobs",
        "patch node",
        "status Contained, 0 pending",
    ]
    assert after.turns == 4
    # the same records, the same Events
    for incident in (was, now):
        status = incident["status"]
        assert [(a["action"], a["target"], a["result"]) for a in status["actions"]] == [
            ("suspend-job", "PyTorchJob ml/llama", "Succeeded"),
            ("quarantine-node", "b", "Succeeded"),
        ]
        assert all(a["intent"] for a in status["actions"])
        contained = next(c for c in status["conditions"] if c["type"] == "Contained")
        assert (status["phase"], contained["reason"]) == ("Contained", "NodeQuarantined")
    assert sorted(said.events) == sorted(said_before.events)
    assert {"SDCJobSuspended", "SDCNodeQuarantined", "Contained"} <= set(said.events)


def test_an_action_started_before_is_verified_alone_first() -> None:
    """A stop recorded ``Pending`` (a crash after its intent) is verified on its own, then
    the quarantine follows; nothing is recorded or taken twice."""
    status = agreed()["status"]
    status = incidents.record_intent(
        status, incidents.next_action(agreed(), Rules()) or incidents.Action("", ""),
        {"job": "job-1"}, "2026-11-29T00:00:00Z",
    )  # fmt: skip
    incident = {**agreed(), "status": status}
    first = incidents.next_action(incident, Rules())
    assert first is not None and first.action == "suspend-job"
    assert incidents.actions_together(incident, Rules(), first) == [first]
    done = incidents.record_action(status, first, "Succeeded", "ok", "2026-11-29T00:00:01Z")
    then = {**agreed(), "status": done}
    following = incidents.next_action(then, Rules())
    assert following == incidents.Action("quarantine-node", "b")
    assert incidents.actions_together(then, Rules(), following) == [following]


def test_a_stop_that_fails_is_verified_alone_and_the_quarantine_is_not_taken_again() -> None:
    """The job's stop fails (the API server answers 500) while the quarantine succeeds: the
    quarantine's result is written, the stop stays ``Pending`` and the error is raised (the
    reconcile is retried); the retry verifies the stop alone and takes it, once more, and
    the node is patched once in all."""

    async def go() -> tuple[Containment, dict[str, Any], list[str]]:
        containment, records = Containment(), Records()
        fake: Any = Caches()
        engine = leading_engine(containment, records, fake)
        engine._later = lambda key, delay: None  # type: ignore[method-assign]
        patch_job = containment.patch_object
        fails = [ApiError(500, "etcd is slow")]

        async def failing(*args: Any) -> dict[str, Any]:
            if fails:
                await containment._call("patch pytorchjobs: 500")
                raise fails.pop()
            return await patch_job(*args)

        containment.patch_object = failing  # type: ignore[method-assign,assignment]
        with pytest.raises(ApiError):
            await engine.reconcile(*KEY)
        between = [
            (a["action"], a["result"]) for a in fake.incidents.get(*KEY)["status"]["actions"]
        ]
        assert between == [("suspend-job", "Pending"), ("quarantine-node", "Succeeded")]
        containment.contained = lambda: setattr(engine, "leader", False)
        await engine.reconcile(*KEY)
        for task in list(engine._background):
            await task
        return containment, fake.incidents.get(*KEY), records.events

    containment, incident, events = asyncio.run(go())
    assert containment.calls[:4] == [
        "status Detected, 2 pending",
        "patch pytorchjobs: 500",
        "patch node",
        "status Detected, 1 pending",  # the quarantine's result; the stop still Pending
    ]
    assert containment.calls.count("patch node") == 1
    assert containment.calls.count("patch pytorchjobs") == 1
    status = incident["status"]
    assert [(a["action"], a["result"]) for a in status["actions"]] == [
        ("suspend-job", "Succeeded"),
        ("quarantine-node", "Succeeded"),
    ]
    assert status["phase"] == "Contained"
    assert events.count("SDCNodeQuarantined") == 1 and events.count("SDCJobSuspended") == 1
