"""Which physical GPU a CUDA device number is, told without initializing CUDA.

The operator finds the suspect's GPU among those its confirmation pod runs on by UUID
(a pod's CUDA devices are numbered from 0, so a local rank names a GPU of that pod, not of
the training pod's). torch reports a device's UUID only once CUDA is initialized
(:func:`torch.cuda.get_device_properties` initializes it), which a process may not have
done yet when it reports its identity. This module answers from what needs no CUDA:

- ``/proc/driver/nvidia/gpus/<PCI bus location>/information`` (the NVIDIA driver's own
  listing: ``GPU UUID``, ``Bus Location``, ``Model``). In a container the NVIDIA container
  runtime mounts only the container's GPUs there; where ``NVIDIA_VISIBLE_DEVICES`` lists
  UUIDs (the NVIDIA device plugin's default) the listing is narrowed to those as well;
- ``CUDA_VISIBLE_DEVICES``, which renumbers the devices a process sees (indices, or
  ``GPU-`` UUIDs or unique prefixes of them);
- ``CUDA_DEVICE_ORDER``: only ``PCI_BUS_ID`` makes CUDA's numbering the PCI bus order;
  the default ``FASTEST_FIRST`` leaves the order of equal devices unspecified.

- the device files ``/dev/nvidia0``, ``/dev/nvidia1``, ...: CUDA numbers the GPUs it can
  open, so a number is told from the listing only where the listing (narrowed as above)
  counts as many GPUs as there are device files. They differ in a privileged pod (every
  device file, the device plugin's GPUs in ``NVIDIA_VISIBLE_DEVICES``) and where a runtime
  (CDI) leaves the host's whole listing in ``/proc`` but mounts only the container's devices.

It answers only where that is certain and ``None`` otherwise (the operator then matches
by local rank, as before): a ``GPU-`` entry of ``CUDA_VISIBLE_DEVICES``; a device number
under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; or a process that sees exactly one GPU; the last
two only where the listing and the device files agree. A MIG instance (``MIG-`` entries)
is not a whole GPU and gets ``None``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEVICE_FILES",
    "DRIVER_GPUS",
    "DriverGpu",
    "device_files",
    "driver_gpus",
    "uuid_of_device",
]

DRIVER_GPUS = "/proc/driver/nvidia/gpus"
"""Where the NVIDIA driver lists its GPUs, one directory per PCI bus location."""
DEVICE_FILES = "/dev"
"""Where the GPUs' device files (``nvidia0``, ``nvidia1``, ...) are."""
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_DEVICE_FILE = re.compile(r"^nvidia[0-9]+$")


@dataclass(frozen=True, slots=True)
class DriverGpu:
    bus: str
    """PCI bus location, lower case (``0000:18:00.0``)."""
    uuid: str
    """``GPU-`` and 36 characters."""
    model: str


def driver_gpus(root: str | os.PathLike[str] | None = None) -> list[DriverGpu]:
    """The GPUs the driver lists under ``root`` (default :data:`DRIVER_GPUS`), in PCI bus
    order; ``[]`` where there is no listing (no NVIDIA driver, or not mounted) or an entry
    cannot be read whole."""
    try:
        entries = sorted(Path(DRIVER_GPUS if root is None else root).iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            text = (entry / "information").read_text(errors="replace")
        except OSError:
            return []  # a listing read in part would number the GPUs wrongly
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        uuid = fields.get("GPU UUID", "")
        if not _UUID.match(uuid):
            return []
        bus = (fields.get("Bus Location") or entry.name).lower()
        found.append(DriverGpu(bus=bus, uuid=uuid, model=fields.get("Model", "")))
    return sorted(found, key=lambda g: g.bus)


def device_files(root: str | os.PathLike[str] | None = None) -> int | None:
    """How many GPU device files (``nvidia<N>``) ``root`` (default :data:`DEVICE_FILES`)
    holds; ``None`` where it cannot be read."""
    try:
        return sum(
            1
            for p in Path(DEVICE_FILES if root is None else root).iterdir()
            if _DEVICE_FILE.match(p.name)
        )
    except OSError:
        return None


def _visible_to_container(
    gpus: Sequence[DriverGpu], environ: Mapping[str, str]
) -> list[DriverGpu] | None:
    """``gpus`` narrowed to ``NVIDIA_VISIBLE_DEVICES`` where it lists GPU UUIDs (each must
    be listed by the driver, else ``None``); as they are otherwise."""
    named = [v.strip() for v in environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not named or not all(v.startswith("GPU-") for v in named):
        return list(gpus)
    by_uuid = {g.uuid: g for g in gpus}
    if not all(v in by_uuid for v in named):
        return None
    return [g for g in gpus if g.uuid in set(named)]


def uuid_of_device(
    ordinal: int,
    environ: Mapping[str, str] | None = None,
    gpus: Sequence[DriverGpu] | None = None,
    devices: int | None = None,
) -> str | None:
    """The UUID of CUDA device ``ordinal`` as this process numbers it, or ``None`` where
    that cannot be told for certain without initializing CUDA (see the module's
    docstring). ``environ``: default ``os.environ``; ``gpus``: default
    :func:`driver_gpus`; ``devices``: how many device files the process has, default
    :func:`device_files` where ``gpus`` is the default too (not compared otherwise)."""
    environ = os.environ if environ is None else environ
    listed = driver_gpus() if gpus is None else list(gpus)
    if devices is None and gpus is None:
        devices = device_files()
    seen = _visible_to_container(listed, environ)
    if ordinal < 0 or seen is None:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",")]
        if ordinal >= len(entries) or not all(
            e.isdigit() or e.startswith(("GPU-", "MIG-")) for e in entries[: ordinal + 1]
        ):
            return None  # CUDA stops reading the list at an entry it cannot parse
        entry = entries[ordinal]
        if entry.startswith("GPU-"):
            matches = [g.uuid for g in seen if g.uuid.lower().startswith(entry.lower())]
            if len(matches) == 1:
                return matches[0]
            return entry if not seen and _UUID.match(entry) else None
        if not entry.isdigit():
            return None  # MIG-..., or not a device: CUDA's to make sense of
        ordinal = int(entry)
    if devices is not None and devices != len(seen):
        return None  # CUDA numbers other GPUs than the listing shows (privileged, CDI)
    if len(seen) == 1:
        return seen[0].uuid if ordinal == 0 else None
    if environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" and ordinal < len(seen):
        return seen[ordinal].uuid
    return None
