"""Two replicas, one of which acts: leader election with a ``coordination.k8s.io/v1``
Lease, the way client-go's leaderelection does it, and what the replicas tell each other.

Why a Lease and not kopf's peering: every replica must serve the intake (the Service
routes to either, and the admission webhook needs both) from watch-fed caches, and kopf's
peering pauses all of a standby's watches, caches included. So kopf runs standalone in
each replica, and this module decides which one acts (patches, SageMaker calls).

- The leader renews the Lease every ``lease_seconds / 5``. If it cannot renew for
  ``0.7 * lease_seconds`` it stops acting, before anyone else may take over; a renewal
  that hangs is abandoned at that deadline. A renewal counts from when it was sent, so a
  late answer does not lengthen the term.
- A standby takes over when the Lease has not changed for ``lease_seconds`` on its own
  clock (no clock comparison between machines), so at most ``lease_seconds`` plus one retry
  after the leader died: 12 s with the default 10.
- A replica that stops cleanly gives the Lease up, so a rolling update hands over at once.

The election runs on a thread and event loop of its own (:class:`ElectionThread`), with
its own connections to the API server: a storm that saturates the intake's event loop
cannot delay a renewal past the deadline and cost the leader its Lease. Its decisions reach
the operator's loop as callbacks, but that loop may be seconds late in a storm: "stop
acting" is also handed, on the election's thread and at once, to ``stop_acting``
(the engine's, which runs on a thread of its own too), well within the
``0.3 * lease_seconds`` before a standby may take over (it waits a whole
``lease_seconds`` on its own clock).

Each replica also keeps a member Lease (``<lease>-member-<hash of its name>``) that says,
in an annotation, when it last heard a heartbeat from each job; the leader reads them to
tell a silent job from one whose heartbeats went to the other replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from .errors import ApiError
from .kube import Kube, is_conflict, is_not_found
from .lane import LoopThread
from .names import GROUP
from .times import micro_time, parse_micro_time

__all__ = ["ElectionThread", "LeaderElector", "Members", "micro_time"]

log = logging.getLogger(__name__)
COORDINATION = "coordination.k8s.io/v1"
HEARTBEATS_ANNOTATION = f"{GROUP}/heartbeats"
MEMBER_LABEL = f"{GROUP}/member-of"


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float,
        *,
        on_start: Callable[[], None],
        on_stop: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.retry_seconds = max(0.2, lease_seconds / 5)
        self.renew_deadline = 0.7 * lease_seconds
        self._on_start = on_start
        self._on_stop = on_stop
        self._clock = clock
        self.is_leader = False
        self.holder = ""
        self._observed: tuple[str, str] | None = None
        self._observed_at = 0.0
        self._renewed_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="leader election")

    async def run(self) -> None:
        while True:
            # Bounded: a leader whose renewal hangs (a partition, a stuck connection) must
            # stop acting by its renew deadline, not whenever the call gives up.
            timeout = self.lease_seconds / 2
            if self.is_leader:
                timeout = max(0.05, self.renew_deadline - (self._clock() - self._renewed_at))
            try:
                await self._bounded_step(timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("leader election: %s", exc)
            if self.is_leader and self._clock() - self._renewed_at > self.renew_deadline:
                log.error(
                    "leader election: could not renew the Lease %s/%s for %.1f s; no longer acting",
                    self.namespace,
                    self.name,
                    self.renew_deadline,
                )
                self._lose()
            await asyncio.sleep(self.retry_seconds)

    async def _bounded_step(self, timeout: float) -> None:
        """:meth:`step`, abandoned after ``timeout`` seconds. Not ``asyncio.wait_for``: on
        Python < 3.12 it can swallow a cancellation that meets a step ending at once (the
        API server refusing), and the election would never stop."""
        task = asyncio.ensure_future(self.step())
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        finally:
            if not task.done():
                task.cancel()
        if not done:
            raise TimeoutError(f"the API server did not answer within {timeout:.1f} s")
        task.result()

    def _spec(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        now = micro_time()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_seconds)),
            "acquireTime": acquired or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def step(self) -> None:
        # A renewal counts from when it was sent, not from when its answer came: the API
        # server may have written it at once, and a standby counts the Lease's duration
        # from then. An answer that arrives late must not lengthen the leader's term.
        sent = self._clock()
        try:
            lease = await self.kube.get(COORDINATION, "leases", self.namespace, self.name)
        except ApiError as exc:
            if not is_not_found(exc):
                raise
            body = {
                "apiVersion": COORDINATION,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(0),
            }
            try:
                await self.kube.create(COORDINATION, "leases", self.namespace, body)
            except ApiError as exc2:
                if is_conflict(exc2):
                    return
                raise
            self._win(sent)
            return
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        self.holder = holder
        record = (holder, str(spec.get("renewTime") or ""))
        now = self._clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            lease["spec"] = self._spec(transitions, spec.get("acquireTime"))
        elif not holder or now - self._observed_at > duration:
            lease["spec"] = self._spec(transitions + 1)
            log.info(
                "leader election: taking over the Lease %s/%s from %s",
                self.namespace,
                self.name,
                holder or "nobody",
            )
        else:
            if self.is_leader:
                self._lose()
            return
        try:
            await self.kube.replace(COORDINATION, "leases", self.namespace, lease)
        except ApiError as exc:
            if is_conflict(exc):  # someone else renewed or took it first
                return
            raise
        self._win(sent)

    def _win(self, sent: float) -> None:
        self._renewed_at = sent
        self.holder = self.identity
        if not self.is_leader:
            self.is_leader = True
            log.warning("leader election: %s is the leader: acting on the cluster", self.identity)
            self._on_start()

    def _lose(self) -> None:
        if self.is_leader:
            self.is_leader = False
            log.warning("leader election: %s is a standby: serving, not acting", self.identity)
            self._on_stop()

    async def stop(self) -> None:
        """Stop, and give the Lease up if held so a standby takes over at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if not self.is_leader:
            return
        self._lose()
        try:
            lease = await self.kube.get(COORDINATION, "leases", self.namespace, self.name)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                await self.kube.replace(COORDINATION, "leases", self.namespace, lease)
        except ApiError as exc:
            log.warning("leader election: could not give the Lease up: %s", exc)


