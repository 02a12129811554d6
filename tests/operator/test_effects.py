"""The effects layer's writes that carry no status entry: each knows what already happened
by looking (an Event posted twice is one Event, a ConfigMap is written only where it
differs, a create that lost a race reads the winner, a delete says what it found)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from prometheus_client import CollectorRegistry

from sdc_operator.caches import Caches
from sdc_operator.effects import Effects, event_name
from sdc_operator.errors import ApiError
from sdc_operator.jobwatch import JobWatch


class FakeKube:
    """The API server's answers for the few calls the effects make, by (plural, ns, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.version = 0
        self.race: dict[str, Any] | None = None  # made by "another replica" on next create

    def _stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        stored["metadata"].setdefault("uid", f"uid-{self.version}")
        return stored

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        self.calls.append(("get", plural))
        try:
            return self.objects[(plural, namespace, name)]
        except KeyError:
            raise ApiError(404, "not found") from None

    async def create(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        body: dict[str, Any],
        *,
        dry_run: bool = False,
    ) -> Any:
        self.calls.append(("create", plural))
        key = (plural, namespace, body["metadata"]["name"])
        if self.race is not None:
            self.objects[key], self.race = self._stamp(self.race), None
        if key in self.objects:
            raise ApiError(409, "already exists")
        self.objects[key] = self._stamp(body)
        return self.objects[key]

    async def replace(
        self, api_version: str, plural: str, namespace: str | None, body: dict[str, Any]
    ) -> Any:
        self.calls.append(("replace", plural))
        key = (plural, namespace, body["metadata"]["name"])
        if self.objects[key]["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]:
            raise ApiError(409, "conflict")
        self.objects[key] = self._stamp(body)
        return self.objects[key]

    async def delete(
        self, api_version: str, plural: str, namespace: str | None, name: str, *, uid: Any = None
    ) -> Any:
        self.calls.append(("delete", plural))
        key = (plural, namespace, name)
        if key not in self.objects:
            raise ApiError(404, "not found")
        if uid and self.objects[key]["metadata"]["uid"] != uid:
            raise ApiError(409, "precondition failed: uid")
        return self.objects.pop(key)

    async def emit_event(
        self, obj: dict[str, Any], reason: str, message: str, *, warning: bool, name: str
    ) -> Any:
        meta = obj["metadata"]
        body: dict[str, Any] = {
            "metadata": {"name": name, "namespace": meta.get("namespace") or "default"},
            "involvedObject": {"uid": meta.get("uid"), "name": meta.get("name")},
            "reason": reason,
            "message": message,
        }
        return await self.create("v1", "events", body["metadata"]["namespace"], body)

    async def get_object(self, api_version: str, plural: str, namespace: str, name: str) -> Any:
        return await self.get(api_version, plural, namespace, name)

    async def patch_object(
        self, api_version: str, plural: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> Any:
        self.calls.append(("patch", plural))
        stored = self.objects[(plural, namespace, name)]
        stored["spec"]["runPolicy"] |= patch["spec"]["runPolicy"]
        return self._stamp(stored)

    async def list_all(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("list", "pods"))
        return []

    def events(self) -> list[dict[str, Any]]:
        return [v for (plural, _, _), v in self.objects.items() if plural == "events"]


def effects_on(kube: FakeKube) -> tuple[Effects, Caches]:
    caches = Caches(kube, ["team-a"])  # type: ignore[arg-type]
    return Effects(kube, caches), caches  # type: ignore[arg-type]


JOB: dict[str, Any] = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {"name": "train", "namespace": "team-a", "uid": "job-uid"},
}


def test_an_event_names_what_it_says() -> None:
    name = event_name(JOB, "SDCJobSuspended", "stopped")
    assert name == event_name(JOB, "SDCJobSuspended", "stopped")
    assert re.fullmatch(r"train\.[0-9a-f]{20}", name)
    others = {
        event_name(JOB, "SDCJobResumed", "stopped"),
        event_name(JOB, "SDCJobSuspended", "stopped again"),
        event_name({"metadata": {**JOB["metadata"], "uid": "new"}}, "SDCJobSuspended", "stopped"),
    }
    assert name not in others and len(others) == 3
    long = event_name({"metadata": {"name": "n" * 300, "uid": "u"}}, "R", "m")
    assert len(long) <= 253 and long.startswith("n" * 200 + ".")


def test_an_event_posted_again_after_a_crash_is_one_event() -> None:
    kube = FakeKube()
    effects, _ = effects_on(kube)

    async def run() -> list[bool]:
        return [
            await effects.emit(JOB, "SDCJobSuspended", "stopped by incident a", True),
            # the same Event again: a retry after a crash, or the other replica
            await effects.emit(JOB, "SDCJobSuspended", "stopped by incident a", True),
            # a second thing said: a second Event (clean path)
            await effects.emit(JOB, "SDCJobSuspended", "stopped by incident b", True),
            # the same words at another time, told apart by the caller
            await effects.emit(
                JOB, "SDCJobSuspended", "stopped by incident b", True, occurrence="2"
            ),
        ]

    assert asyncio.run(run()) == [True, False, True, True]
    assert sorted(e["message"] for e in kube.events()) == [
        "stopped by incident a",
        "stopped by incident b",
        "stopped by incident b",
    ]


def test_a_configmap_is_written_only_where_it_differs() -> None:
    kube = FakeKube()
    effects, _ = effects_on(kube)
    body = {"metadata": {"name": "ca", "namespace": "team-a"}, "data": {"ca.crt": "A"}}

    async def run() -> list[bool]:
        made = await effects.put_configmap(body)
        same = await effects.put_configmap(body)
        changed = await effects.put_configmap({**body, "data": {"ca.crt": "B"}})
        return [made, same, changed]

    assert asyncio.run(run()) == [True, False, True]
    assert kube.objects[("configmaps", "team-a", "ca")]["data"] == {"ca.crt": "B"}
    assert [c for c, p in kube.calls if p == "configmaps"] == [
        "get", "create", "get", "get", "replace"
    ]  # fmt: skip


def test_a_configmap_another_replica_made_meanwhile_is_read_not_overwritten() -> None:
    kube = FakeKube()
    effects, _ = effects_on(kube)
    body = {"metadata": {"name": "ca", "namespace": "team-a"}, "data": {"ca.crt": "A"}}
    kube.race = body  # the other replica's create lands between our read and ours
    assert asyncio.run(effects.put_configmap(body)) is False
    assert [c for c, p in kube.calls if p == "configmaps"] == ["get", "create", "get"]


def test_a_create_that_lost_the_race_reads_the_winner() -> None:
    kube = FakeKube()
    effects, _ = effects_on(kube)
    ours = {"metadata": {"name": "key", "namespace": "sdc"}, "data": {"key": "ours"}}
    made, fresh = asyncio.run(effects.create_once("v1", "secrets", "sdc", ours))
    assert fresh and made["data"] == {"key": "ours"}
    theirs = {"metadata": {"name": "key", "namespace": "sdc"}, "data": {"key": "again"}}
    found, fresh = asyncio.run(effects.create_once("v1", "secrets", "sdc", theirs))
    assert not fresh and found["data"] == {"key": "ours"}


def test_a_pod_delete_says_what_it_found() -> None:
    kube = FakeKube()
    effects, caches = effects_on(kube)
    pod = {"metadata": {"name": "confirm", "namespace": "team-a"}, "spec": {}, "status": {}}

    async def run() -> list[str]:
        created = await effects.create_pod(pod)
        uid = created["metadata"]["uid"]
        assert caches.pods.get("team-a", "confirm") is not None
        deleted = await effects.delete_pod("team-a", "confirm", uid)
        gone = await effects.delete_pod("team-a", "confirm", uid)  # after a restart
        await effects.create_pod(pod)  # a pod of the same name, another uid
        replaced = await effects.delete_pod("team-a", "confirm", uid)
        return [deleted, gone, replaced]

    assert asyncio.run(run()) == ["deleted", "gone", "replaced"]
    assert ("pods", "team-a", "confirm") in kube.objects  # the other pod is left alone
    assert caches.pods.get("team-a", "confirm") is not None


def test_the_job_watch_reads_pods_from_the_cache_and_says_things_once() -> None:
    kube = FakeKube()
    effects, caches = effects_on(kube)
    job = {
        **JOB,
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {"spec": {}}}}},
    }
    job["metadata"] = {**JOB["metadata"], "annotations": {"hyperpod-sdc.dev/enabled": "true"}}
    owner: dict[str, Any] = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "train"}
    owner |= {"uid": "job-uid", "controller": True}
    caches.pods.upsert(
        {
            "metadata": {
                "name": "train-worker-0",
                "namespace": "team-a",
                "uid": "p0",
                "ownerReferences": [owner],
            },
            "status": {"phase": "Running"},
        }
    )

    class Admitted:
        admitted = True

    class Lookups:
        async def admission(self, namespace: str) -> Any:
            return Admitted()

    def watch() -> JobWatch:
        return JobWatch(
            kube,  # type: ignore[arg-type]
            effects,
            caches,
            Lookups(),  # type: ignore[arg-type]
            None,
            [{}],
            CollectorRegistry(),
            lambda: True,
        )

    async def run() -> None:
        first = watch()
        await first.observe("ADDED", job)
        await first.sweep()
        again = watch()  # the operator restarted: its memory of what it said is gone
        await again.observe("ADDED", job)
        await again.sweep()

    asyncio.run(run())
    assert ("list", "pods") not in kube.calls
    assert sorted(e["reason"] for e in kube.events()) == ["SDCAuditLimited", "SDCPodsUnguarded"]
    assert "train-worker-0" in next(
        e["message"] for e in kube.events() if e["reason"] == "SDCPodsUnguarded"
    )


