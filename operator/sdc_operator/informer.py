"""Watch-fed caches: LIST once, then WATCH from that version, as client-go's informers do.

An :class:`Informer` keeps a projection of every object of one kind (in one namespace, or
cluster-wide) and its indexes, so the intake answers from memory what it used to ask the
API server for on every report. The LIST is paginated (500 a page, each parsed off the
event loop), the watch resumes from the last version it saw (bookmarks keep that fresh),
and an expired version (410) lists again. A kind whose CRD is not installed reads as empty
and is looked for again every ``absent_retry_seconds``.

Writes the operator makes itself are put into the cache at once (:meth:`Informer.upsert`)
with the object the API server answered, so a decision made right after a write sees it;
the watch event that follows changes nothing unless it is newer, and a LIST (a re-list after
an expired watch) removes only what its snapshot is newer than.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Any

from .errors import ApiError
from .kube import Kube, is_gone, is_not_found, object_path

__all__ = ["ChangeHandler", "Informer", "Projection", "is_newer"]

log = logging.getLogger(__name__)

Projection = Callable[[dict[str, Any]], dict[str, Any]]
"""What of an object to keep (memory: a pod's spec is large, its name and node are not)."""
ChangeHandler = Callable[[dict[str, Any] | None, dict[str, Any] | None], None]
"""Called with (old, new) after every change; new is None for a deletion."""
Indexer = Callable[[dict[str, Any]], Iterable[Hashable]]


def _version(obj: dict[str, Any] | None) -> int | None:
    raw = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


def is_newer(candidate: dict[str, Any], current: dict[str, Any] | None) -> bool:
    """Whether ``candidate`` is at least as new as ``current``. Resource versions are
    etcd revisions (integers) on every API server in use; where one is not, the candidate
    wins (the watch is the authority)."""
    a, b = _version(candidate), _version(current)
    return a is None or b is None or a >= b


def key_of(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))