class ElectionThread:
    """A :class:`LeaderElector` on a thread and event loop of its own, whose ``kube`` is
    used (and closed) there only; ``on_start`` and ``on_stop`` run on the loop that called
    :meth:`start`, ``stop_acting`` on the election's thread, before ``on_stop`` is posted
    and before the Lease is given up (it must be safe to call from any thread)."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float,
        *,
        on_start: Callable[[], None],
        on_stop: Callable[[], None],
        stop_acting: Callable[[], None] = lambda: None,
    ) -> None:
        self._on_start, self._on_stop = on_start, on_stop
        self._stop_acting = stop_acting
        self.elector = LeaderElector(
            kube,
            namespace,
            name,
            identity,
            lease_seconds,
            on_start=self._started,
            on_stop=self._stopped,
        )
        self._lane = LoopThread("leader election")

    @property
    def is_leader(self) -> bool:
        return self.elector.is_leader

    @property
    def holder(self) -> str:
        return self.elector.holder

    def start(self) -> None:
        self._main = asyncio.get_running_loop()
        self._lane.start()
        self._lane.call(self.elector.start)

    def _started(self) -> None:
        self._main.call_soon_threadsafe(self._on_start)

    def _stopped(self) -> None:
        try:
            self._stop_acting()
        finally:  # the loop's side (metrics, standby) whatever happened on the engine's
            self._main.call_soon_threadsafe(self._on_stop)

    async def stop(self) -> None:
        """Stop the election (giving the Lease up if held), then the thread."""
        if not self._lane.alive:
            return

        async def shutdown() -> None:
            try:
                await self.elector.stop()
            finally:
                await self.elector.kube.close()

        await self._lane.run(shutdown())
        await self._lane.stop()


class Members:
    """This replica's member Lease, and what the others published in theirs."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        lease_name: str,
        identity: str,
        *,
        last_seen: Callable[[], dict[str, float]],
        stale_seconds: float = 600.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.lease_name = lease_name
        self.identity = identity
        self.name = (
            f"{lease_name[:200]}-member-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"
        )
        self._last_seen = last_seen
        self.stale_seconds = stale_seconds
        self._version = ""

    async def publish(self) -> None:
        body: dict[str, Any] = {
            "apiVersion": COORDINATION,
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {MEMBER_LABEL: self.lease_name[:63]},
                "annotations": {
                    HEARTBEATS_ANNOTATION: json.dumps(
                        {k: round(v, 1) for k, v in self._last_seen().items()},
                        separators=(",", ":"),
                    )
                },
            },
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": round(self.stale_seconds),
                "renewTime": micro_time(),
            },
        }
        if self._version:  # one request in the common case: our own last write's version
            body["metadata"]["resourceVersion"] = self._version
            try:
                written = await self.kube.replace(COORDINATION, "leases", self.namespace, body)
                self._version = written["metadata"]["resourceVersion"]
                return
            except ApiError as exc:
                if not (is_conflict(exc) or is_not_found(exc)):
                    raise
        try:
            current = await self.kube.get(COORDINATION, "leases", self.namespace, self.name)
        except ApiError as exc:
            if not is_not_found(exc):
                raise
            body["metadata"].pop("resourceVersion", None)
            written = await self.kube.create(COORDINATION, "leases", self.namespace, body)
            self._version = written["metadata"]["resourceVersion"]
            return
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        written = await self.kube.replace(COORDINATION, "leases", self.namespace, body)
        self._version = written["metadata"]["resourceVersion"]

    async def peers(self, prune: bool = False) -> dict[str, float]:
        """The newest time any other replica heard from each job; with ``prune``, member
        Leases of replicas gone for ``stale_seconds`` are deleted."""
        found = await self.kube.list_all(
            COORDINATION,
            "leases",
            self.namespace,
            label_selector=f"{MEMBER_LABEL}={self.lease_name[:63]}",
        )
        merged: dict[str, float] = {}
        now = datetime.now(timezone.utc)
        for lease in found:
            meta = lease.get("metadata") or {}
            if meta.get("name") == self.name:
                continue
            renewed = str((lease.get("spec") or {}).get("renewTime") or "")
            try:
                age = (now - parse_micro_time(renewed)).total_seconds()
            except ValueError:
                age = float("inf")
            if age > self.stale_seconds:
                if prune:
                    try:
                        await self.kube.delete(
                            COORDINATION,
                            "leases",
                            self.namespace,
                            meta["name"],
                            uid=meta.get("uid"),
                            resource_version=meta.get("resourceVersion"),
                        )  # not one its replica renewed since it was read (409)
                    except ApiError as exc:
                        log.info(
                            "could not delete the stale member Lease %s: %s", meta["name"], exc
                        )
                continue
            try:
                seen = json.loads((meta.get("annotations") or {}).get(HEARTBEATS_ANNOTATION, "{}"))
            except ValueError:
                continue
            if not isinstance(seen, dict):
                continue
            for job, at in seen.items():
                if isinstance(at, int | float):
                    merged[job] = max(merged.get(job, 0.0), float(at))
        return merged