def test_a_job_is_stopped_from_the_cache_and_a_stale_cache_never_skips_it() -> None:
    """Stopping reads the job cache (no GET on the containment path); where the cache says
    the job is stopped already, or lacks it, the job is read again before the stop is
    skipped: a stale cache never leaves a job running."""
    from sdc_operator.actions import Actions
    from sdc_operator.settings import OperatorSettings

    def running(suspend: bool) -> dict[str, Any]:
        job = {**JOB, "spec": {"runPolicy": {"suspend": suspend}}}
        job["metadata"] = {**JOB["metadata"], "resourceVersion": "1"}
        return job

    incident: dict[str, Any] = {
        "metadata": {"name": "i", "namespace": "team-a", "uid": "i-uid"},
        "spec": {"job": {k: JOB[k] for k in ("apiVersion", "kind")} | {"name": "train"}},
    }
    incident["spec"]["job"]["uid"] = "job-uid"
    for cached, actual, reads in (
        (running(False), running(False), 0),  # the common case: from the cache
        (running(True), running(False), 1),  # stale: says stopped, is running
        (None, running(False), 1),  # not in the cache yet
    ):
        kube = FakeKube()
        kube.objects[("pytorchjobs", "team-a", "train")] = actual
        caches = Caches(kube, ["team-a"])  # type: ignore[arg-type]
        if cached is not None:
            caches.jobs[("kubeflow.org/v1", "PyTorchJob")].upsert(cached)

        async def quiet(*_: Any) -> None:
            return None

        actions = Actions(kube, caches, OperatorSettings(), None, quiet)  # type: ignore[arg-type]

        async def stop(actions: Actions = actions) -> Any:
            return await actions._suspend_job(incident)

        outcome = asyncio.run(stop())
        assert outcome.result == "Succeeded", outcome.message
        assert kube.calls.count(("get", "pytorchjobs")) == reads
        assert kube.calls.count(("patch", "pytorchjobs")) == 1
        assert kube.objects[("pytorchjobs", "team-a", "train")]["spec"]["runPolicy"] == {
            "suspend": True
        }
    # Stopped already, as the API server says too: nothing written.
    kube = FakeKube()
    kube.objects[("pytorchjobs", "team-a", "train")] = running(True)
    caches = Caches(kube, ["team-a"])  # type: ignore[arg-type]
    caches.jobs[("kubeflow.org/v1", "PyTorchJob")].upsert(running(True))

    async def quiet2(*_: Any) -> None:
        return None

    actions = Actions(kube, caches, OperatorSettings(), None, quiet2)  # type: ignore[arg-type]
    outcome = asyncio.run(actions._suspend_job(incident))
    assert outcome.result == "Succeeded" and "already" in outcome.message
    assert ("patch", "pytorchjobs") not in kube.calls