class Informer:
    def __init__(
        self,
        kube: Kube,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        project: Projection | None = None,
        on_change: ChangeHandler | None = None,
        page_size: int = 500,
        watch_seconds: int = 240,
        absent_retry_seconds: float = 30.0,
    ) -> None:
        self.kube = kube
        self.api_version = api_version
        self.plural = plural
        self.namespace = namespace
        self.project = project or (lambda obj: obj)
        self.on_change = on_change
        self.page_size = page_size
        self.watch_seconds = watch_seconds
        self.absent_retry_seconds = absent_retry_seconds
        self.items: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.absent = False
        """The kind does not exist on this server (its CRD is not installed)."""
        self.resource_version = ""
        self._indexers: dict[str, Indexer] = {}
        self._indexes: dict[str, dict[Hashable, set[str]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._writing = threading.Lock()
        """Held while the items and indexes change: the containment's thread
        (:mod:`.lane`) puts its writes in too. Readers take snapshots (``list``, ``tuple``:
        one step under the GIL), so they need no lock."""

    @property
    def what(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.plural}{where}"

    # -- reading ---------------------------------------------------------------------------

    def get(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.items.get(f"{namespace}/{name}" if namespace else name)

    def values(self) -> list[dict[str, Any]]:
        return list(self.items.values())

    def add_index(self, name: str, indexer: Indexer) -> None:
        self._indexers[name] = indexer
        index: dict[Hashable, set[str]] = {}
        for key, obj in self.items.items():
            for value in indexer(obj):
                index.setdefault(value, set()).add(key)
        self._indexes[name] = index

    def by(self, index: str, value: Hashable) -> list[dict[str, Any]]:
        keys = tuple(self._indexes[index].get(value) or ())
        found = (self.items.get(k) for k in keys)  # another thread may remove one meanwhile
        return [obj for obj in found if obj is not None]

    # -- writing ---------------------------------------------------------------------------

    def upsert(self, obj: dict[str, Any]) -> None:
        """An object the operator just wrote (the API server's answer)."""
        self._store(self.project(obj))

    def forget(self, obj: dict[str, Any]) -> None:
        """An object the operator just deleted."""
        self._remove(key_of(obj))

    def _store(self, obj: dict[str, Any]) -> None:
        key = key_of(obj)
        with self._writing:
            old = self.items.get(key)
            if old is not None and not is_newer(obj, old):
                return
            self.items[key] = obj
            # the new entries first, then the stale ones out: a reader on another thread
            # never finds the object missing from an index it is still in
            for name, indexer in self._indexers.items():
                values = set(indexer(obj))
                for value in values:
                    self._indexes[name].setdefault(value, set()).add(key)
                if old is not None:
                    self._unindex(key, old, name, keep=values)
        self._changed(old, obj)

    def _remove(self, key: str, unless_newer_than: int | None = None) -> None:
        """``key`` out of the cache; kept where its version is newer than
        ``unless_newer_than`` (checked under the lock: another thread may write it)."""
        with self._writing:
            old = self.items.get(key)
            found = _version(old) if old is not None else None
            if unless_newer_than is not None and found is not None and found > unless_newer_than:
                return
            old = self.items.pop(key, None)
            if old is not None:
                self._unindex(key, old)
        if old is not None:
            self._changed(old, None)

    def _unindex(
        self, key: str, obj: dict[str, Any], only: str | None = None, keep: Collection[Any] = ()
    ) -> None:
        """``key`` out of each index (``only``: that one) under ``obj``'s values but
        ``keep``."""
        for name, indexer in self._indexers.items():
            if only is not None and name != only:
                continue
            for value in indexer(obj):
                if value in keep:
                    continue
                keys = self._indexes[name].get(value)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._indexes[name][value]

    def _changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(old, new)
        except Exception:  # a consumer's bug must not stop the cache
            log.exception("handler of a %s change failed", self.plural)

    # -- running ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"watch {self.what}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self._list()
                backoff = 0.5
                while True:
                    await self._watch()
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if is_not_found(exc) and not self.items:
                    if not self.absent:
                        log.info(
                            "%s: not served by this API server; looking again later", self.what
                        )
                    self.absent = True
                    self.synced.set()
                    await asyncio.sleep(self.absent_retry_seconds)
                    continue
                if is_gone(exc):
                    log.info("%s: watch expired, listing again", self.what)
                    continue
                log.warning("%s: %s; trying again in %.1f s", self.what, exc, backoff)
            except Exception:
                log.exception("%s: cache failed; trying again in %.1f s", self.what, backoff)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(30.0, backoff * 2)

    async def _list(self) -> None:
        token = ""
        seen: set[str] = set()
        version = ""
        while True:
            page = await self.kube.list_page(
                self.api_version,
                self.plural,
                self.namespace,
                limit=self.page_size,
                continue_token=token,
            )
            for item in page.get("items") or []:
                obj = self.project(item)
                seen.add(key_of(obj))
                self._store(obj)
            meta = page.get("metadata") or {}
            version = meta.get("resourceVersion") or version
            token = meta.get("continue") or ""
            if not token:
                break
        # What the list did not show is gone, unless it is newer than the list's snapshot:
        # the operator's own write (upsert) or a watch event that came in while the pages
        # were read. Removing that would make a write vanish until the next event.
        snapshot = _version({"metadata": {"resourceVersion": version}})
        for key in [k for k in list(self.items) if k not in seen]:
            self._remove(key, unless_newer_than=snapshot)
        self.resource_version = version
        self.absent = False
        if not self.synced.is_set():
            log.info("%s: cached %d", self.what, len(self.items))
        self.synced.set()

    async def _watch(self) -> None:
        params = {
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_seconds + random.randint(0, 30)),
        }
        path = object_path(self.api_version, self.plural, self.namespace)
        async for event in self.kube.stream(path, resource=self.plural, params=params):
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                code = int(obj.get("code") or 0)
                raise ApiError(code, f"watch {self.what}: {obj.get('message', '')}", obj)
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.resource_version = version
            if kind == "BOOKMARK":
                continue
            if kind == "DELETED":
                self._remove(key_of(obj))
            elif kind in ("ADDED", "MODIFIED"):
                self._store(self.project(obj))
