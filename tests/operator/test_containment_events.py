"""The containment's Events are posted beside it, not in its path: the job's stop, the
node's quarantine and the incident's ``Contained`` do not wait for an Event's API call
(each was one more call in turn on the way to containment; docs/operator.md, "The
engine's own thread"). Each Event is still posted, once."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from sdc_operator.engine import IncidentEngine
from sdc_operator.incidents import Action, Rules
from sdc_operator.metrics import Metrics
from sdc_operator.settings import OperatorSettings

JOB_API, JOB_KIND = "kubeflow.org/v1", "PyTorchJob"


def job() -> dict[str, Any]:
    return {
        "apiVersion": JOB_API,
        "kind": JOB_KIND,
        "metadata": {"namespace": "ml", "name": "llama", "uid": "job-1"},
        "spec": {"runPolicy": {"suspend": False}},
    }


def incident() -> dict[str, Any]:
    return {
        "apiVersion": "hyperpod-sdc.dev/v1alpha1",
        "kind": "SDCIncident",
        "metadata": {"namespace": "ml", "name": "llama-15-1", "resourceVersion": "1"},
        "spec": {"job": {"apiVersion": JOB_API, "kind": JOB_KIND, "name": "llama", "uid": "job-1"}},
        "status": {"phase": "Detected"},
    }


class Group:
    def __init__(self, *items: dict[str, Any]) -> None:
        self.items = {(i["metadata"]["namespace"], i["metadata"]["name"]): i for i in items}

    def get(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.items.get((namespace or "", name))

    def upsert(self, item: dict[str, Any]) -> None:
        self.items[(item["metadata"]["namespace"], item["metadata"]["name"])] = item


class Caches:
    def __init__(self) -> None:
        self.incidents = Group(incident())
        self.jobs = {(JOB_API, JOB_KIND): Group(job())}

    def job(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.jobs[(api_version, kind)].get(namespace, name)


class Kube:
    """The API server: writes answer at once; an Event's post waits for ``events_go``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.events: list[str] = []
        self.events_go = asyncio.Event()
        self.event_asked = asyncio.Event()

    async def replace_incident_status(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"status {body['status'].get('phase')}")
        return copy.deepcopy(body)

    async def patch_object(self, api_version: str, plural: str, namespace: str, name: str,
                           patch: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        self.calls.append(f"patch {plural}")
        written = job()
        written["spec"]["runPolicy"].update(patch["spec"]["runPolicy"])
        return written

    async def emit_event(self, obj: dict[str, Any], reason: str, message: str, **_: Any) -> None:
        self.calls.append(f"event {reason}")
        self.event_asked.set()
        await self.events_go.wait()
        self.events.append(reason)


def engine_with(kube: Kube) -> IncidentEngine:
    fake: Any = Caches()
    api: Any = kube
    engine = IncidentEngine(OperatorSettings(), Metrics(), fake, records=api, containment=api)
    engine.leader = True
    engine.refresh_quarantined = lambda: None  # type: ignore[method-assign]
    return engine


async def first_of(step: asyncio.Task[Any], kube: Kube) -> bool:
    """Whether ``step`` ended before it, or anything beside it, waited for an Event."""
    asked = asyncio.ensure_future(kube.event_asked.wait())
    await asyncio.wait({step, asked}, return_when=asyncio.FIRST_COMPLETED)
    for _ in range(3):  # what ``step`` still had to do after the Event's post began
        await asyncio.sleep(0)
    ended = step.done()
    kube.events_go.set()
    await step
    await asked
    return ended


def test_the_incident_is_contained_while_its_event_is_still_being_posted() -> None:
    async def go() -> tuple[bool, Kube]:
        kube = Kube()
        engine = engine_with(kube)
        summary = ("Contained", "True", "Quarantined", "job stopped; node node-b cordoned")
        step = asyncio.ensure_future(engine._contain(("ml", "llama-15-1"), summary))
        ended = await first_of(step, kube)
        for task in list(engine._background):
            await task
        return ended, kube

    ended, kube = asyncio.run(go())
    assert ended, "Contained waited for its Event"
    assert kube.calls == ["status Contained", "event Contained"]
    assert kube.events == ["Contained"]


def test_the_job_is_stopped_while_its_event_is_still_being_posted() -> None:
    async def go() -> tuple[bool, str, Kube]:
        kube = Kube()
        engine = engine_with(kube)
        action = Action("suspend-job", "PyTorchJob ml/llama")
        step = asyncio.ensure_future(engine.actions.take(incident(), action, Rules()))
        ended = await first_of(step, kube)
        outcome = step.result()
        for task in list(engine._background):
            await task
        return ended, outcome.result, kube

    ended, result, kube = asyncio.run(go())
    assert ended, "the job's stop waited for its Event"
    assert result == "Succeeded"
    assert kube.calls == ["patch pytorchjobs", "event SDCJobSuspended"]
    assert kube.events == ["SDCJobSuspended"]
