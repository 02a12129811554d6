"""Which GPU a rank's CUDA device is, told without initializing CUDA: from stand-ins of the
NVIDIA driver's ``/proc/driver/nvidia/gpus`` listing and the environment a container and
torchrun give a process. What these cannot show: that a real driver writes these fields
this way on every version, that the container runtime mounts only the container's GPUs
there, and that CUDA numbers devices as ``CUDA_DEVICE_ORDER`` says (a GPU machine can:
the ``gpu`` test below compares with torch's own answer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sdc_agent import gpu_identity, topology
from sdc_agent.gpu_identity import device_files, driver_gpus, uuid_of_device

UUIDS = [f"GPU-{i}1234567-89ab-cdef-0123-456789abcdef" for i in range(4)]
BUSES = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]


def listing(root: Path, which: range | list[int] = range(4)) -> Path:
    """The driver's listing of GPUs ``which`` (directories made out of bus order)."""
    for i in reversed(list(which)):
        entry = root / BUSES[i]
        entry.mkdir(parents=True)
        (entry / "information").write_text(
            "Model: \t\t NVIDIA H100 80GB HBM3\n"
            "IRQ:   \t\t 123\n"
            f"GPU UUID: \t {UUIDS[i]}\n"
            "Video BIOS: \t 96.00.99.00.01\n"
            "Bus Type: \t PCIe\n"
            f"Bus Location: \t {BUSES[i]}\n"
            f"Device Minor: \t {i}\n"
            "GPU Excluded:\t No\n"
        )
    return root


def test_the_drivers_listing_is_read_in_pci_bus_order(tmp_path: Path) -> None:
    gpus = driver_gpus(listing(tmp_path / "gpus"))
    assert [g.uuid for g in gpus] == UUIDS and [g.bus for g in gpus] == BUSES
    assert gpus[0].model == "NVIDIA H100 80GB HBM3"
    assert driver_gpus(tmp_path / "absent") == []
    broken = listing(tmp_path / "broken")
    (broken / BUSES[2] / "information").write_text("Model: x\nGPU UUID: ??\n")
    assert driver_gpus(broken) == []  # in part, it would number the GPUs wrongly


def test_a_device_is_named_only_where_its_number_is_certain(tmp_path: Path) -> None:
    gpus = driver_gpus(listing(tmp_path / "gpus"))
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    # CUDA's default order (FASTEST_FIRST) leaves equal GPUs' order unspecified
    assert uuid_of_device(1, {}, gpus) is None
    assert [uuid_of_device(i, pci, gpus) for i in range(5)] == [*UUIDS, None]
    # CUDA_VISIBLE_DEVICES renumbers: device 0 is the third GPU, device 1 the first
    assert uuid_of_device(0, {**pci, "CUDA_VISIBLE_DEVICES": "2,0"}, gpus) == UUIDS[2]
    assert uuid_of_device(1, {**pci, "CUDA_VISIBLE_DEVICES": "2,0"}, gpus) == UUIDS[0]
    assert uuid_of_device(2, {**pci, "CUDA_VISIBLE_DEVICES": "2,0"}, gpus) is None
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": "2,0"}, gpus) is None
    # a UUID (or a unique prefix of one) names the GPU in any order
    assert uuid_of_device(1, {"CUDA_VISIBLE_DEVICES": f"0,{UUIDS[3]}"}, gpus) == UUIDS[3]
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-2"}, gpus) == UUIDS[2]
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-"}, gpus) is None  # ambiguous
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": f"{UUIDS[1]}"}, []) == UUIDS[1]
    # a MIG instance is not a whole GPU; CUDA stops reading the list at a bad entry
    assert uuid_of_device(0, {**pci, "CUDA_VISIBLE_DEVICES": "MIG-abc"}, gpus) is None
    assert uuid_of_device(1, {**pci, "CUDA_VISIBLE_DEVICES": "x,1"}, gpus) is None
    assert uuid_of_device(-1, pci, gpus) is None


def test_a_process_that_sees_one_gpu_knows_it(tmp_path: Path) -> None:
    one = driver_gpus(listing(tmp_path / "one", [2]))
    assert uuid_of_device(0, {}, one) == UUIDS[2]
    assert uuid_of_device(1, {}, one) is None
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": "0"}, one) == UUIDS[2]
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": "1"}, one) is None
    assert uuid_of_device(0, {}, []) is None  # no driver listing: no GPU to name


