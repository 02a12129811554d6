"""The informer's LIST against a scripted API (its own collaborator, the REST client, stands
in): a re-list keeps what is newer than its snapshot."""

from __future__ import annotations

import asyncio
from typing import Any

from sdc_operator.informer import Informer


def _pod(name: str, version: int) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": str(version)}}


class _Pages:
    """Answers LIST pages; ``between`` runs after the first page is read (as a write of
    the operator's own lands while the rest of the list is still being read)."""

    def __init__(self, pages: list[dict[str, Any]], between: Any = None) -> None:
        self.pages = pages
        self.between = between
        self.served = 0

    async def list_page(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        page = self.pages[self.served]
        self.served += 1
        if self.served == 2 and self.between is not None:
            self.between()
        return page


def _relist(
    pages: list[dict[str, Any]], cached: list[dict[str, Any]], between: Any = None
) -> Informer:
    scripted = _Pages(pages)
    informer = Informer(scripted, "v1", "pods")  # type: ignore[arg-type]
    if between is not None:
        scripted.between = lambda: between(informer)
    for obj in cached:
        informer.upsert(obj)
    asyncio.run(informer._list())
    return informer


def test_a_relist_keeps_an_entry_newer_than_its_snapshot() -> None:
    """The snapshot is at version 100; the operator created pod b (version 105) after it
    was taken, and a's watch event (version 104) came in meanwhile too: both stay, and
    what the snapshot is newer than (c, deleted before version 100) goes."""
    pages: list[dict[str, Any]] = [
        {"items": [_pod("a", 90)], "metadata": {"continue": "next", "resourceVersion": "100"}},
        {"items": [], "metadata": {"resourceVersion": "100"}},
    ]

    def written(informer: Informer) -> None:
        informer.upsert(_pod("b", 105))
        informer.upsert(_pod("a", 104))

    informer = _relist(pages, [_pod("c", 80)], written)
    assert sorted(informer.items) == ["ns/a", "ns/b"]
    assert informer.items["ns/a"]["metadata"]["resourceVersion"] == "104"
    assert informer.resource_version == "100"


def test_a_relist_removes_what_its_snapshot_is_newer_than() -> None:
    """The clean run: an entry older than the snapshot and not listed was deleted."""
    pages: list[dict[str, Any]] = [
        {"items": [_pod("a", 95)], "metadata": {"resourceVersion": "100"}}
    ]
    informer = _relist(pages, [_pod("a", 90), _pod("gone", 99)])
    assert sorted(informer.items) == ["ns/a"]


def test_an_index_never_misses_an_object_another_thread_is_rewriting() -> None:
    """The containment's thread puts its writes into the caches while the intake's loop
    reads them: an object rewritten there (new versions, same index value) is in its index
    at every read here, and new objects written there do not break a read (a set that
    changes size while it is iterated raises). Without the snapshot and the new-entries-
    first order, the reads below find "a" missing or raise within a few thousand tries."""
    import threading

    informer = Informer(None, "v1", "pods")  # type: ignore[arg-type]
    informer.add_index("owner", lambda obj: [obj["metadata"].get("owner", "none")])

    def owned(name: str, version: int) -> dict[str, Any]:
        pod = _pod(name, version)
        pod["metadata"]["owner"] = "job"
        return pod

    informer.upsert(owned("a", 1))
    stop = threading.Event()

    def rewrite() -> None:
        version = 2
        while not stop.is_set():
            informer.upsert(owned("a", version))
            other = owned(f"other-{version % 50}", version)
            if version % 100 < 50:
                informer.upsert(other)
            else:
                informer.forget(other)
            version += 1

    writer = threading.Thread(target=rewrite)
    writer.start()
    misses = reads = 0
    try:
        for _ in range(20_000):
            found = informer.by("owner", "job")
            reads += 1
            misses += not any(p["metadata"]["name"] == "a" for p in found)
    finally:
        stop.set()
        writer.join()
    assert reads == 20_000 and misses == 0
    assert len(informer.by("owner", "job")) == len(informer.items)
