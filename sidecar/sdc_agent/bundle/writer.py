"""Writing a bundle, on a background thread: serialized into a temporary directory beside
its place and renamed into place when whole."""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .format import _PARTS, MANIFEST, _required, bundle_path
from .snapshot import EvidenceSnapshot, take_snapshot

__all__ = ["BundleWriter", "WriteResult", "write_bundle"]

log = logging.getLogger("sdc_agent.bundle")

_EXIT_WAIT_SECONDS = 120.0
"""At interpreter exit, how long a bundle still being written may hold the process."""
_CHUNK = 1 << 22  # bytes hashed and written at a time


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: Path
    written: bool
    """The bundle is in place (complete or not)."""
    complete: bool = False
    bytes: int = 0
    seconds: float = 0.0
    left_out: tuple[str, ...] = ()
    error: str | None = None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingFile:
    """What ``torch.save`` writes into: the file, hashed on the way (no second read of a
    large bundle), in chunks so the GIL is free between them."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115  (closed by _save)
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            chunk = view[start : start + _CHUNK]
            self.digest.update(chunk)  # releases the GIL for large buffers
            self.file.write(chunk)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.file.flush()


def _save(obj: Any, path: Path) -> tuple[int, str]:
    out = _HashingFile(path)
    try:
        torch.save(obj, out)  # type: ignore[arg-type]  # it needs write() only
        out.file.flush()
        os.fsync(out.file.fileno())
    finally:
        out.file.close()
    return out.size, out.digest.hexdigest()


def write_bundle(snapshot: EvidenceSnapshot, path: str | os.PathLike[str]) -> WriteResult:
    """Write ``snapshot`` as a bundle at ``path``: into a temporary directory beside it,
    renamed into place when whole. An existing bundle at ``path`` is left as it is."""
    started = time.perf_counter()
    final = Path(path)
    try:
        snapshot.copier.wait()
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            return WriteResult(final, False, error="a bundle is already there; left as it is")
        # Not tempfile.mkdtemp: its 0700 would keep the bundle from a confirmation pod
        # that runs as another user; the process's umask decides, as for the checkpoints.
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}"
        tmp.mkdir()
    except Exception as exc:
        return WriteResult(final, False, error=f"{type(exc).__name__}: {exc}")
    try:
        manifest = copy.deepcopy(snapshot.manifest)
        model = manifest["model"]
        files: dict[str, dict[str, Any]] = {}
        left_out = list(snapshot.left_out)
        total = 0
        for part in _PARTS:
            obj = snapshot.parts.get(part)
            if obj is None:
                continue
            estimate = snapshot.estimated_bytes.get(part, 0)
            if total + estimate > snapshot.max_bytes:
                left_out.append({"file": part, "bytes": estimate, "why": "over bundle_max_bytes"})
                continue
            try:
                size, digest = _save(obj, tmp / part)
            except Exception as exc:
                if part != "module.pt":
                    raise
                # The module does not pickle (a lambda, a class made at run time): the
                # weights are there, a factory can rebuild the model.
                (tmp / part).unlink(missing_ok=True)
                model["how"] = "unavailable"
                model["reason"] = (
                    f"the module does not pickle ({type(exc).__name__}: {exc}); give a "
                    "bundle factory"
                )
                continue
            if total + size > snapshot.max_bytes:
                (tmp / part).unlink()
                left_out.append(
                    {"file": part, "bytes": size, "why": "over bundle_max_bytes once written"}
                )
                continue
            files[part] = {"bytes": size, "sha256": digest}
            total += size
        manifest["files"] = files
        manifest["left_out"] = left_out
        manifest["complete"] = model["how"] != "unavailable" and all(
            p in files for p in _required(model["how"])
        )
        manifest["bytes"] = total
        manifest["write_seconds"] = round(time.perf_counter() - started, 6)
        manifest["snapshot_seconds"] = round(snapshot.seconds, 6)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if final.exists():  # another writer got there first
                shutil.rmtree(tmp, ignore_errors=True)
                return WriteResult(final, False, error="a bundle is already there; left as it is")
            raise
        _fsync_dir(final.parent)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return WriteResult(final, False, error=f"{type(exc).__name__}: {exc}")
    return WriteResult(
        final,
        True,
        complete=bool(manifest["complete"]),
        bytes=total,
        seconds=time.perf_counter() - started,
        left_out=tuple(str(e["file"]) for e in left_out),
    )


class BundleWriter:
    """Writes bundles on one background thread (lower CPU priority), one at a time.

    :meth:`submit` never blocks: while a bundle is being written and another is waiting,
    a third is dropped with a warning (evidence of one incident is enough to confirm it;
    training must not wait).
    """

    def __init__(self, *, max_pending: int = 1, nice: int = 10) -> None:
        self._max_pending = max_pending
        self._nice = nice
        self._pending: list[tuple[EvidenceSnapshot, Path]] = []
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.results: list[WriteResult] = []
        """Every finished write, in order."""

    def has_room(self) -> bool:
        """Whether :meth:`submit` would take another bundle now (it stays true until the
        caller submits one: the writer only ever makes room)."""
        with self._cond:
            return not self._closed and len(self._pending) < self._max_pending

    def submit(self, snapshot: EvidenceSnapshot, directory: str | os.PathLike[str]) -> Path | None:
        """Queue ``snapshot`` for ``<directory>/sdc-evidence/...``; returns where the
        bundle will be, or ``None`` when it was dropped."""
        path = bundle_path(directory, snapshot.run_id, snapshot.step, snapshot.suspect_rank)
        with self._cond:
            if self._closed:
                return None
            if len(self._pending) >= self._max_pending:
                warnings.warn(
                    f"sdc_agent: evidence bundle {path.name} dropped: the writer is still busy "
                    "with earlier ones",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return None
            self._pending.append((snapshot, path))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sdc-bundle-writer", daemon=True
                )
                self._thread.start()
                # A process that ends without close() still finishes the bundle in hand.
                atexit.register(self.close, _EXIT_WAIT_SECONDS)
            self._cond.notify_all()
        return path

    def capture(
        self, directory: str | os.PathLike[str] | None, **snapshot_args: Any
    ) -> Path | None:
        """:func:`take_snapshot` and :meth:`submit`, never raising: a failure is a warning
        and ``None`` (training goes on whatever happens to the evidence)."""
        if directory is None:
            return None
        try:
            return self.submit(take_snapshot(**snapshot_args), directory)
        except Exception as exc:
            warnings.warn(
                f"sdc_agent: no evidence bundle ({type(exc).__name__}: {exc})",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def _run(self) -> None:
        # Linux: a thread is a task with its own nice value; elsewhere this does nothing.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                snapshot, path = self._pending.pop(0)
                self._busy = True
            result = write_bundle(snapshot, path)
            if result.error:
                log.warning("sdc_agent: evidence bundle %s not written: %s", path, result.error)
            elif not result.complete:
                log.warning(
                    "sdc_agent: evidence bundle %s written without %s", path, result.left_out
                )
            with self._cond:
                self.results.append(result)
                self._busy = False
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until everything submitted is written; false if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 60.0) -> bool:
        """Finish what was submitted (up to ``timeout``), then stop the thread."""
        started = time.monotonic()
        done = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and done:
            # A writer thread still inside torch at interpreter exit aborts the process
            # ("terminate called without an active exception"): let it end first.
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            thread.join(left)
        return done