def test_the_device_plugins_list_narrows_a_listing_that_shows_the_whole_node(
    tmp_path: Path,
) -> None:
    """A runtime that left the host's whole listing visible: ``NVIDIA_VISIBLE_DEVICES``
    (the device plugin's UUIDs) says which GPUs the container has."""
    gpus = driver_gpus(listing(tmp_path / "gpus"))
    env = {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[3]},{UUIDS[1]}"}
    assert uuid_of_device(1, {**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, gpus) == UUIDS[3]
    assert uuid_of_device(0, {"NVIDIA_VISIBLE_DEVICES": UUIDS[2]}, gpus) == UUIDS[2]
    unknown = {"NVIDIA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000000"}
    assert uuid_of_device(0, unknown, gpus) is None
    assert uuid_of_device(0, {"NVIDIA_VISIBLE_DEVICES": "all"}, gpus) is None  # four: order


def device_dir(root: Path, count: int) -> Path:
    """A stand-in of ``/dev`` with ``count`` GPU device files beside the driver's others."""
    root.mkdir(parents=True)
    for name in [*(f"nvidia{i}" for i in range(count)), "nvidiactl", "nvidia-uvm", "null"]:
        (root / name).touch()
    return root


def test_a_number_is_told_only_where_the_device_files_agree_with_the_listing(
    tmp_path: Path,
) -> None:
    """CUDA numbers the GPUs whose device files the process has. A privileged pod has every
    device file while ``NVIDIA_VISIBLE_DEVICES`` names the device plugin's GPUs; a CDI
    runtime can leave the host's whole listing in ``/proc`` with only the container's
    device files. Either way the listing's order is not CUDA's, so no number is named;
    a UUID in ``CUDA_VISIBLE_DEVICES`` still is."""
    assert device_files(device_dir(tmp_path / "dev", 4)) == 4
    assert device_files(tmp_path / "absent") is None
    gpus = driver_gpus(listing(tmp_path / "gpus"))
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    privileged = {**pci, "NVIDIA_VISIBLE_DEVICES": f"{UUIDS[3]},{UUIDS[1]}"}
    assert uuid_of_device(1, privileged, gpus, devices=2) == UUIDS[3]  # what the runtime mounts
    assert uuid_of_device(1, privileged, gpus, devices=4) is None  # privileged: CUDA sees 4
    one = {"NVIDIA_VISIBLE_DEVICES": UUIDS[2]}
    assert uuid_of_device(0, one, gpus, devices=1) == UUIDS[2]
    assert uuid_of_device(0, one, gpus, devices=4) is None
    assert uuid_of_device(1, pci, gpus, devices=2) is None  # CDI: the host's whole listing
    assert uuid_of_device(1, pci, gpus, devices=4) == UUIDS[1]
    assert uuid_of_device(0, {"CUDA_VISIBLE_DEVICES": UUIDS[3]}, gpus, devices=1) == UUIDS[3]


def test_a_rank_reports_its_models_gpu_not_the_current_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity a rank exchanges at start-up names the GPU its model is on (with gloo
    the collectives run on the CPU, and the current CUDA device is 0 on a rank that never
    called ``set_device``), told without CUDA where CUDA is not initialized."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the gpu test compares with torch's own answer")
    monkeypatch.setattr(gpu_identity, "DRIVER_GPUS", str(listing(tmp_path / "gpus")))
    monkeypatch.setattr(gpu_identity, "DEVICE_FILES", str(device_dir(tmp_path / "dev", 4)))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert topology._gpu_uuid(torch.device("cuda", 2)) == UUIDS[2]
    assert topology._gpu_uuid(torch.device("cuda")) == UUIDS[3]  # torchrun's local rank
    assert topology._gpu_uuid(torch.device("cpu")) is None
    assert not torch.cuda.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        found = topology.discover_topology(
            None, "node-a", torch.device("cpu"), model_device=torch.device("cuda", 1)
        )
    finally:
        dist.destroy_process_group()
    assert found.ranks[0].gpu_uuid == UUIDS[1]


@pytest.mark.gpu
def test_on_a_gpu_the_answer_without_cuda_is_torchs() -> None:
    """Where it answers, the driver's listing and the environment agree with torch (run
    in a fresh process: this one's CUDA may be initialized)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    script = (
        "import json, torch\n"
        "from sdc_agent.gpu_identity import uuid_of_device\n"
        "n = torch.cuda.device_count()\n"
        "before = [uuid_of_device(i) for i in range(n)]\n"
        "assert not torch.cuda.is_initialized()\n"
        "torch.cuda.init()\n"
        "after = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]\n"
        "print(json.dumps([before, after]))\n"
    )
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    after = [u if u.startswith("GPU-") else f"GPU-{u}" for u in after]
    assert before == after and all(before), (before, after)
